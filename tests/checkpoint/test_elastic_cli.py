"""``gradstep train --resume`` of a checkpoint saved on another number of ranks (README:
"``--resume`` also loads a checkpoint saved on a different number of ranks ...;
``accum_steps`` is then set to keep the global batch, and a line says so").

A 2-rank DDP run of the CLI (``gradstep_cli.cli.main`` on each rank of a ``run_ranks``
process group, what torchrun runs) saves every 2 steps; its step-2 checkpoint is resumed
in ONE process with the same flags, minus ``--max-steps`` and the strategy.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from gradstep.checkpoint import MANIFEST
from gradstep_cli.cli import main
from tests.checkpoint.cli_ranks import cli_rank
from tests.support.batches import text_corpus
from tests.support.multiproc import run_ranks

K = 2  # --accum-steps of the 2-rank run
FLAGS = [
    "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16",
    "--micro-batch-size", "2", "--accum-steps", str(K), "--eval-batches", "2",
    "--sample-tokens", "0", "--warmup", "1", "--eval-every", "0", "--dropout", "0.0",
    "--device", "cpu", "--save-every", "2",
]  # fmt: skip
MAX_STEPS = 4


def _metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _manifest(step_dir: Path) -> dict[str, Any]:
    return json.loads((step_dir / MANIFEST).read_text())


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_resume_on_one_process_of_a_two_rank_checkpoint_keeps_the_global_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Resumed on 1 process, the 2-rank (k=2) run continues with k=4: config.json and
    every resumed metrics line say so (micro_batches 4 instead of 2), a line on stderr says
    why ("to keep the global batch"), max_steps stays the checkpoint's (no --max-steps
    given), and steps 3-4 take the same global batch as the 2-rank run's steps 3-4: the same
    token count and, with dropout off, the same loss and gradient norm up to float32 sums."""
    data = ["--data", str(text_corpus(tmp_path / "data"))]
    two, one = tmp_path / "two", tmp_path / "one"
    argv = ["train", *FLAGS, *data, "--strategy", "ddp", "--max-steps", str(MAX_STEPS)]
    assert run_ranks(cli_rank, 2, [*argv, "--out", str(two)]) == [0, 0]
    step2 = two / "checkpoints" / "step-000002"
    saved = _manifest(step2)
    assert (saved["world_size"], saved["accum_steps"], saved["global_micro_batches"]) == (2, K, 4)
    capsys.readouterr()

    # The same flags in one process, no --max-steps, no strategy (torchrun's setting).
    assert main(["train", *FLAGS, *data, "--out", str(one), "--resume", str(step2)]) == 0
    err = capsys.readouterr().err
    assert "to keep the global batch" in err, err
    assert f"2 rank(s) x accum_steps {K}: using accum_steps {2 * K} on 1" in err, err

    config = json.loads((one / "config.json").read_text())
    assert config["accum_steps"] == 2 * K
    assert config["max_steps"] == MAX_STEPS  # the checkpoint's, not the default (150)
    resumed, reference = _metrics(one), _metrics(two)
    assert [m["step"] for m in resumed] == [3, 4]
    assert [m["micro_batches"] for m in reference] == [K] * MAX_STEPS  # per rank
    assert [m["micro_batches"] for m in resumed] == [2 * K, 2 * K]
    for got, want in zip(resumed, reference[2:], strict=True):
        assert got["items"] == want["items"] > 0  # the global token count of the step
        assert math.isclose(got["loss"], want["loss"], rel_tol=1e-5), (got, want)
        assert math.isclose(got["grad_norm"], want["grad_norm"], rel_tol=1e-4), (got, want)

    summaries = [json.loads((out / "summary.json").read_text()) for out in (two, one)]
    assert [s["world_size"] for s in summaries] == [2, 1]
    # micro-batch size x accum_steps x ranks: 2 x 2 x 2 == 2 x 4 x 1 sequences per step.
    assert [s["effective_batch_sequences"] for s in summaries] == [8, 8]
    final = _manifest(one / "checkpoints" / "step-000004")
    assert (final["world_size"], final["accum_steps"]) == (1, 2 * K)
    assert final["global_batch"] == saved["global_batch"] == 8
