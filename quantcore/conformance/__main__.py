"""``python -m quantcore.conformance --backend NAME``: the same as ``quantcore check``."""

import sys

from .runner import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m quantcore.conformance"))
