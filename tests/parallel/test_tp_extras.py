"""The rest of the step on FSDP2 + tensor parallel, a (dp=2, tp=2) mesh of 4 gloo ranks,
against one process in float64 (tests/parallel/tp_extra_ranks.py): AGC's unit-wise norms,
LARS and LAMB trust ratios, the noise-scale hook, out-of-memory splitting, and checkpoints
(resumed on the 2-D mesh, resharded to plain FSDP2 on 2 ranks).

Every scenario runs in one 4-rank job (``extras``) and the reshard in one 2-rank job:
starting ranks costs seconds here. The tolerance is 1e-12 throughout, with the clip acting
on every step; a resume is bit-identical.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.parallel import tp_extra_ranks as ex
from tests.parallel import tp_ranks as tp
from tests.support.multiproc import run_ranks

pytestmark = pytest.mark.distributed

EXACT = 1e-12
WORLD = tp.DP * tp.TP


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tp_extras")


@pytest.fixture(scope="module")
def extras(folder: Path) -> list[dict[str, Any]]:
    return run_ranks(ex.extras_run, WORLD, str(folder), timeout=400, collective_timeout_s=120)


def _close(got: dict, want: dict, where: Any) -> None:
    assert got.keys() == want.keys(), where
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=EXACT, atol=EXACT, msg=str(where))


@pytest.mark.parametrize(
    ("case", "opt"), [("agc_lars_tp", "lars"), ("agc_lamb_sp", "lamb")], ids=["tp", "tp+sp"]
)
def test_agc_and_layer_adaptive_optimizers_equal_one_process(
    extras: list[dict], case: str, opt: str
) -> None:
    """AGC's unit-wise clip (rows split over tp by rowwise weights, whole rows under
    colwise and FSDP2, vectors sharded or copied, parameters on two meshes without sequence
    parallel) and the LARS / LAMB trust ratios that follow it: the clipped gradient and
    the parameters equal one float64 process at every step, on every rank."""
    ref = ex.reference(opt, "agc", tp.STEPS)
    model = tp.model64()
    units = sum(len(ex.units_of(p)) for n, p in model.named_parameters() if n not in ex.EXCLUDE)
    for rank, res in enumerate(extras):
        assert res[case]["strategy"] == "FSDP2TPStrategy", rank
        for step, (got, want) in enumerate(zip(res[case]["steps"], ref, strict=True)):
            stats, where = got["stats"], (rank, case, step)
            assert stats.items == want["items"], where
            assert stats.grad_norm == pytest.approx(want["l2"], rel=EXACT), where
            # Some units clipped, not all: both branches of the rule ran.
            assert got["units"] == want["units"] and 0 < want["units"] < units, where
            assert stats.clipped and stats.policies[0]["acted"], where
            _close(got["grads"], want["grads"], where)
            _close(got["params"], want["params"], where)


@pytest.mark.parametrize("case", ["agc_lars_tp", "agc_lamb_sp"], ids=["tp", "tp+sp"])
def test_noise_scale_measures_whole_micro_batch_gradients(extras: list[dict], case: str) -> None:
    """The hook sees each rank's part of the unsharded micro-batch gradient (plain copies
    outside the plan, tp shards and copies, sequence parallel's Partial norms): its inputs,
    sum_i |s_i|^2 and |s|^2, and so its raw estimates equal one process's."""
    opt = "lars" if case == "agc_lars_tp" else "lamb"
    for step, want in enumerate(ex.reference(opt, "agc", tp.STEPS)):
        n, n_sq = want["items"], want["n_sq"]
        grad_sq = (want["big_sq"] - want["small_sq"]) / (n * n - n_sq)
        trace = (want["small_sq"] - n_sq * grad_sq) / n
        for rank, res in enumerate(extras):
            got, where = res[case]["steps"][step]["gns"], (rank, case, step)
            assert got["grad_sq"] == pytest.approx(grad_sq, rel=EXACT), where
            assert got["trace_cov"] == pytest.approx(trace, rel=EXACT), where
            small = got["trace_cov"] * n + n_sq * got["grad_sq"]  # the inputs, recovered
            big = got["grad_sq"] * (n * n - n_sq) + small
            assert small == pytest.approx(want["small_sq"], rel=EXACT), where
            assert big == pytest.approx(want["big_sq"], rel=EXACT), where


def test_out_of_memory_splits_every_rank_and_keeps_the_update(extras: list[dict]) -> None:
    """dp rank 0 (both of its tp peers) runs out of memory in step 1's second micro-batch:
    all 4 ranks drop the window and split together, once, and every step's update equals
    the unsplit one of one process."""
    ref = ex.reference("adamw", "norm", ex.STEPS)
    for rank, res in enumerate(extras):
        stats = res["oom"]["stats"]
        assert [s.oom_splits for s in stats] == [1, 0, 0, 0, 0], rank
        for step, (got, want) in enumerate(zip(stats, ref, strict=True)):
            where = (rank, step)
            assert got.items == want["items"] and got.clipped, where
            norm = want["norms"][ex.NORM_TYPES[step]]
            assert got.grad_norm == pytest.approx(norm, rel=EXACT), where
        _close(res["oom"]["grads"], ref[-1]["grads"], rank)
        _close(res["oom"]["params"], ref[-1]["params"], rank)


def test_checkpoint_resumes_on_the_2d_mesh_bit_identically(extras: list[dict]) -> None:
    """3 steps, save (DCP, model + AdamW + Stepper), 2 more; a fresh model loading the
    checkpoint and taking the same 2 steps ends bit-identical, statistics included."""
    for rank, res in enumerate(extras):
        got = res["resume"]
        assert got["loaded_at"] == ex.SAVED_AT and got["halvings"] == 1, rank
        for key in ("params", "grads"):
            for name, want in got["straight"][key].items():
                assert torch.equal(got["resumed"][key][name], want), (rank, key, name)
        for name, state in got["straight"]["optim"].items():
            for k, want in state.items():
                assert torch.equal(got["resumed"]["optim"][name][k], want), (rank, name, k)
        for a, b in zip(got["resumed_stats"], got["straight_stats"], strict=True):
            assert (a.loss, a.grad_norm, a.items, a.clip_coef) == (
                b.loss, b.grad_norm, b.items, b.clip_coef
            ), rank  # fmt: skip


def test_checkpoint_reshards_to_plain_fsdp2_on_two_ranks(extras: list[dict], folder: Path) -> None:
    """The (dp=2, tp=2) checkpoint loads into a 1-D FSDP2 model on 2 ranks: parameters and
    AdamW state equal the saved ones bit for bit, and its next step equals one process's."""
    assert extras  # the 4-rank job wrote the checkpoint
    saved = torch.load(folder / "saved.pt", weights_only=False)
    ref = ex.reference("adamw", "norm", ex.SAVED_AT + 1)[-1]
    for rank, res in enumerate(run_ranks(ex.reshard_run, tp.DP, str(folder), timeout=200)):
        assert res["loaded_at"] == ex.SAVED_AT and res["strategy"] == "FSDP2Strategy", rank
        for name, want in saved["params"].items():
            assert torch.equal(res["loaded"]["params"][name], want), (rank, name)
        for name, state in saved["optim"].items():
            assert state.keys() == res["loaded"]["optim"][name].keys(), (rank, name)
            for k, want in state.items():
                assert torch.equal(res["loaded"]["optim"][name][k], want), (rank, name, k)
        (stats,) = res["stats"]
        assert stats.items == ref["items"] and stats.clipped, rank
        norm = ref["norms"][ex.NORM_TYPES[ex.SAVED_AT]]
        assert stats.grad_norm == pytest.approx(norm, rel=EXACT), rank
        _close(res["stepped"]["params"], ref["params"], rank)
