"""What FeatCal is compared with: the mergers, the data-using mergers, the post-merging
calibrators (SVC, and the trained ones under :mod:`featcal.baselines.trained`), and the one
registry of them all (:mod:`featcal.baselines.registry`)."""
