"""``python -m freezeframe ARGS``: the ``freezeframe`` command, run as a module (as
``python -m freezeframe.cli`` is)."""

import sys

from freezeframe.cli import main

sys.exit(main())
