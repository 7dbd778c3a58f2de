"""``python -m geopipe.testbed …``: the same as ``geopipe testbed …``."""

import sys

from geopipe.testbed.cli import main

sys.exit(main())
