"""``python -m featcal``: the same as the ``featcal`` command (:mod:`featcal.cli`)."""

import sys

from featcal.cli import main

if __name__ == "__main__":
    sys.exit(main())
