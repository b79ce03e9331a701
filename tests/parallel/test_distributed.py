"""DDP and FSDP2: 2 ranks x k micro-batches give the step of one process on one big batch.

Every claim is checked on real 2-process gloo runs (tests/parallel/distributed_ranks.py) against
``reference_run``: one process, all 2k micro-batches of a step concatenated into one batch,
float64, mean token loss, ``clip_grad_norm_``, AdamW. The two ranks get different token
counts (first steps: 19 vs 92 and 41 vs 134 tokens), so any mean-of-means or world-size
mistake is an error of order 1, far above the tolerances.

Tolerances: the float64 runs must match to 1e-12 (what is left is summation order; measured
5e-15). The float32 runs to 1e-6 relative where float32 itself allows it: every tensor's
gradient in the first step (identical parameters; measured 3.7e-7), norm and clip
coefficient in every step, all parameters after 3 AdamW steps (measured 1.8e-7), and the
3-step update itself to 1e-5 (measured 1.0e-6). Later float32 gradients are not compared
per tensor: Adam's m / sqrt(v) amplifies float32 rounding on tiny gradient entries (a
single-process float32 full-batch run is equally ~3e-6 away from float64 there).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

import gradstep.parallel as gd
from gradstep.parallel.instrumentation import count_gradient_comms
from gradstep_cli.data.sources import IGNORE_INDEX
from tests.parallel import distributed_ranks as sc
from tests.support.asserts import flat_named, rel_err, rel_err_named
from tests.support.models import TINY_GPT, tiny_gpt
from tests.support.multiproc import free_port, run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(150)]

EXACT = 1e-12
FP32 = 1e-6


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def runs(request: pytest.FixtureRequest) -> dict:
    """One spawn per strategy runs every scenario; the tests below read its results."""
    return {"strategy": request.param, "ranks": run_ranks(sc.scenarios, 2, request.param)}


@pytest.fixture(scope="module")
def ref64() -> list[dict]:
    return sc.reference_run(sc.data_fp64(), sc.MAX_NORM, sc.STEPS)


@pytest.fixture(scope="module")
def ref32() -> list[dict]:
    return sc.reference_run(sc.data_fp32(), sc.MAX_NORM, sc.STEPS)


def _groups(strategy: str) -> int:
    """Gradient collectives per full sync: DDP packs this tiny model (27 KB) into one
    bucket (25 MB cap); FSDP2 reduces once per fully_shard group: 2 blocks + the root."""
    return 1 if strategy == "ddp" else TINY_GPT.n_layer + 1


def _param_bytes(dtype: torch.dtype) -> int:
    numel = sum(p.numel() for p in tiny_gpt().parameters())  # tied head counted once
    return numel * torch.empty((), dtype=dtype).element_size()


def test_ranks_have_different_token_counts() -> None:
    """Guard on the data: the parity tests below are only meaningful if this holds."""
    for data in (sc.data_fp64(), sc.data_fp32()):
        for step in data:
            tokens = [sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in r) for r in step]
            assert tokens[1] > 2 * tokens[0], tokens
            widths = {mb["input_ids"].shape[1] for r in step for mb in r}
            assert len(widths) > 1  # micro-batches of different lengths, -100 padded


def test_float64_step_is_exactly_the_full_batch_step(runs: dict, ref64: list[dict]) -> None:
    for rank, res in enumerate(runs["ranks"]):
        for step, (got, want) in enumerate(zip(res["fp64"]["steps"], ref64, strict=True)):
            where = f"{runs['strategy']} rank {rank} step {step}"
            stats = got["stats"]
            assert stats.items == want["items"], where
            assert stats.loss == pytest.approx(want["loss"], rel=EXACT), where
            assert stats.grad_norm == pytest.approx(want["grad_norm"], rel=EXACT), where
            assert stats.clip_coef == pytest.approx(want["clip_coef"], rel=EXACT), where
            assert stats.clipped and want["clip_coef"] < 1, where
            assert rel_err_named(got["grads"], want["grads"]) <= EXACT, where
        assert rel_err_named(res["fp64"]["params"], ref64[-1]["params"]) <= EXACT


def test_float32_step_matches_float64_reference(runs: dict, ref32: list[dict]) -> None:
    init = {n: p.detach() for n, p in tiny_gpt(torch.float64).named_parameters()}
    for rank, res in enumerate(runs["ranks"]):
        where = f"{runs['strategy']} rank {rank}"
        steps = res["fp32"]["steps"]
        assert rel_err_named(steps[0]["grads"], ref32[0]["grads"]) <= FP32, where
        for got, want in zip(steps, ref32, strict=True):
            assert got["stats"].items == want["items"], where
            assert got["stats"].grad_norm == pytest.approx(want["grad_norm"], rel=FP32), where
            assert got["stats"].clip_coef == pytest.approx(want["clip_coef"], rel=FP32), where
        params, ref_params = flat_named(res["fp32"]["params"]), flat_named(ref32[-1]["params"])
        assert rel_err(params, ref_params) <= FP32, where
        # The update itself (not diluted by the initial weights) to 1e-5.
        update = flat_named(res["fp32"]["params"], init)
        assert rel_err(update, flat_named(ref32[-1]["params"], init)) <= 1e-5, where


def test_norm_clip_and_loss_identical_on_every_rank(runs: dict) -> None:
    r0, r1 = runs["ranks"]
    for run in ("fp64", "fp32", "sync_each", "bf16", "inf"):
        for a, b in zip(r0[run]["steps"], r1[run]["steps"], strict=True):
            sa, sb = a["stats"], b["stats"]
            assert (sa.grad_norm, sa.clip_coef, sa.loss, sa.items, sa.skipped) == (
                sb.grad_norm,
                sb.clip_coef,
                sb.loss,
                sb.items,
                sb.skipped,
            ), run
            for name in a["grads"]:
                assert torch.equal(a["grads"][name], b["grads"][name]), (run, name)


def test_one_gradient_reduction_per_optimizer_step_whatever_k(runs: dict) -> None:
    """k = 3 (float64) and k = 5 (float32): one all-reduce per DDP bucket / one
    reduce-scatter per FSDP2 group per step, plus the Stepper's one all-reduce of the window."""
    strategy = runs["strategy"]
    for res in runs["ranks"]:
        for run, dtype in (("fp64", torch.float64), ("fp32", torch.float32)):
            for step in res[run]["steps"]:
                assert step["comm_calls"] == _groups(strategy), (run, step["comm_calls"])
                assert step["totals_all_reduces"] == 1, run
                if strategy == "ddp":  # the whole gradient, exactly once
                    assert step["comm_bytes"] == _param_bytes(dtype), run
                else:  # unsharded groups, each padded to a multiple of the world size
                    assert _param_bytes(dtype) <= step["comm_bytes"] < 1.01 * _param_bytes(dtype)


def test_every_collective_of_a_step_is_accounted_for(runs: dict) -> None:
    """Every collective a step issues from Python, whatever its shape or dtype
    (``distributed_ranks.CollectiveSpy`` wraps every ``torch.distributed`` collective and DTensor's
    functional ones). DDP: the backend's gradient all-reduce (one bucket, through its comm
    hook) and exactly ONE other collective, the Stepper's float64 all-reduce of the window
    (sc.WINDOW_NUMBERS).
    FSDP2: besides the backend's own all-gathers and reduce-scatters (one per group and
    sync, counted separately), exactly the window-length check (2 float64: its forward
    communicates) and the window's totals, which carry this rank's norm**p (wherever the
    norm was measured); the inf-norm is a max, not a sum: its own 1-float64 all-reduce."""
    strategy = runs["strategy"]
    f64 = torch.float64
    for rank, res in enumerate(runs["ranks"]):
        for run in ("fp64", "fp32", "sync_each", "bf16", "inf"):
            for i, step in enumerate(res[run]["steps"]):
                where = (strategy, rank, run, i)
                backend, own = sc.split_collectives(step["collectives"])
                own_small = Counter(c[:3] for c in own if not c[0].startswith("funcol."))
                dtensor = [c for c in own if c[0].startswith("funcol.")]
                assert dtensor == [], where
                if strategy == "ddp":
                    assert own_small == {("all_reduce", sc.WINDOW_NUMBERS, f64): 1}, (where, own)
                    assert [c[0] for c in backend] == ["all_reduce"] * step["comm_calls"], where
                    continue
                if run == "inf":
                    want = {("all_reduce", 1, f64): 1, ("all_reduce", sc.WINDOW_NUMBERS, f64): 1}
                else:
                    want = {("all_reduce", sc.WINDOW_AND_NORM, f64): 1}
                assert own_small == {("all_reduce", 2, f64): 1, **want}, (where, own)
                names = Counter(c[0] for c in backend)
                assert names.keys() == {"all_gather_single", "reduce_scatter_single"}, where
                assert names["reduce_scatter_single"] == step["comm_calls"], where


def test_inf_norm_is_the_max_over_every_shard(runs: dict) -> None:
    """The inf-norm of FSDP2 shards is a max over ranks (not a sum of squares), and the
    largest entry lives on one rank's shard only."""
    ref = sc.reference_run(sc.data_fp64(), sc.MAX_NORM_INF, 1, norm_type=math.inf)[0]
    for res in runs["ranks"]:
        step = res["inf"]["steps"][0]
        assert step["stats"].grad_norm == pytest.approx(ref["grad_norm"], rel=EXACT)
        assert step["stats"].clip_coef == pytest.approx(ref["clip_coef"], rel=EXACT)
        assert ref["clip_coef"] < 1
        assert rel_err_named(step["grads"], ref["grads"]) <= EXACT


def test_clip_value_decides_on_the_global_max_on_every_rank(runs: dict) -> None:
    """Each rank holds different shards; all must agree to clamp (no rank left waiting)."""
    ref = sc.reference_run(sc.data_fp64(), None, 1)[0]
    want = {n: g.clamp(-sc.CLIP_VALUE, sc.CLIP_VALUE) for n, g in ref["grads"].items()}
    assert max(float(g.abs().max()) for g in ref["grads"].values()) > sc.CLIP_VALUE
    for res in runs["ranks"]:
        step = res["value"]["steps"][0]
        assert step["stats"].clipped and step["stats"].clip_threshold == sc.CLIP_VALUE
        assert rel_err_named(step["grads"], want) <= EXACT
    a, b = (res["value"]["steps"][0]["stats"] for res in runs["ranks"])
    assert a.post_clip_norm == b.post_clip_norm and a.clip_coef == b.clip_coef


def test_sync_each_micro_batch_reduces_k_times_and_stays_exact(
    runs: dict, ref64: list[dict]
) -> None:
    for res in runs["ranks"]:
        step = res["sync_each"]["steps"][0]
        assert step["comm_calls"] == sc.K * _groups(runs["strategy"])
        assert step["totals_all_reduces"] == 1
        assert rel_err_named(step["grads"], ref64[0]["grads"]) <= EXACT
        assert step["stats"].grad_norm == pytest.approx(ref64[0]["grad_norm"], rel=EXACT)


def test_bf16_reduces_and_accumulates_in_float32(runs: dict, ref64: list[dict]) -> None:
    """bf16 compute (FSDP2: bf16 parameters, float32 reduce_dtype) with float32 gradients;
    the normalisation is the same, so the error is bf16 rounding (~1e-2), not a factor."""
    for res in runs["ranks"]:
        step = res["bf16"]["steps"][0]
        assert step["grad_dtypes"] == {torch.float32}
        assert step["stats"].items == ref64[0]["items"]
        assert step["stats"].grad_norm == pytest.approx(ref64[0]["grad_norm"], rel=2e-2)
        assert rel_err(flat_named(step["grads"]), flat_named(ref64[0]["grads"])) <= 3e-2


def test_nan_on_one_rank_skips_on_every_rank(runs: dict) -> None:
    for rank, res in enumerate(runs["ranks"]):
        nan = res["nan"]
        assert nan["stats"].skipped, rank
        assert nan["stats"].skip_reason == "non-finite gradient norm", rank
        assert nan["same_params"] and nan["same_state"], rank  # bitwise, this rank's shard
        assert nan["step_count"] == 1 and nan["grads_cleared"], rank


def test_a_failed_micro_batch_leaves_gradient_sync_on(runs: dict) -> None:
    """After a window raises in a micro-batch that ran without sync, the user's own backward
    still reduces (FSDP2's flag restored, DDP's no_sync exited): every parameter gets a
    gradient, the same on both ranks, and it is the gradient of that backward alone (1/W of
    the sum over ranks of each rank's mean-loss gradient): nothing of the failed window
    leaks into it."""
    a, b = (r["raising"] for r in runs["ranks"])
    assert a["error"] == b["error"] == "micro-batch 2 failed"
    assert a["has_grad"] and b["has_grad"]
    for name in a["grads"]:
        assert torch.equal(a["grads"][name], b["grads"][name]), name
    want = sc.single_backward_reference(4)
    assert rel_err_named(a["grads"], want) < EXACT


@pytest.mark.parametrize("case", ["param_grad", "param_grad_sync_each"])
def test_hooks_see_each_micro_batchs_own_gradient_on_every_strategy(runs: dict, case: str):
    """``on_param_grad`` lends every parameter's gradient of each micro-batch, before it is
    summed or reduced: under FSDP2 too (the unsharded gradient), in the first window and
    later ones, with and without sync on every micro-batch. Float64, against one process."""
    for rank, result in enumerate(runs["ranks"]):
        want = sc.param_grad_reference(rank)
        got = result[case]
        assert [sorted(w) for w in got] == [sorted(w) for w in want]  # every micro-batch
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            for i in w:
                assert g[i].keys() == w[i].keys(), (step, i)
                for name in w[i]:
                    assert g[i][name] == pytest.approx(w[i][name], rel=EXACT), (step, i, name)


def test_different_window_lengths_raise_on_every_rank_without_hanging() -> None:
    """Rank 1 passes one micro-batch more. DDP's forward has no collective, so the
    Stepper's window all-reduce catches it; FSDP2's forward all-gathers, so the lengths
    must be compared before the first forward. A hang fails after 15 s (gloo timeout)."""
    ranks = run_ranks(sc.uneven_scenarios, 2, timeout=90, collective_timeout_s=15)
    for rank, res in enumerate(ranks):
        for strategy in ("ddp", "fsdp"):
            error = res[strategy]["error"]
            assert error is not None and "different lengths" in error, (strategy, rank, error)
            assert f"this rank: {sc.K + rank} micro-batches" in error
            assert res[strategy]["probe"] == 2.0  # the group still works afterwards


def test_init_reads_the_torchrun_environment(runs: dict) -> None:
    for rank, res in enumerate(runs["ranks"]):
        env = res["env"]
        assert env["env"] == (rank, 2, rank, "gloo", rank == 0)
        assert env["helpers"] == (rank, 2, rank == 0)
        assert env["min_over_ranks"] == 5


# ------------------------------------------------------------ single-process unit tests


def test_init_outside_torchrun_is_a_single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    env = gd.init(device="cpu")
    assert (env.rank, env.world_size, env.backend, env.is_main) == (0, 1, None, True)
    assert not torch.distributed.is_initialized()
    assert (gd.rank(), gd.world_size(), gd.is_main()) == (0, 1, True)
    gd.shutdown()  # a no-op without a group


def test_bad_arguments_name_the_parameter() -> None:
    with pytest.raises(ValueError, match="backend must be one of auto, gloo, nccl"):
        gd.init(backend="mpi")
    with pytest.raises(ValueError, match="timeout_s"):
        gd.init(timeout_s=0)
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="strategy must be one of none, ddp, fsdp"):
        gd.prepare_model(model, "deepspeed")
    with pytest.raises(ValueError, match="precision must be one of"):
        gd.prepare_model(model, "ddp", precision="fp8")
    with pytest.raises(RuntimeError, match="torchrun"):
        gd.prepare_model(model, "fsdp")
    assert gd.prepare_model(model, "none") is model
    with pytest.raises(TypeError, match="DDP or FSDP2"):
        count_gradient_comms(model)


def test_quiet_unless_main(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with gd.quiet_unless_main():
        print("from rank 0")
    monkeypatch.setattr(gd.collectives, "is_main", lambda: False)
    with pytest.raises(KeyError), gd.quiet_unless_main():
        print("from rank 1")
        print("also rank 1", file=sys.stderr)
        raise KeyError("still raised, after stdout/stderr are restored")
    print("restored")
    out, err = capsys.readouterr()
    assert out == "from rank 0\nrestored\n" and err == ""


def test_find_blocks() -> None:
    gpt = tiny_gpt()
    assert gd.find_blocks(gpt) == list(gpt.blocks)
    assert gd.find_blocks(gpt, "blocks") == list(gpt.blocks)
    # Only the outermost ModuleList: its children are the blocks, not their insides.
    outer = nn.ModuleList([nn.Sequential(nn.ModuleList([nn.Linear(2, 2)])) for _ in range(3)])
    nested = nn.Sequential(outer)
    assert gd.find_blocks(nested) == list(outer)
    assert gd.find_blocks(nn.Linear(2, 2)) == []
    with pytest.raises(ValueError, match="blocks_attr='layers'.*no submodule"):
        gd.find_blocks(gpt, "layers")
    with pytest.raises(ValueError, match="blocks_attr='lm_head' must name an nn.ModuleList"):
        gd.find_blocks(gpt, "lm_head")


# ------------------------------------------------------------------- the CLI, torchrun


def _corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    lines = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400)]
    path.write_text("".join(lines))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_torchrun_cli_two_ranks(strategy: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        f"--master_port={free_port()}", "-m", "gradstep", "train",
        "--strategy", strategy, "--device", "cpu", "--data", str(_corpus(tmp_path)),
        "--n-layer", "2", "--n-head", "2", "--d-model", "32", "--seq-len", "32",
        "--micro-batch-size", "2", "--accum-steps", "2", "--max-steps", "3",
        "--warmup", "1", "--eval-every", "2", "--eval-batches", "3", "--log-every", "1",
        "--sample-tokens", "4", "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["effective_batch_sequences"] == 2 * 2 * 2  # micro-batch x k x ranks
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    # 3 validation batches over 2 ranks: each evaluates 1 (FSDP2 needs equal forwards).
    assert "val_loss" in metrics[1] and "val_loss" in metrics[2]
    assert len(summary["sample"]) > 0
    # Only rank 0 prints: one summary block, one plain log line per step.
    assert proc.stdout.count("effective batch:") == 1, proc.stdout
    assert proc.stderr.count("step 3/3") == 1, proc.stderr
