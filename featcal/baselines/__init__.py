"""What FeatCal is compared with: data-free mergers (merging, spectral), data-using mergers
(regmean, adamerging, fisher), SVC (svc, data-free), trained post-merging calibrators (trained/),
and the one registry of them all (registry). Imports the engine and below."""
