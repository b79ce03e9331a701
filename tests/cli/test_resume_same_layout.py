"""A run on a 2-D mesh, resumed on the same mesh, is the uninterrupted run.

One 4-rank job (tests/cli/mesh_ranks.py: each rank runs the command lines in turn, as
torchrun's ranks would) trains, for each layout, 4 steps saving at steps 2 and 4, then a
second run resumes the step-2 checkpoint with the same flags into another folder and
trains steps 3 and 4:

- ``--strategy fsdp --tp 2``: FSDP2 + tensor parallel on (dp=2, tp=2);
- ``--strategy fsdp --tp 4``: (dp=1, tp=4), every rank one of the 4 heads;
- ``--strategy fsdp --hsdp 2``: HSDP on (replicate=2, shard=2), 4 data-parallel ranks.

Properties, per layout: the resume keeps the global batch and the accumulation steps (no
"to keep the global batch" rescaling, ``accum_steps`` and the manifest's ``dp_size``,
``accum_steps`` and ``global_micro_batches`` as the uninterrupted run's, which are
``K x data-parallel ranks``), and it is bitwise the uninterrupted run: the metrics of steps
3 and 4 (every StepStats field and the validation loss) are equal, and the step-4
checkpoints hold equal tensors (model and optimizer, read back from DCP) and equal
objects (stepper, schedule, data position, progress but its wall time).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import gradstep
from gradstep.checkpoint import MANIFEST
from tests.cli.mesh_ranks import cli_runs
from tests.support.batches import text_corpus
from tests.support.multiproc import run_ranks

pytestmark = pytest.mark.distributed

WORLD, K, MBS = 4, 2, 2
FLAGS = [
    "--n-layer", "2", "--n-head", "4", "--d-model", "16", "--seq-len", "16",
    "--micro-batch-size", str(MBS), "--accum-steps", str(K), "--eval-batches", "4",
    "--sample-tokens", "0", "--warmup", "1", "--eval-every", "2", "--device", "cpu",
    "--strategy", "fsdp", "--clip", "norm:0.05",
]  # fmt: skip
LAYOUTS = {"tp2": ["--tp", "2"], "tp4": ["--tp", "4"], "hsdp2": ["--hsdp", "2"]}
DATA_RANKS = {"tp2": 2, "tp4": 1, "hsdp2": 4}


def _rows(run: Path) -> list[dict[str, Any]]:
    """The deterministic part of each metrics line (no wall times, no memory)."""
    keep = {f.name for f in dataclasses.fields(gradstep.StepStats)} | {"val_loss"}
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k in keep} for line in lines]


def _manifest(run: Path, step: int) -> dict[str, Any]:
    return json.loads((run / "checkpoints" / f"step-{step:06d}" / MANIFEST).read_text())


def _tensors(run: Path, step: int) -> dict[str, Any]:
    """Everything the step's DCP checkpoint holds, read back in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = run / "checkpoints" / f"step-{step:06d}" / "dcp"
    target = run.parent / f"{run.name}-step{step}.pt"
    dcp_to_torch_save(str(folder), str(target))
    return torch.load(target, weights_only=False)


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out |= _flat(v, f"{prefix}{k}.")
        return out
    return {prefix.rstrip("."): value}


def _objects(run: Path, step: int) -> dict[str, Any]:
    """The checkpoint's objects besides the tensors; the progress' wall time left out."""
    objects = _manifest(run, step)["objects"]
    del objects["progress"]["state"]["step_time"]
    return objects


@pytest.mark.timeout(400)
def test_a_2d_mesh_run_resumed_on_the_same_mesh_is_the_uninterrupted_run(tmp_path: Path) -> None:
    data = ["--data", str(text_corpus(tmp_path / "data"))]
    argvs = []
    for name, layout in LAYOUTS.items():
        whole, resumed = tmp_path / name, tmp_path / f"{name}-resumed"
        step2 = str(whole / "checkpoints" / "step-000002")
        argvs.append(["train", *FLAGS, *data, *layout, "--max-steps", "4", "--save-every", "2",
                      "--out", str(whole)])  # fmt: skip
        argvs.append(["train", *FLAGS, *data, *layout, "--resume", step2, "--out", str(resumed)])
    ranks = run_ranks(cli_runs, WORLD, argvs, timeout=360, collective_timeout_s=120)
    for rank, res in enumerate(ranks):
        assert [rc for rc, _, _ in res] == [0] * len(argvs), (rank, [err for _, _, err in res])
    for i, name in enumerate(LAYOUTS):
        whole, resumed = tmp_path / name, tmp_path / f"{name}-resumed"
        err = ranks[0][2 * i + 1][2]
        assert "resumed from" in err and "step-000002" in err, (name, err)
        assert "to keep the global batch" not in err, (name, err)
        dp = DATA_RANKS[name]
        # The same global batch and accumulation steps, recorded and used.
        assert json.loads((resumed / "config.json").read_text())["accum_steps"] == K, name
        for run in (whole, resumed):
            m = _manifest(run, 4)
            got = (m["world_size"], m["dp_size"], m["accum_steps"], m["global_micro_batches"])
            assert got == (WORLD, dp, K, K * dp), (name, run.name, got)
        # Bitwise the uninterrupted run.
        want = _rows(whole)
        assert [r["step"] for r in want] == [1, 2, 3, 4], name
        got_rows = _rows(resumed)
        assert [r["step"] for r in got_rows] == [3, 4], name
        assert all(r["micro_batches"] == K and r["clipped"] for r in got_rows), (name, got_rows)
        assert got_rows == want[2:], name
        assert _objects(resumed, 4) == _objects(whole, 4), name
        a, b = _flat(_tensors(whole, 4)), _flat(_tensors(resumed, 4))
        assert a.keys() == b.keys() and any(k.startswith("optim.state.") for k in a), name
        for key, value in a.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, b[key]), (name, key)
            else:
                assert value == b[key], (name, key)
