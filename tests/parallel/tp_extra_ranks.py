"""Rank side of test_tp_extras.py: the rest of the step on a (dp=2, tp=2) mesh.

The model, its two tensor-parallel plans (``tp``: blocks only, gradients on two meshes;
``tp+sp``: sequence parallel, every parameter on the 2-D mesh) and the data come from
tp_ranks.py. What runs here, all in one 4-rank job (:func:`extras_run`):

- AGC (unit-wise, output layer excluded) with LARS on ``tp`` and with LAMB on ``tp+sp``,
  the noise-scale hook watching both: per step the clipped gradient, the parameters, the
  units clipped, and the hook's raw estimates;
- ``on_oom="split"`` on ``tp`` with AdamW + ClipNorm, one dp rank (both of its tp peers)
  running out of memory on micro-batches of more than 2 rows: 3 steps, a checkpoint, 2
  steps; then a fresh model loads the checkpoint and takes the same 2 steps.

:func:`reshard_run` (2 ranks) loads that checkpoint into a plain 1-D FSDP2 model.
:func:`reference` is the plain way: one process, float64, every dp rank's micro-batches.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.parallel import tp_ranks as tp
from tests.policies.helpers import agc_reference
from tests.support.batches import collate, concat, make_windows, rows

AGC_CLIPPING, AGC_EPS = 0.05, 1e-3  # measured: about half of the units clip at every step
EXCLUDE = ["head.weight", "head.bias"]  # the output layer, as the paper leaves it
SAVED_AT, STEPS = 3, 5  # the checkpoint scenario: 3 steps, save, 2 more
NORM_TYPES = (2.0, 1.0, math.inf, 2.0, 1.0)  # ClipNorm's norm type per step
OOM_ROWS = 2  # dp rank 0 runs out of memory on micro-batches of more rows


def windows(steps: int) -> list[list[list[dict]]]:
    """``[step][dp_rank]``: tp_ranks' windows (its first 3 steps are these), padded to T."""
    raw = make_windows(steps, tp.DP, tp.K, seed=3)
    return [[[collate(rows(mb), pad_to=tp.T) for mb in w] for w in per_rank] for per_rank in raw]


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    """Every parameter adapted (weight decay on all of them): trust ratios of matrices
    and vectors on every layout of the mesh.

    LAMB's eps is 1e-4, not timm's 1e-6: the attention key bias's gradient is zero in exact
    arithmetic (softmax ignores a shift shared by every key), so its Adam moments hold
    rounding noise (~1e-18), which ``m / (sqrt(v) + eps)`` times the trust ratio (~1/wd)
    and lr carries into the parameter as noise / eps: 5e-12 at eps=1e-6, with no error
    anywhere else (the gradients agree to 3e-18).
    """
    from gradstep.optim import LAMB, LARS

    if name == "lars":
        return LARS(params, lr=0.5, momentum=0.9, weight_decay=1e-2, trust_coeff=0.02)
    if name == "lamb":
        return LAMB(params, lr=1e-2, weight_decay=1e-2, eps=1e-4)
    return tp.optimizer(name, params)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "params": {n: _full(p) for n, p in model.named_parameters()},
        "grads": {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None},
    }
    if opt is not None:
        out["optim"] = {
            n: {k: _full(v) for k, v in opt.state[p].items()} for n, p in model.named_parameters()
        }
    return out


# ------------------------------------------------------------------ the plain way


def _micro_batch_sums(model: nn.Module, mbs: list[dict]) -> tuple[float, float]:
    """Sum over micro-batches of |gradient of its loss SUM|^2, and of its items squared."""
    small, n_sq = 0.0, 0.0
    for mb in mbs:
        model.zero_grad(set_to_none=True)
        loss = tp.loss_sum(model, mb)
        loss.total.backward()
        small += sum(float(p.grad.square().sum()) for p in model.parameters())
        n_sq += float(loss.count) ** 2
    model.zero_grad(set_to_none=True)
    return small, n_sq


def units_of(t: torch.Tensor) -> torch.Tensor:
    """One row per AGC unit: a matrix's rows, a vector whole."""
    return t.flatten(1) if t.dim() > 1 else t.view(1, -1)


def _agc_clip(model: nn.Module, grads: dict, step: int) -> tuple[dict, int]:
    """AGC's rule, row by row (tests/policies/helpers.py); a unit clipped is one changed."""
    clipped = agc_reference(model, grads, AGC_CLIPPING, AGC_EPS, EXCLUDE)
    units = sum(int((units_of(clipped[n]) != units_of(g)).any(1).sum()) for n, g in grads.items())
    return clipped, units


def _norm_clip(model: nn.Module, grads: dict, step: int) -> tuple[dict, int]:
    """ClipNorm's rule: min(1, max / (norm + 1e-6)), norm of this step's type."""
    norm = float(torch.nn.utils.get_total_norm(list(grads.values()), NORM_TYPES[step]))
    coef = min(1.0, tp.MAX_NORM / (norm + 1e-6))
    return {n: g * coef for n, g in grads.items()}, int(coef < 1)


CLIPS: dict[str, Callable[[nn.Module, dict, int], tuple[dict, int]]] = {
    "agc": _agc_clip,
    "norm": _norm_clip,
}


@functools.cache
def reference(opt_name: str, clip: str, steps: int) -> list[dict[str, Any]]:
    """One process, float64, each step on every dp rank's micro-batches: the loss (sum of
    token losses / their count), the norms of types 1, 2 and inf, the noise-scale inputs
    (micro-batch and window squared gradient-sum norms, n_i^2, N), the clip (AGC's
    unit-wise rule or ClipNorm's), the clipped gradient and the parameters after the step."""
    model = tp.model64()
    opt = make_optimizer(opt_name, model.parameters())
    out = []
    for step, per_rank in enumerate(windows(steps)):
        mbs = [mb for rank_mbs in per_rank for mb in rank_mbs]
        small, n_sq = _micro_batch_sums(model, mbs)
        batch = concat(mbs)
        items = int((batch["labels"] != -100).sum())
        (tp.loss_sum(model, batch).total / items).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        flat = list(grads.values())
        norms = {p: float(torch.nn.utils.get_total_norm(flat, p)) for p in (1.0, 2.0, math.inf)}
        l2 = norms[2.0]
        clipped, units = CLIPS[clip](model, grads, step)
        for n, p in model.named_parameters():
            p.grad = clipped[n].clone()
        opt.step()
        row = {"items": items, "l2": l2, "norms": norms, "small_sq": small, "n_sq": n_sq}
        row |= {"big_sq": (items * l2) ** 2, "units": units, "grads": clipped}
        row["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        out.append(row)
    return out


# ------------------------------------------------------------------ the ranks


def extras_run(rank: int, world: int, folder: str) -> dict[str, Any]:
    """Every scenario of test_tp_extras.py on one (dp=2, tp=2) job."""
    return {
        "agc_lars_tp": _agc_run(sp=False, opt_name="lars"),
        "agc_lamb_sp": _agc_run(sp=True, opt_name="lamb"),
        **_oom_checkpoint_run(rank, Path(folder)),
    }


def _agc_run(sp: bool, opt_name: str) -> dict[str, Any]:
    import gradstep

    model, mesh = tp.build(sp)
    agc, gns = gradstep.AGC(AGC_CLIPPING, AGC_EPS, exclude=EXCLUDE), gradstep.GradientNoiseScale()
    opt = make_optimizer(opt_name, model.parameters())
    stepper = gradstep.Stepper(model, opt, clip=agc, hooks=[gns])
    dp_rank = mesh["dp"].get_local_rank()
    out: dict[str, Any] = {"strategy": type(stepper.strategy).__name__, "steps": []}
    for per_rank in windows(tp.STEPS):
        stats = stepper.step(per_rank[dp_rank], tp.loss_sum)
        got = {"stats": stats, "units": agc.clipped_units, "gns": gns.last}
        out["steps"].append(got | _snapshot(model))
    return out


def _oom_loss(dp_rank: int) -> Callable[[nn.Module, dict], Any]:
    """tp_ranks' loss, running out of memory (before the forward, as a real allocation
    failure would on both tp peers of identical shapes) on dp rank 0's micro-batches of
    more than OOM_ROWS rows."""

    def loss_fn(model: nn.Module, mb: dict) -> Any:
        if dp_rank == 0 and mb["input_ids"].shape[0] > OOM_ROWS:
            raise torch.OutOfMemoryError("out of memory (simulated)")
        return tp.loss_sum(model, mb)

    return loss_fn


def _fresh(sp: bool = False) -> tuple[nn.Module, Any, Any, Any]:
    import gradstep

    model, mesh = tp.build(sp)
    opt = tp.optimizer("adamw", model.parameters())
    stepper = gradstep.Stepper(model, opt, on_oom="split")
    return model, opt, stepper, mesh


def _steps(stepper: Any, data: list, first: int, dp_rank: int) -> list[Any]:
    import gradstep

    stats = []
    for step in range(first, len(data)):
        stepper.clip = gradstep.ClipNorm(tp.MAX_NORM, norm_type=NORM_TYPES[step])
        stats.append(stepper.step(data[step][dp_rank], _oom_loss(dp_rank)))
    return stats


def _oom_checkpoint_run(rank: int, folder: Path) -> dict[str, Any]:
    """OOM splitting, then save on the 2-D mesh, then resume there (see the module docs)."""
    import gradstep

    data = windows(STEPS)
    model, opt, stepper, mesh = _fresh()
    dp_rank = mesh["dp"].get_local_rank()
    ckpt = gradstep.Checkpointer(folder / "ckpt")
    stats = _steps(stepper, data[:SAVED_AT], 0, dp_rank)
    saved = _snapshot(model, opt)
    ckpt.save(SAVED_AT, model=model, optimizer=opt, stepper=stepper)
    if rank == 0:  # what the 1-D reshard must find
        torch.save({k: saved[k] for k in ("params", "optim")}, folder / "saved.pt")
    stats += _steps(stepper, data, SAVED_AT, dp_rank)
    straight = _snapshot(model, opt)
    model, opt, stepper, _ = _fresh()
    loaded_at = ckpt.load_latest(model=model, optimizer=opt, stepper=stepper)
    halvings = stepper.oom_halvings
    resumed_stats = _steps(stepper, data, SAVED_AT, dp_rank)
    return {
        "oom": {"stats": stats, "params": straight["params"], "grads": straight["grads"]},
        "resume": {
            "loaded_at": loaded_at,
            "halvings": halvings,
            "straight": straight,
            "resumed": _snapshot(model, opt),
            "straight_stats": stats[SAVED_AT:],
            "resumed_stats": resumed_stats,
        },
    }


def reshard_run(rank: int, world: int, folder: str) -> dict[str, Any]:
    """The (dp=2, tp=2) checkpoint loaded into plain FSDP2 on 2 ranks, then one more step."""
    from torch.distributed.fsdp import fully_shard

    import gradstep

    model = tp.model64()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = tp.optimizer("adamw", model.parameters())
    stepper = gradstep.Stepper(model, opt, on_oom="split")
    loaded_at = gradstep.Checkpointer(Path(folder, "ckpt")).load_latest(
        model=model, optimizer=opt, stepper=stepper
    )
    out = {"loaded_at": loaded_at, "strategy": type(stepper.strategy).__name__}
    out["loaded"] = _snapshot(model, opt)
    out["stats"] = _steps(stepper, windows(SAVED_AT + 1), SAVED_AT, rank)
    out["stepped"] = _snapshot(model)
    return out
