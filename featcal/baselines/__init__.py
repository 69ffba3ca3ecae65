"""What FeatCal is compared with: data-free mergers (merging, spectral), data-using mergers (regmean),
trained post-merging calibrators (trained/). Imports the engine and below."""
