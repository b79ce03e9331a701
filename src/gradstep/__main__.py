"""``python -m gradstep``: the ``gradstep`` command line (the demo trainer and the report).

An entry point, not a library module: the library itself never imports the demo.
"""

import sys

from gradstep_demo.cli import main

sys.exit(main())
