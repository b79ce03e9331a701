"""The tests of tests/test_metrics.py that start processes or run the CLI end to end; its other
tests stay there.
"""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path

from gradstep.metrics import jsonable
from tests.test_metrics import _same_f32, _scalars

FULL_DISK_CHILD = """
import errno, json, resource, signal, sys
from gradstep import StepStats
from gradstep.metrics import MetricsLogger
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
stats = StepStats(loss=1.0, items=10, micro_batches=1, grad_norm=1.0, clip_coef=1.0,
                  clipped=False, skipped=False, lr=0.1, step=1)
resource.setrlimit(resource.RLIMIT_FSIZE, (2000, resource.RLIM_INFINITY))
logged = 0
try:
    with MetricsLogger(sys.argv[1]) as logger:
        for _ in range(100):
            logger.log_step(stats, 0.1)
            logged += 1
except OSError as exc:
    print(json.dumps({"errno": exc.errno, "filename": exc.filename, "text": str(exc),
                      "logged": logged}))
"""


def test_a_full_disk_names_the_metrics_file(tmp_path: Path) -> None:
    """N119: with the file-size limit hit, the message was ``[Errno 27] File too large``
    without the file. Real limit (RLIMIT_FSIZE), in a child process."""
    cmd = [sys.executable, "-c", FULL_DISK_CHILD, str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.splitlines()[-1])
    path = str(tmp_path / "metrics.jsonl")
    assert out["errno"] == errno.EFBIG and out["filename"] == path
    assert path in out["text"] and 0 < out["logged"] < 100
    # What reached the file is whole records plus at most one cut line (report skips it).
    lines = (tmp_path / "metrics.jsonl").read_text().split("\n")
    assert all(json.loads(line)["step"] == 1 for line in lines[:-1])
    assert len(lines) - 1 <= out["logged"]


TINY_TRAIN = dict(
    n_layer=1, n_head=2, d_model=32, seq_len=32, micro_batch_size=2, accum_steps=2,
    eval_batches=2, sample_tokens=0, warmup=1, max_steps=3, eval_every=2,
)  # fmt: skip


def test_train_logs_every_step_to_every_sink(tmp_path: Path) -> None:
    from gradstep_cli.cli import main
    from gradstep_cli.config.settings import TrainConfig
    from gradstep_cli.train import train

    out = tmp_path / "run"
    seen: list[dict] = []
    train(TrainConfig(**TINY_TRAIN, tensorboard=True, out=str(out)), callbacks=[seen.append])
    assert [r["step"] for r in seen] == [1, 2, 3]
    assert [("val_loss" in r) for r in seen] == [False, True, True]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows == [json.loads(json.dumps(jsonable(r))) for r in seen]
    scalars = _scalars(out / "tensorboard")
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3]
    logged = [v for _, v in scalars["train/loss"]]
    assert all(_same_f32(v, r["loss"]) for v, r in zip(logged, seen, strict=True))
    assert [s for s, _ in scalars["val/loss"]] == [2, 3]
    assert main(["report", str(out)]) == 0
    assert "finished" in (out / "report" / "report.html").read_text()
