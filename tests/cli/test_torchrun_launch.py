"""torchrun without a strategy stops with an error saying so (README: "torchrun without a
strategy stops with an error saying so"): 2 processes with ``strategy='none'`` would train
2 unrelated models into one run folder."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.batches import text_corpus
from tests.support.multiproc import free_port


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_torchrun_without_a_strategy_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        f"--master_port={free_port()}", "-m", "gradstep", "train", "--device", "cpu",
        "--data", str(text_corpus(tmp_path / "data")), "--n-layer", "1", "--n-head", "2",
        "--d-model", "16", "--seq-len", "16", "--micro-batch-size", "2", "--max-steps", "2",
        "--warmup", "1", "--eval-batches", "2", "--sample-tokens", "0", "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "launched as 2 processes but strategy='none'" in proc.stderr, proc.stderr
    assert "use --strategy ddp or --strategy fsdp" in proc.stderr, proc.stderr
    # Each rank left through the CLI's error path (status 2), not with a crash.
    assert re.search(r"exitcode\s*:\s*2\b", proc.stderr), proc.stderr
    assert not out.exists()  # refused before the run folder was made


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_plan_on_two_ranks_refuses_a_global_batch_train_refuses(tmp_path: Path) -> None:
    """N124: on 2 ranks `plan --global-batch 7` planned 4 per rank (8 sequences), rc 0,
    where train refuses 7. Now: train's message, before any probe, as JSON with --json."""
    from gradstep_cli.config.preflight import check_global_batch
    from gradstep_cli.config.settings import ConfigError

    with pytest.raises(ConfigError) as refused:
        check_global_batch(7, 2)  # what train raises for this batch on 2 ranks
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        f"--master_port={free_port()}", "-m", "gradstep", "plan", "--device", "cpu",
        "--strategy", "ddp", "--n-layer", "1", "--n-head", "2", "--d-model", "16",
        "--seq-len", "16", "--eval-batches", "2", "--global-batch", "7",
        "--memory-budget", "1GiB", "--json",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert re.search(r"exitcode\s*:\s*2\b", proc.stderr), proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    # One JSON object (rank 0's), the error only: no probe line, no table, no choice.
    assert [json.loads(line) for line in lines] == [{"error": str(refused.value)}], proc.stdout
    assert f"gradstep plan: error: {refused.value}" in proc.stderr
    # torchrun prints its own ChildFailedError traceback; no frame of gradstep's may show.
    assert not re.search(r'File "[^"]*gradstep(_cli)?/(\w+/)*\w+\.py"', proc.stderr)
