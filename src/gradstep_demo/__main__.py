"""``python -m gradstep_demo``: the same entry point as the ``gradstep`` script."""

import sys

from .cli import main

sys.exit(main())
