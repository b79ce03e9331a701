"""``python -m gradstep_cli``: the same entry point as the ``gradstep`` script."""

import sys

from gradstep_cli.cli import main

sys.exit(main())
