"""Run the CLI as ``python -m andrea <stage> ...``."""

import sys

from andrea.cli import main

sys.exit(main())
