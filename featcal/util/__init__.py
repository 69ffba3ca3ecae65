"""Small helpers every layer may use: progress bars, CPU thread counts, distances between predictions."""
