"""``python -m savable_loader <command>``: the command line, in :mod:`savable_loader.cli.main`."""

import sys

from savable_loader.cli.main import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
