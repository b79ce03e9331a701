"""Invariants of the parallel step that the parity tests (test_distributed.py) cannot see.

On real 2-rank gloo runs (one start per strategy, tests/parallel/invariant_ranks.py):

- fp16: an overflow in ONE rank's data skips the step on every rank and backs the loss
  scale off on every rank the same way, also where (FSDP2) the inf lands in one rank's
  shard only, and also where every gradient is finite but their norm overflows (no
  GradScaler sees anything there; only gradstep's own back-off acts);
- FSDP2 bf16: gradients are reduced and accumulated in float32, to float32 rounding of
  the exact sum of the bf16 micro-batch gradients (a bf16-reduce twin built in the
  scenario errs 1e5 times more);
- FSDP2: the reported L2 norm is the global one, not this rank's shard's;
- the gradient-sync flag is on again after every step (and after a failed window), with
  exactly one full gradient reduction per optimizer step and a gradient on every parameter;
- layouts that are not data parallel over the whole world are refused by name;
- DDP with buffers compares window lengths before the forward (its forward communicates).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.parallel import distributed_ranks as sc
from tests.parallel import invariant_ranks as inv
from tests.support.asserts import rel_err_named
from tests.support.models import TINY_GPT, tiny_gpt
from tests.support.multiproc import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(150)]

EXACT = 1e-12


def _start(strategy: str) -> dict:
    """One start per strategy runs every case; a hang fails after 30 s (gloo timeout)."""
    ranks = run_ranks(inv.invariant_scenarios, 2, strategy, timeout=120, collective_timeout_s=30)
    return {"strategy": strategy, "ranks": ranks}


@pytest.fixture(scope="module")
def ddp() -> dict:
    return _start("ddp")


@pytest.fixture(scope="module")
def fsdp() -> dict:
    return _start("fsdp")


@pytest.fixture(params=["ddp", "fsdp"])
def runs(request: pytest.FixtureRequest) -> dict:
    """The properties every strategy must have: both starts."""
    return request.getfixturevalue(request.param)


def _case(runs: dict, name: str) -> list[dict]:
    """Both ranks' results of one case; a case that raised fails here with its traceback."""
    out = []
    for rank, res in enumerate(runs["ranks"]):
        got = res[name]
        assert not (isinstance(got, dict) and "failed" in got), (
            f"{runs['strategy']} rank {rank}: case {name!r} raised:\n{got['failed']}"
        )
        out.append(got)
    return out


FP16_INF = inv.FP16_KINDS.index("inf")
FP16_HUGE = inv.FP16_KINDS.index("huge")
PARAM_BYTES_FP64 = 8 * sum(p.numel() for p in tiny_gpt().parameters())


def _groups(strategy: str) -> int:
    return 1 if strategy == "ddp" else TINY_GPT.n_layer + 1


# ------------------------------------------------------------------------------ fp16


def _check_overflow_skip(runs: dict, index: int) -> None:
    """fp16 step ``index`` overflowed on rank 0's data: skipped on both ranks, parameters
    and optimizer state bitwise unchanged, the loss scale halved and equal on both ranks;
    the next step is taken on both, at the halved scale."""
    strategy = runs["strategy"]
    ranks = _case(runs, "fp16")
    for rank, res in enumerate(ranks):
        where = f"{strategy} rank {rank}"
        before, hot, after = res["steps"][index - 1 : index + 2]
        assert not before["stats"].skipped and not after["stats"].skipped, where
        assert hot["stats"].skipped, f"{where}: the overflow step was taken"
        assert hot["stats"].skip_reason == "non-finite gradient norm", where
        assert hot["same_params"] and hot["same_state"], f"{where}: the skipped step moved"
        assert hot["step_count"] == before["step_count"], where
        assert hot["scale"] == before["scale"] / 2, (
            f"{where}: loss scale {before['scale']} -> {hot['scale']}, not halved on overflow"
        )
        assert hot["stats"].loss_scale == hot["scale"], where
        assert after["step_count"] == hot["step_count"] + 1, where
        assert not after["same_params"], f"{where}: the step after the overflow did not move"
        assert after["scale"] == hot["scale"], where
    scales = [[s["scale"] for s in res["steps"]] for res in ranks]
    assert scales[0] == scales[1], f"{strategy}: loss scales differ across ranks: {scales}"


def test_fp16_overflow_in_one_ranks_data_skips_and_backs_off_on_every_rank(runs: dict) -> None:
    """An fp16 overflow (inf) in rank 0's data only: every rank skips and halves its scale.

    DDP all-reduces the inf into every rank's gradient. Under FSDP2 the overflowing unit
    (HOT_UNIT) lives in rank 1's shard only: rank 0's local shard is finite (asserted below:
    the case is built so). In torch 2.13 DTensor's unscale already reduces GradScaler's
    found_inf over the mesh (a max), and gradstep forces found_inf on every rank from its
    global norm as well: either keeps the ranks' scales equal."""
    assert [r["initial_scale"] for r in _case(runs, "fp16")] == [2.0**16] * 2
    _check_overflow_skip(runs, FP16_INF)
    # Where the inf landed (guards on the case, not on gradstep).
    ranks = _case(runs, "fp16")
    finite = [all(r["steps"][FP16_INF]["finite_shard"].values()) for r in ranks]
    if runs["strategy"] == "fsdp":
        assert finite == [True, False], "the inf must land in rank 1's shard only"
    else:
        assert finite == [False, False], "DDP: every rank holds the reduced inf"


def test_fp16_non_finite_norm_of_finite_gradients_backs_off_on_every_rank(runs: dict) -> None:
    """A float32 gradient in rank 0's data too large for its squared norm (G_HUGE): every
    gradient is finite on every rank (asserted), so no rank's GradScaler finds an inf, but
    the global L2 norm is inf. gradstep skips on that norm and must back the scale off on
    every rank the same way, by setting found_inf itself (Precision.skip): without that
    the scale stays and GradScaler even counts the skipped step towards growing it."""
    ranks = _case(runs, "fp16")
    assert all(all(r["steps"][FP16_HUGE]["finite_shard"].values()) for r in ranks)
    assert all(math.isinf(r["steps"][FP16_HUGE]["stats"].grad_norm) for r in ranks)
    _check_overflow_skip(runs, FP16_HUGE)


def test_fp16_first_window_all_reduces_the_prescale_once(runs: dict) -> None:
    """The fp16 pre-scale is measured once, in the first window (one float64 number over
    the ranks); later windows issue only the step's usual small collectives."""
    f64 = torch.float64
    usual = {("all_reduce", sc.WINDOW_NUMBERS, f64): 1}
    if runs["strategy"] == "fsdp":
        # its forward communicates: the window check; its totals carry the norm**p
        usual = {("all_reduce", 2, f64): 1, ("all_reduce", sc.WINDOW_AND_NORM, f64): 1}
    for rank, res in enumerate(_case(runs, "fp16")):
        for i, step in enumerate(res["steps"]):
            _, own = sc.split_collectives(step["collectives"])
            small = {}
            for c in own:
                if not c[0].startswith("funcol."):
                    small[c[:3]] = small.get(c[:3], 0) + 1
            want = {**usual, ("all_reduce", 1, f64): 1} if i == 0 else usual
            assert small == want, (runs["strategy"], rank, i, own)


# ------------------------------------------------------------------------ bf16 FSDP2

# Measured (torch 2.13, CPU, gloo, K_BF16 = 32 micro-batches per rank, largest per-tensor
# relative error): the default policy (reduce_dtype=float32) is 3.8e-8 from the float64 sum
# of the micro-batch gradients, the bf16-reduce twin 1.3e-2 (3.4e5 times further). Against
# the float64 full-batch reference instead both sit at the bf16 compute error (5.2e-3 vs
# 8.5e-3, whole vector): that comparison cannot tell them apart.
BF16_FP32_REDUCE = 1e-5  # 260x the measured float32 rounding, 1/1300 of the twin's error
BF16_TWIN_AT_LEAST = 1e-3  # a guard that the case discriminates (measured 1.3e-2)
BF16_RATIO = 100  # the twin at least 100x further from the sum than the default (3.4e5)


def test_bf16_fsdp2_reduces_and_accumulates_in_float32(fsdp: dict) -> None:
    """``prepare_model(..., "fsdp", precision="bf16")``: bf16 compute, but the K_BF16
    micro-batch gradients of each rank and the two ranks' sums are added in float32.

    Reference: every micro-batch gradient exactly as the backend computed it (bf16, lent
    by ``on_param_grad`` before accumulation or reduction), summed over micro-batches and
    ranks in float64 and divided by the global token count. A float32 reduction and
    accumulation rounds only in float32; bf16 (the twin, ``MixedPrecisionPolicy(bf16,
    reduce_dtype=bf16)`` built in the scenario) loses about 1% over 32 partial sums.
    """
    default, twin = _case(fsdp, "bf16"), _case(fsdp, "bf16_twin")
    items = default[0]["stats"].items
    assert items == twin[0]["stats"].items
    names = default[0]["micro_batch_sum"].keys()
    want = {n: sum(r["micro_batch_sum"][n] for r in default) / items for n in names}
    want_twin = {n: sum(r["micro_batch_sum"][n] for r in twin) / items for n in names}
    for rank in range(2):
        assert default[rank]["micro_batch_dtypes"] == {torch.bfloat16}  # bf16 compute
        err = rel_err_named(default[rank]["grads"], want)
        err_twin = rel_err_named(twin[rank]["grads"], want_twin)
        assert err_twin >= BF16_TWIN_AT_LEAST, f"the case does not discriminate: {err_twin:.2e}"
        assert err <= BF16_FP32_REDUCE, (
            f"rank {rank}: {err:.2e} from the float64 sum of the micro-batch gradients "
            f"(bf16-reduce twin: {err_twin:.2e}): not reduced/accumulated in float32"
        )
        assert err_twin >= BF16_RATIO * err, (err, err_twin)


# -------------------------------------------------------------------- L2 norm, FSDP2


def test_fsdp2_l2_norm_is_the_global_norm_not_a_shards(fsdp: dict) -> None:
    """The reported L2 grad_norm equals the float64 full-batch norm (1e-12) and is far
    (> 10%) from either rank's own shard norm; the shard norms combine to it in L2.

    ``FSDP2Strategy.total_norm`` itself, on either rank's shards, returns a plain tensor
    holding the global norm.
    (In torch 2.13 ``get_total_norm`` over DTensor shards already returns a Replicate
    DTensor for p=2, reduced inside torch; only p=inf comes back Partial(max): see
    test_inf_norm_is_the_max_over_every_shard.)
    """
    ref = sc.reference_run(inv.norm_data(), None, 1)[0]["grad_norm"]
    ranks = _case(fsdp, "l2")
    n_params = sum(p.numel() for p in tiny_gpt().parameters())
    assert sum(r["shard_numel"] for r in ranks) >= n_params  # the shards cover the model
    for rank, res in enumerate(ranks):
        assert res["grad_norm"] == pytest.approx(ref, rel=EXACT), rank
        assert not res["direct_is_dtensor"], rank
        # total_norm called directly on this rank's (normalised) gradient shards.
        assert res["direct"] == pytest.approx(ref, rel=EXACT), rank
        assert abs(res["shard_norm"] - ref) > 0.1 * ref, (rank, res["shard_norm"], ref)
    combined = (ranks[0]["shard_norm"] ** 2 + ranks[1]["shard_norm"] ** 2) ** 0.5
    assert combined == pytest.approx(ref, rel=1e-10)


# ---------------------------------------------------------------------- sync flag


def test_gradient_sync_is_on_after_every_step_with_one_reduction_per_step(runs: dict) -> None:
    """k = 3 micro-batches per step: exactly one full gradient reduction per optimizer
    step (DDP: one all-reduce of the bucket; FSDP2: one reduce-scatter per group), every
    parameter holds a gradient after ``stepper.step``, and every FSDP2 parameter group (DDP:
    the model) reports gradient sync enabled after each step and after a window that
    raised in a micro-batch that ran without sync."""
    strategy = runs["strategy"]
    for rank, res in enumerate(_case(runs, "sync")):
        where = f"{strategy} rank {rank}"
        assert res["before"] and all(res["before"]), where
        for i, step in enumerate(res["steps"]):
            assert all(step["flags"]), f"{where} step {i}: gradient sync left off: {step}"
            assert step["no_grad"] == [], (
                f"{where} step {i}: parameters without a gradient after Stepper.step: "
                f"{step['no_grad']}"
            )
            assert step["comm_calls"] == _groups(strategy), (
                f"{where} step {i}: {step['comm_calls']} gradient reductions, want one full "
                f"reduction ({_groups(strategy)} collectives)"
            )
            # each parameter's gradient once (FSDP2: groups padded to the world size)
            assert PARAM_BYTES_FP64 <= step["comm_bytes"] < 1.01 * PARAM_BYTES_FP64, (where, i)
        assert res["error"] == "micro-batch 2 failed", where
        assert all(res["after_error"]), f"{where}: sync left off after a failed window"


# ------------------------------------------------------------ refused layouts (C12)

WHOLE_GROUP = "data parallelism over the whole default process group"


def test_tensor_or_pipeline_parallel_layouts_are_refused_by_name(runs: dict) -> None:
    """DDP over a per-rank subgroup, and FSDP2 over the "dp" dimension (size 1) of a
    (dp=1, tp=2) mesh: ``gradstep.UnsupportedSetup`` (a NotImplementedError) that says
    what is supported, when the Stepper is built. A strategy handed a dp_group smaller
    than the world is refused too."""
    for rank, res in enumerate(_case(runs, "refused")):
        cases = ["ddp_subgroup"] if runs["strategy"] == "ddp" else ["fsdp_dp_of_2d_mesh"]
        for case in cases:
            got = res[case]
            assert got["unsupported"] and got["not_implemented"], (rank, case, got)
            assert WHOLE_GROUP in got["message"], (rank, case, got["message"])
            assert "spans 1 of 2 ranks" in got["message"], (rank, case, got["message"])
        if runs["strategy"] == "ddp":
            got = res["dp_group"]
            assert got["unsupported"] and "dp_group spans 1 of 2 ranks" in got["message"], got


# ------------------------------------------------------------ DDP with buffers (C14)


def test_ddp_with_buffers_compares_window_lengths_before_the_forward(ddp: dict) -> None:
    """DDP's forward broadcasts buffers (a collective), so ``forward_communicates``; a rank
    passing one micro-batch more raises the window-length error on every rank before any
    forward runs (no hang: gloo would time out after 30 s), and the group still works.
    Without buffer broadcasting (or without buffers) the forward does not communicate."""
    for rank, res in enumerate(_case(ddp, "buffers")):
        assert res["forward_communicates"] is True, f"rank {rank}: DDP with a buffer"
        assert "broadcast_buffers=False" in res["without"], res["without"]
        assert all(v is False for v in res["without"].values()), (
            f"forward_communicates without buffer broadcasts: {res['without']}"
        )
        assert not res["even"]["skipped"] and res["even"]["step_count"] == 1, rank
        error = res["error"]
        assert error is not None and "different lengths" in error, (rank, error)
        assert f"this rank: {inv.K + rank} micro-batches" in error, error
        assert res["forwards"] == 0, f"rank {rank}: {res['forwards']} forwards before the check"
        assert res["probe"] == 2.0, rank
