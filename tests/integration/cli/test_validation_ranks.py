"""The whole validation set on 2 DDP ranks scores what one process scores: the ranks split
the micro-batches, the rank short of one runs a filler that scores nothing, and the sums
meet. 5 records in micro-batches of 2: 3 batches, so rank 1 gets one and the filler."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOY = [
    "--device", "cpu", "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "48",
    "--micro-batch-size", "2", "--accum-steps", "1", "--max-steps", "1", "--eval-every", "0",
    "--sample-tokens", "0", "--warmup", "0",
]  # fmt: skip
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _jsonl(path: Path, n: int, offset: int = 0) -> Path:
    rows = [{"prompt": f"def f{i + offset}(x):\n", "completion": "    return x" + " + 1" * i}
            for i in range(n)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _first_eval(out: Path) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    return {
        "initial": summary["initial_val_loss"],
        **{k: row[k] for k in row if k.startswith("val_")},
    }


@pytest.mark.timeout(300)
def test_two_ranks_score_the_whole_set_as_one_process(tmp_path: Path) -> None:
    data = ["--data", str(_jsonl(tmp_path / "t.jsonl", 8)), "--val-data",
            str(_jsonl(tmp_path / "v.jsonl", 5, offset=20))]  # fmt: skip
    one = [sys.executable, "-m", "gradstep", "train", *TOY, *data]
    proc = subprocess.run([*one, "--out", str(tmp_path / "one")], capture_output=True,
                          text=True, timeout=300, env=ENV)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    two = [*one, "--nproc-per-node", "2", "--strategy", "ddp", "--out", str(tmp_path / "two")]
    proc = subprocess.run(two, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr
    a, b = _first_eval(tmp_path / "one"), _first_eval(tmp_path / "two")
    assert a["val_records"] == b["val_records"] == 5
    assert a["val_items"] == b["val_items"] > 0
    assert b["initial"] == pytest.approx(a["initial"], rel=1e-9)
    assert "(5 records," in proc.stderr
