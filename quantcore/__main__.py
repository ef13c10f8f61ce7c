"""``python -m quantcore ...``: the same as the ``quantcore`` command."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
