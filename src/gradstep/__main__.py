"""``python -m gradstep``: the ``gradstep`` command line (``train``, ``plan``, ``export``,
``report``), as ``torchrun ... -m gradstep train`` needs it.

The one place the library imports the command line, and an entry point, not a library
module: ``import gradstep`` never runs it, and the library imports without the command
line's packages. ``gradstep_cli`` ships in the same distribution; what it needs beyond the
library is the ``cli`` extra (tqdm; tomli before Python 3.11): without it the command line
says ``pip install 'gradstep[cli]'`` and exits with status 1.
"""

import sys

from gradstep_cli.cli import main

sys.exit(main())
