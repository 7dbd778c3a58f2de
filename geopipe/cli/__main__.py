"""``python -m geopipe.cli``: the same as the ``geopipe`` command."""

import sys

from geopipe.cli.main import main

sys.exit(main())
