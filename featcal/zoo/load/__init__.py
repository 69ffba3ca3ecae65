"""Loading a located spec into a :class:`~featcal.zoo.core.Zoo`: its models (:mod:`.loaders`, text
encoders in :mod:`.text`), frozen heads (:mod:`.heads`, class names in :mod:`.classnames`), data
splits (:mod:`.data`), and the whole zoo from a spec (:func:`.from_spec.load`)."""
