"""The ``featcal`` command line: commands (the COMMANDS table, each subcommand imported when it runs; the
one featcal module that imports diagnostics), zoo, merge, calibrate, evaluate (eval, and writing a model with
its record), sweep (tune, study), app (the launcher), formats, ranks, common (shared options and checks)."""
