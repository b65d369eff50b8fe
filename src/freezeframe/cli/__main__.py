"""``python -m freezeframe.cli ARGS``: the ``freezeframe`` command, run as a module."""

import sys

from freezeframe.cli import main

sys.exit(main())
