"""The ``featcal`` command line: commands (the COMMANDS table, the one featcal module that imports
diagnostics), common (shared options and checks), one module per command group."""

from featcal._moved import moved_attribute

__getattr__ = moved_attribute(__name__, "featcal.cli.commands")  # the old flat module's names
