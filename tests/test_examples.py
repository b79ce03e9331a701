"""The examples run (README: ``examples/own_loop.py`` is "a complete runnable version").

Run in this process with ``runpy`` (as ``__main__``, unmodified, all 30 steps): a second
interpreter would only add its torch import.
"""

from __future__ import annotations

import math
import re
import runpy
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
LINE = re.compile(
    r"step +(\d+)  loss ([\d.naif-]+)  items (\d+)  grad norm \(pre-clip\) ([\d.naif-]+)  "
    r"clipped (True|False)"
)


def test_own_loop_example_trains_30_steps(capsys: pytest.CaptureFixture[str]) -> None:
    runpy.run_path(str(EXAMPLES / "own_loop.py"), run_name="__main__")
    out = capsys.readouterr().out.splitlines()
    steps = [LINE.fullmatch(line) for line in out]
    assert all(steps), [line for line, m in zip(out, steps, strict=True) if m is None]
    assert [int(m[1]) for m in steps] == list(range(1, 31))  # it stops at step 30
    losses = [float(m[2]) for m in steps]
    items = [int(m[3]) for m in steps]
    norms = [float(m[4]) for m in steps]
    assert all(math.isfinite(x) for x in losses + norms)
    assert all(0 < n <= 4 * 8 * 64 for n in items)  # 4 micro-batches of 8 x 64 bytes
    assert max(losses[-5:]) < losses[0] - 1.0  # it learns: from ~ln(256) = 5.5
    assert "True" in {m[5] for m in steps}  # ClipNorm(1.0) acts on some steps
