"""``python -m purlinc`` and the ``purlinc`` console script: the command line of ``purlinc.cli``."""

import sys


def run() -> int:
    """``purlinc.cli.main``, imported here: a Ctrl-C during the imports (a few tenths of a
    second at start-up) ends with status 130 as one after them does, not with a traceback."""
    try:
        from purlinc.cli import main
    except KeyboardInterrupt:
        return 130
    return main()


if __name__ == "__main__":
    sys.exit(run())
