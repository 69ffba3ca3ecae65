"""A zoo spec: what its YAML may say (:mod:`.schema`, :mod:`.parsing`), where the models and data
it names are (:mod:`.resolve`, :mod:`.locate`), and a spec written from a user's folders
(:mod:`.userspec`). Nothing here loads a model; :mod:`featcal.zoo.load` does."""
