"""``python -m nanwidget``: see :mod:`nanwidget.cli`."""

import sys

from .cli import main

sys.exit(main())
