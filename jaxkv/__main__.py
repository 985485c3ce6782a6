"""`python -m jaxkv ...`: see jaxkv.cli."""

import sys

from jaxkv.cli import main

sys.exit(main())
