"""``python -m psframe.cli``: the ``psframe`` command, for where the console script is not on the PATH."""

import sys

from psframe.cli import main

if __name__ == "__main__":
    sys.exit(main())
