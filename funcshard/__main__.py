"""`python -m funcshard ...`: see funcshard.cli."""

import sys

from funcshard.cli._main import main

if __name__ == "__main__":
    sys.exit(main())
