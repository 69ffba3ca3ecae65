"""The ``featcal`` command line: commands (the COMMANDS table, the one featcal module that imports
diagnostics; zoo and merge), calibrate, evaluate (eval, and writing a model with its record), sweep (tune,
study), app (the launcher), formats, ranks, common (shared options and checks)."""
