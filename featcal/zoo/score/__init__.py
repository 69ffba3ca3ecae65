"""Scoring models on a zoo's tasks: per-task summaries (:mod:`.scores`), generated replies and
option log-likelihoods of language models (:mod:`.lm`), and lm-eval-harness (:mod:`.harness`)."""
