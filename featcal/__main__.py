"""``python -m featcal``: the same as the ``featcal`` command (:mod:`featcal.cli.commands`)."""

import sys

from featcal.cli.commands import main

if __name__ == "__main__":
    sys.exit(main())
