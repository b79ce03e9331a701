"""``gradstep train --strategy fsdp --tp 2`` and ``--hsdp 2`` on 4 ranks, ``gradstep plan``
of both, and a (dp=2, tp=2) checkpoint resumed on 2 plain FSDP2 ranks.

One 4-rank job (tests/cli/mesh_ranks.py: each rank runs the command lines in turn, as
torchrun's ranks would) trains ``--tp 2`` (saving at step 2) and ``--hsdp 2``, plans both,
and refuses a ``--tp`` that does not divide the ranks in train and plan. A 2-rank job then
resumes the tp run's step-2 checkpoint with ``--strategy fsdp`` and no ``--tp``: the
checkpoint counts 2 data-parallel ranks (``dp_size``), so ``accum_steps`` stays, DCP
reshards the (dp, tp) model and optimizer onto the 1-D mesh, and step 3 takes the same
global batch to the same loss as the tp run's step 3 (float32: 1e-6).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from gradstep.checkpoint import MANIFEST
from tests.cli.mesh_ranks import cli_runs
from tests.support.batches import text_corpus
from tests.support.multiproc import run_ranks

pytestmark = pytest.mark.distributed

K, MBS = 2, 2
FLAGS = [
    "--n-layer", "2", "--n-head", "4", "--d-model", "16", "--seq-len", "16",
    "--micro-batch-size", str(MBS), "--accum-steps", str(K), "--eval-batches", "4",
    "--sample-tokens", "4", "--warmup", "1", "--eval-every", "0", "--device", "cpu",
]  # fmt: skip
WIDE = ["--n-head", "8", "--d-model", "32"]  # 8 heads: --tp 8 passes the config's checks
PLAN = [
    "plan", "--strategy", "fsdp", "--n-layer", "2", "--n-head", "4", "--d-model", "16",
    "--seq-len", "16", "--eval-batches", "4", "--global-batch", "4", "--memory-budget",
    "1GiB", "--device", "cpu", "--no-probe", "--json",
]  # fmt: skip


def _metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


@pytest.mark.timeout(300)
def test_tp_and_hsdp_train_and_plan_and_a_tp_checkpoint_resumes_on_plain_fsdp(
    tmp_path: Path,
) -> None:
    data = ["--data", str(text_corpus(tmp_path / "data"))]
    tp_run, hsdp_run, resumed = tmp_path / "tp", tmp_path / "hsdp", tmp_path / "resumed"
    train = ["train", *FLAGS, *data, "--strategy", "fsdp", "--save-every", "2"]
    argvs = [
        [*train, "--tp", "2", "--max-steps", "3", "--out", str(tp_run)],
        [*train, "--hsdp", "2", "--max-steps", "2", "--out", str(hsdp_run)],
        [*PLAN, "--tp", "2"],
        [*PLAN, "--hsdp", "2"],
        [*train, *WIDE, "--tp", "8", "--out", str(tmp_path / "refused")],
        [*PLAN, *WIDE, "--tp", "8"],
    ]
    ranks = run_ranks(cli_runs, 4, argvs, timeout=240)
    assert [[rc for rc, _, _ in res] for res in ranks] == [[0, 0, 0, 0, 2, 2]] * 4, ranks
    _check_tp_run(tp_run)
    _check_hsdp_run(hsdp_run)
    _check_plans(ranks[0][2][1], ranks[0][3][1])
    for _, _, err in ranks[0][4:]:
        assert "--tp 8 must divide the number of ranks (4): use --tp 1 or 2 or 4" in err, err
    assert not (tmp_path / "refused").exists()

    # The tp run's step-2 checkpoint on 2 plain FSDP2 ranks (no --tp, no --max-steps).
    step2 = str(tp_run / "checkpoints" / "step-000002")
    again = ["train", *FLAGS, *data, "--strategy", "fsdp", "--resume", step2, "--out"]
    [(rc, _, err), _] = [res[0] for res in run_ranks(cli_runs, 2, [[*again, str(resumed)]])]
    assert rc == 0, err
    assert "to keep the global batch" not in err, err  # 2 data ranks before and after
    assert _json(resumed / "config.json")["accum_steps"] == K
    got, want = _metrics(resumed), _metrics(tp_run)[2]
    assert [m["step"] for m in got] == [3] and got[0]["micro_batches"] == K
    assert got[0]["items"] == want["items"] > 0  # the same global batch
    assert math.isclose(got[0]["loss"], want["loss"], rel_tol=1e-6), (got, want)
    assert math.isclose(got[0]["grad_norm"], want["grad_norm"], rel_tol=1e-5), (got, want)


def _check_tp_run(out: Path) -> None:
    manifest = _json(out / "checkpoints" / "step-000002" / MANIFEST)
    assert (manifest["world_size"], manifest["dp_size"], manifest["accum_steps"]) == (4, 2, K)
    assert manifest["global_micro_batches"] == 2 * K
    assert manifest["global_batch"] == 2 * K * MBS
    summary = _json(out / "summary.json")
    assert (summary["world_size"], summary["data_parallel_size"], summary["tp"]) == (4, 2, 2)
    assert summary["effective_batch_sequences"] == 2 * K * MBS
    assert [m["step"] for m in _metrics(out)] == [1, 2, 3]
    assert all(math.isfinite(m["loss"]) and m["items"] > 0 for m in _metrics(out))
    assert summary["final_val_loss"] < summary["initial_val_loss"]


def _check_hsdp_run(out: Path) -> None:
    manifest = _json(out / "checkpoints" / "step-000002" / MANIFEST)
    assert (manifest["world_size"], manifest["dp_size"]) == (4, 4)  # every rank its data
    summary = _json(out / "summary.json")
    assert (summary["data_parallel_size"], summary["hsdp"]) == (4, 2)
    assert summary["effective_batch_sequences"] == 4 * K * MBS
    assert [m["step"] for m in _metrics(out)] == [1, 2]
    assert all(math.isfinite(m["loss"]) for m in _metrics(out))


def _check_plans(tp_json: str, hsdp_json: str) -> None:
    """The global batch is split over the data ranks: 2 under --tp 2 (2 rows each), 4
    under --hsdp 2 (1 row each); the tp plan says its tensor-parallel width."""
    tp, hsdp = json.loads(tp_json), json.loads(hsdp_json)
    assert (tp["world_size"], tp["per_rank_batch"], tp["tp"]) == (2, 2, 2), tp
    assert (hsdp["world_size"], hsdp["per_rank_batch"], hsdp["tp"]) == (4, 1, 1), hsdp


@pytest.mark.timeout(420)
def test_hsdp_and_tp_on_8_ranks_train_as_one_process_does(tmp_path: Path) -> None:
    """``--hsdp 2 --tp 2`` on 8 ranks (replicate x shard x tp = 2 x 2 x 2: 4 data ranks of
    one row each) takes the steps one process takes on the same 4-row micro-batches, to
    float32 rounding; the checkpoint and summary count 4 data-parallel ranks."""
    from gradstep_cli.cli import main

    data = ["--data", str(text_corpus(tmp_path / "data"))]
    flags = [*FLAGS, *data, "--accum-steps", "2", "--max-steps", "2", "--save-every", "2"]
    mesh, one = tmp_path / "mesh", tmp_path / "one"
    argv = ["train", *flags, "--micro-batch-size", "1", "--strategy", "fsdp"]
    ranks = run_ranks(cli_runs, 8, [[*argv, "--hsdp", "2", "--tp", "2", "--out", str(mesh)]],
                      timeout=400)  # fmt: skip
    assert all(res[0][0] == 0 for res in ranks), ranks[0][0][2]
    assert main(["train", *flags, "--micro-batch-size", "4", "--out", str(one)]) == 0
    manifest = _json(mesh / "checkpoints" / "step-000002" / MANIFEST)
    assert (manifest["world_size"], manifest["dp_size"]) == (8, 4)
    summary = _json(mesh / "summary.json")
    assert (summary["data_parallel_size"], summary["tp"], summary["hsdp"]) == (4, 2, 2)
    got, want = _metrics(mesh), _metrics(one)
    assert [m["step"] for m in got] == [m["step"] for m in want] == [1, 2]
    for g, w in zip(got, want, strict=True):
        assert g["items"] == w["items"] > 0
        assert math.isclose(g["loss"], w["loss"], rel_tol=1e-6), (g, w)
        assert math.isclose(g["grad_norm"], w["grad_norm"], rel_tol=1e-5), (g, w)
