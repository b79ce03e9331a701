"""``python -m gradstep``: the ``gradstep`` command line (the demo's ``train``, ``plan``,
``report`` and ``export``), as ``torchrun ... -m gradstep train`` needs it.

The one place the library imports the demo, and an entry point, not a library module:
``import gradstep`` never runs it, and the library imports without the demo's packages.
``gradstep_demo`` ships in the same distribution; what it needs beyond the library is the
``demo`` extra (tqdm; tomli before Python 3.11): without it the command line says
``pip install 'gradstep[demo]'`` and exits with status 1 (see docs/demo.md).
"""

import sys

from gradstep_demo.cli import main

sys.exit(main())
