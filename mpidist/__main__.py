"""``python -m mpidist``: see :mod:`mpidist._tools.cli`."""

import sys

from mpidist._tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
