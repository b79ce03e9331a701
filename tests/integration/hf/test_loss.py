"""The tests of tests/hf/test_loss.py that start processes or run the CLI end to end; its other
tests stay there.
"""

from __future__ import annotations

import subprocess
import sys


def test_import_gradstep_without_transformers() -> None:
    code = (
        "import sys; sys.modules['transformers'] = None; sys.modules['peft'] = None\n"
        "import gradstep, gradstep.hf; print(gradstep.hf.count_tokens.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "count_tokens"
