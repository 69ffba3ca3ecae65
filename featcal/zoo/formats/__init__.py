"""Other tools' files read as featcal zoo specs: FusionBench model pools (:mod:`.fusionbench`)."""
