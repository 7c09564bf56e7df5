"""``python -m fx_lightning``: the ``fx-lightning`` command line."""

import sys

from fx_lightning.cli import main

if __name__ == "__main__":
    sys.exit(main())
