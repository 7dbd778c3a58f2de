"""The ``geopipe`` command line: :mod:`~geopipe.cli.main` parses and dispatches,
:mod:`~geopipe.cli.commands` runs each subcommand, :mod:`~geopipe.cli.render` formats output.
"""

from geopipe.cli.main import main

__all__ = ["main"]
