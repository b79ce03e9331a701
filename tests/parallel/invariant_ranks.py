"""Rank-side scenarios of tests/parallel/test_distributed_invariants.py.

``invariant_scenarios`` runs, on each of 2 gloo ranks and in one start per strategy, the
cases the invariant tests check: fp16 overflow back-off on every rank, FSDP2 bf16
reduction and accumulation in float32, the global L2 norm over shards, the gradient-sync
flag, refused (non data-parallel) layouts and DDP with buffers. Each case is guarded: one
that raises reports its traceback under its own name (``{"failed": ...}``) and the others
still run, so a broken invariant fails the test that names it, not a shared fixture.
"""

from __future__ import annotations

import inspect
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tests.parallel.distributed_ranks import CollectiveSpy, _full, _local, _name, adamw
from tests.support.batches import Batch, make_windows
from tests.support.models import tiny_gpt
from tests.support.reference import failing_loss, lm_loss

K = 3  # micro-batches per rank in the sync / norm cases
K_BF16 = 32  # ... in the bf16 accumulation case: many small partial sums
SEED_BF16 = 7
SEED_NORM = 11

# ------------------------------------------------------------------------------ fp16

FP16_ROWS = 2  # rows per micro-batch
FP16_UNITS = 8  # output units; FSDP2 gives rank r units 4r .. 4r + 3 of every parameter
HOT_UNIT = 7  # on rank 1's shard
# The loss sum is sum(w * lin(x)) + sum(gain * g). With the loss scale 2^16 and the fp16
# pre-scale 1 / FP16_ROWS, the fp16 gradient of lin(x) is 2^15 * w: w = 0.1 keeps every
# fp16 gradient below 65504 (the bias sums 2 rows: 6554), w = 1e3 on HOT_UNIT overflows
# fp16 (3.3e7 -> inf) in that unit's weight row and bias entry only.
W_NORMAL = 0.1
W_HOT = 1e3
# ``gain * g`` runs in float32 under autocast: g = 1e24 gives gain a FINITE gradient
# (scaled 1.6e28, unscaled ~2.4e23, float32 max 3.4e38) whose square overflows float32, so
# the L2 norm is inf while GradScaler finds nothing to report.
G_HUGE = 1e24
FP16_KINDS = ("normal", "inf", "normal", "huge", "normal")  # the windows, in order


class Units(nn.Module):
    """The loss sum of a Linear of FP16_UNITS outputs (its input needs no gradient, so an
    fp16 overflow in one unit's output gradient stays in that unit's weight row and bias
    entry) plus a float32 term ``sum(gain * g)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.lin = nn.Linear(4, FP16_UNITS)
        self.gain = nn.Parameter(torch.zeros(FP16_UNITS))

    def forward(self, mb: Batch) -> torch.Tensor:
        out = self.lin(mb["x"])  # fp16 under autocast; the products promote to float32
        return (out * mb["w"]).sum() + (self.gain * mb["g"]).sum()


def weighted_loss(model: nn.Module, mb: Batch) -> Any:
    import gradstep

    return gradstep.LossSum(model(mb), mb["x"].shape[0])


def fp16_window(rank: int, step: int, kind: str) -> list[Batch]:
    """Two micro-batches of this rank. Only rank 0's first micro-batch differs from normal:
    "inf" weights HOT_UNIT hugely (an fp16 overflow), "huge" sets g of HOT_UNIT to G_HUGE
    (a float32 gradient too large for its squared norm)."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    window = []
    for j in range(2):
        w = torch.full((FP16_ROWS, FP16_UNITS), W_NORMAL)
        g = torch.zeros(FP16_ROWS, FP16_UNITS)
        if rank == 0 and j == 0 and kind == "inf":
            w[:, HOT_UNIT] = W_HOT
        if rank == 0 and j == 0 and kind == "huge":
            g[0, HOT_UNIT] = G_HUGE
        window.append({"x": 0.1 * torch.randn(FP16_ROWS, 4, generator=gen), "w": w, "g": g})
    return window


class _LastGradFinite:
    """After the last backward of a window: is this rank's local gradient shard finite?"""

    def __init__(self) -> None:
        self.finite: dict[str, bool] = {}

    def on_micro_batch_end(self, stepper: Any, index: int, is_last: bool, loss: Any) -> None:
        if is_last:
            self.finite = {
                _name(n): bool(torch.isfinite(_local(p.grad)).all())
                for n, p in stepper.model.named_parameters()
                if p.grad is not None
            }


def fp16_overflow_run(rank: int, strategy: str) -> dict[str, Any]:
    """The FP16_KINDS windows: an fp16 overflow in rank 0's data only (under FSDP2 the inf
    lands in rank 1's shard only) and a finite gradient whose norm overflows (rank 0's data
    only), each followed by a normal window."""
    import gradstep
    import gradstep.parallel as gd

    model = gd.prepare_model(Units(), strategy, precision="fp16")
    opt = adamw(model.parameters())
    probe = _LastGradFinite()
    stepper = gradstep.Stepper(model, opt, clip=gradstep.ClipNorm(1.0), precision="fp16",
                               hooks=[probe])  # fmt: skip
    out: dict[str, Any] = {"initial_scale": stepper.loss_scale, "steps": []}
    for step, kind in enumerate(FP16_KINDS):
        params = [_local(p) for p in model.parameters()]
        state = [_local(v) for s in opt.state.values() for v in s.values()]
        spy = CollectiveSpy()
        try:
            stats = stepper.step(fp16_window(rank, step, kind), weighted_loss)
        finally:
            spy.remove()
        now_state = [_local(v) for s in opt.state.values() for v in s.values()]
        out["steps"].append(
            {
                "kind": kind,
                "stats": stats,
                "scale": stepper.loss_scale,
                "step_count": stepper.step_count,
                "finite_shard": dict(probe.finite),
                "same_params": all(
                    torch.equal(a, _local(p))
                    for a, p in zip(params, model.parameters(), strict=True)
                ),
                "same_state": len(state) == len(now_state)
                and all(torch.equal(a, b) for a, b in zip(state, now_state, strict=True)),
                "collectives": spy.calls,
            }
        )
    return out


# ------------------------------------------------------------------------ bf16 FSDP2


class _MicroBatchGradSum:
    """``on_param_grad``: the float64 sum over this window's micro-batches of each
    parameter's own micro-batch gradient, exactly as the backend computed it (bf16 under
    ``param_dtype=bf16``), before it is accumulated or reduced."""

    def __init__(self) -> None:
        self.total: dict[str, torch.Tensor] = {}
        self.dtypes: set[torch.dtype] = set()

    def on_param_grad(self, stepper: Any, index: int, name: str, param: Any, grad: Any) -> None:
        self.dtypes.add(grad.dtype)
        g = grad.detach().to(torch.float64)
        key = _name(name)
        self.total[key] = self.total[key] + g if key in self.total else g.clone()


def bf16_accumulation_run(rank: int, reduce_dtype: torch.dtype | None) -> dict[str, Any]:
    """One FSDP2 bf16 step of K_BF16 micro-batches per rank. ``reduce_dtype`` None: the
    model is prepared by ``prepare_model(..., precision="bf16")`` (gradstep's policy);
    otherwise by ``fully_shard`` with ``MixedPrecisionPolicy(bf16, reduce_dtype)``, built
    here: the bf16-reduce twin that shows the case can tell the two apart."""
    import gradstep
    import gradstep.parallel as gd

    model = tiny_gpt()
    if reduce_dtype is None:
        model = gd.prepare_model(model, "fsdp", precision="bf16")
    else:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        for block in gd.find_blocks(model):
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    seen = _MicroBatchGradSum()
    stepper = gradstep.Stepper(model, adamw(model.parameters()), clip=None, precision="bf16",
                               hooks=[seen])  # fmt: skip
    data = make_windows(1, 2, K_BF16, seed=SEED_BF16)[0][rank]
    stats = stepper.step(data, lm_loss)
    return {
        "stats": stats,
        "grads": {_name(n): _full(p.grad) for n, p in model.named_parameters()},
        "micro_batch_sum": seen.total,
        "micro_batch_dtypes": seen.dtypes,
    }


# -------------------------------------------------------------------- L2 norm, FSDP2


def norm_data() -> list:
    return make_windows(1, 2, K, seed=SEED_NORM)


def l2_norm_run(rank: int) -> dict[str, Any]:
    """One float64 FSDP2 step (no clip): the reported L2 norm, this rank's shard norm,
    and what the step's global norm (:func:`gradstep.step.norm.global_norm`) returns on
    this rank's gradient shards (normalised by then: the step scales them before the
    optimizer step)."""
    from torch.distributed.tensor import DTensor

    import gradstep
    import gradstep.parallel as gd

    model = gd.prepare_model(tiny_gpt(torch.float64), "fsdp")
    stepper = gradstep.Stepper(model, adamw(model.parameters()), clip=None)
    stats = stepper.step(norm_data()[0][rank], lm_loss)
    shards = [_local(p.grad) for p in model.parameters()]  # normalised: no clip
    from gradstep.step.norm import global_norm

    grads = [p.grad for p in model.parameters()]
    direct = global_norm(stepper.strategy, stepper.capabilities, grads, 2.0)
    return {
        "grad_norm": stats.grad_norm,
        "shard_norm": float(torch.linalg.vector_norm(torch.cat([s.flatten() for s in shards]))),
        "shard_numel": sum(s.numel() for s in shards),
        "direct": float(direct),
        "direct_is_dtensor": isinstance(direct, DTensor),
    }


# ---------------------------------------------------------------------- sync flag


def sync_flags(model: nn.Module, strategy: str) -> list[bool]:
    """Whether each FSDP2 parameter group (DDP: the model) will reduce the next backward.

    FSDP2 exposes only the setter (``set_requires_gradient_sync``), no getter, in torch
    2.13: the flag is read from the private field the setter writes,
    ``module._get_fsdp_state()._fsdp_param_groups[i].reduce_grads``. DDP: the attribute
    ``no_sync`` toggles, ``require_backward_grad_sync``.
    """
    if strategy == "ddp":
        return [bool(model.require_backward_grad_sync)]
    from torch.distributed.fsdp import FSDPModule

    flags = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:
                group = state._fsdp_param_group
                groups = [] if group is None else [group]
            flags += [bool(g.reduce_grads) for g in groups]
    return flags


def sync_run(rank: int, strategy: str) -> dict[str, Any]:
    """Two float64 windows of K micro-batches (no clip), then a window whose second
    micro-batch raises. After each: the backend's gradient collectives, the sync flags,
    the parameters left without a gradient."""
    import gradstep
    import gradstep.parallel as gd
    from gradstep.parallel.instrumentation import count_gradient_comms

    model = gd.prepare_model(tiny_gpt(torch.float64), strategy)
    counter = count_gradient_comms(model)
    stepper = gradstep.Stepper(model, adamw(model.parameters()), clip=None)
    data = make_windows(3, 2, K, seed=12)
    out: dict[str, Any] = {"before": sync_flags(model, strategy), "steps": []}
    for window in data[:2]:
        counter.reset()
        stepper.step(window[rank], lm_loss)
        out["steps"].append(
            {
                "comm_calls": counter.calls,
                "comm_bytes": counter.bytes,
                "flags": sync_flags(model, strategy),
                "no_grad": [_name(n) for n, p in model.named_parameters() if p.grad is None],
            }
        )
    fails_second = failing_loss(2)
    try:
        stepper.step(data[2][rank], fails_second)
        out["error"] = None
    except RuntimeError as exc:
        out["error"] = str(exc)
    out["after_error"] = sync_flags(model, strategy)
    return out


# ------------------------------------------------------------ refused layouts (C12)


def _refusal(make: Callable[[], Any]) -> dict[str, Any]:
    import gradstep

    try:
        make()
    except Exception as exc:
        return {
            "type": type(exc).__name__,
            "unsupported": isinstance(exc, gradstep.UnsupportedSetup),
            "not_implemented": isinstance(exc, NotImplementedError),
            "message": str(exc),
        }
    return {"type": None, "unsupported": False, "not_implemented": False, "message": ""}


def refused_layouts_run(rank: int, strategy: str) -> dict[str, Any]:
    """Layouts that are not data parallel over the whole world must be refused by name:
    DDP over a per-rank subgroup (the other ranks would be tensor/pipeline peers), a
    strategy given such a group, and FSDP2 over the "dp" dimension of a (dp=1, tp=2) mesh.
    """
    import torch.distributed as dist

    import gradstep

    out = {}
    world = dist.get_world_size()
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # new_group is collective: every rank creates every group, in the same order.
        groups = [dist.new_group([r]) for r in range(world)]
        mine = groups[rank]
        ddp = DistributedDataParallel(tiny_gpt(), process_group=mine)
        out["ddp_subgroup"] = _refusal(lambda: gradstep.Stepper(ddp, adamw(ddp.parameters())))
        out["dp_group"] = _refusal(lambda: gradstep.parallel.ProcessGroupStrategy(mine))
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
        model = tiny_gpt()
        fully_shard(model, mesh=mesh["dp"])
        out["fsdp_dp_of_2d_mesh"] = _refusal(
            lambda: gradstep.Stepper(model, adamw(model.parameters()))
        )
    return out


# ------------------------------------------------------------ DDP with buffers (C14)


class Buffered(nn.Module):
    """The tiny GPT plus a registered buffer (as BatchNorm statistics would be): DDP's
    forward then broadcasts buffers from rank 0, so its forward communicates. Counts its
    forward passes."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = tiny_gpt()
        self.register_buffer("temperature", torch.ones(()))
        self.forwards = 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        return self.gpt(ids) / self.temperature


def ddp_buffers_run(rank: int) -> dict[str, Any]:
    """Last in its start (a hang would leave the group unusable): a window of equal lengths
    steps normally; then rank 1 passes one micro-batch more."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import gradstep
    import gradstep.parallel as gd

    with warnings.catch_warnings():  # torch 2.13 deprecates it for forward_sync_buffers
        warnings.simplefilter("ignore", FutureWarning)
        plain = DistributedDataParallel(Buffered(), broadcast_buffers=False)
    no_buffers = gd.prepare_model(tiny_gpt(), "ddp")
    model = gd.prepare_model(Buffered(), "ddp")
    stepper = gradstep.Stepper(model, adamw(model.parameters()))
    out: dict[str, Any] = {
        "forward_communicates": stepper.strategy.forward_communicates,
        "without": {
            "broadcast_buffers=False": gd.DDPStrategy(plain).forward_communicates,
            "no buffers": gd.DDPStrategy(no_buffers).forward_communicates,
        },
    }
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        quiet = DistributedDataParallel(Buffered(), forward_sync_buffers=False)
        out["without"]["forward_sync_buffers=False"] = gd.DDPStrategy(quiet).forward_communicates
    data = make_windows(2, 2, K + 1, seed=13)
    even = stepper.step(data[0][rank][:K], lm_loss)
    out["even"] = {"skipped": even.skipped, "step_count": stepper.step_count}
    model.module.forwards = 0
    try:
        stepper.step(data[1][rank][: K + rank], lm_loss)
        out["error"] = None
    except RuntimeError as exc:
        out["error"] = str(exc)
    out["forwards"] = model.module.forwards
    probe = torch.ones(1)
    dist.all_reduce(probe)  # the group still works afterwards
    out["probe"] = float(probe)
    return out


# ---------------------------------------------------------------------- entry point


def _guarded(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except BaseException:
        return {"failed": traceback.format_exc()}


def invariant_scenarios(rank: int, world: int, strategy: str) -> dict[str, Any]:
    out = {
        "fp16": _guarded(fp16_overflow_run, rank, strategy),
        "sync": _guarded(sync_run, rank, strategy),
        "refused": _guarded(refused_layouts_run, rank, strategy),
    }
    if strategy == "fsdp":
        out["bf16"] = _guarded(bf16_accumulation_run, rank, None)
        out["bf16_twin"] = _guarded(bf16_accumulation_run, rank, torch.bfloat16)
        out["l2"] = _guarded(l2_norm_run, rank)
    else:
        out["buffers"] = _guarded(ddp_buffers_run, rank)  # last: see its docstring
    return out
