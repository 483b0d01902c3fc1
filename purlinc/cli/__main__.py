"""``python -m purlinc.cli``: the same command line as ``purlinc``."""

import sys

from purlinc.cli import main

if __name__ == "__main__":
    sys.exit(main())
