"""``python -m mpidist``: see :mod:`mpidist._cli`."""
import sys

from mpidist._cli import main

if __name__ == "__main__":
    sys.exit(main())
