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

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
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


HF_LINE = re.compile(r"step +(\d+)  loss ([\d.]+)  (grad norm|router aux) ([\d.]+)")


def _hf_steps(name: str, capsys: pytest.CaptureFixture[str]) -> tuple[list, list[str]]:
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    out = capsys.readouterr().out.splitlines()
    return [m for m in map(HF_LINE.fullmatch, out) if m], out


def test_hf_lora_example_resumes_from_adapters_only(capsys: pytest.CaptureFixture[str]) -> None:
    steps, out = _hf_steps("hf_lora.py", capsys)
    assert [int(m[1]) for m in steps] == list(range(1, 9))  # 4 steps, resume, 4 more
    assert all(math.isfinite(float(m[2])) and float(m[4]) > 0 for m in steps)
    assert out[-1].startswith("checkpoint files:") and "model.safetensors" in out[-1]


def test_hf_moe_example_reports_the_router_term(capsys: pytest.CaptureFixture[str]) -> None:
    steps, _ = _hf_steps("hf_moe.py", capsys)
    assert [int(m[1]) for m in steps] == list(range(1, 9))
    losses = [float(m[2]) for m in steps]
    assert losses[-1] < losses[0] - 0.2  # it learns the 64-token sub-vocabulary
    assert all(0.02 < float(m[4]) < 0.2 for m in steps)  # 0.02 x aux, aux >= 1 (balanced)
