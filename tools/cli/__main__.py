"""``python -m tools.cli``: the ``tierstore`` console script without the installed entry point."""

import sys

from tools.cli import main

sys.exit(main())
