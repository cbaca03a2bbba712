"""``python -m tidegate``: the console script ``tidegate`` (``tidegate.commands.cli``)."""

import sys

from tidegate.commands.cli import main

sys.exit(main())
