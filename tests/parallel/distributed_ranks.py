"""The rank-side scenarios of tests/parallel/test_distributed.py, and their references.

``scenarios`` runs on each of 2 gloo ranks (``tests.support.multiproc.run_ranks``) every
case the tests check for one strategy, in one start; the tests only inspect the results.

``reference_run`` is the plain single-process computation the distributed runs must match:
all micro-batches of every rank of a step concatenated into ONE batch, in float64, mean
loss over all its tokens, ``clip_grad_norm_``, AdamW (``tests.support.reference``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tests.support.batches import Batch, concat, make_windows
from tests.support.models import tiny_gpt
from tests.support.reference import failing_loss, lm_loss, reference_step

LR = 1e-2
WEIGHT_DECAY = 0.1


def adamw(params: Any) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def reference_run(
    data: list[list[list[Batch]]],
    max_norm: float | None,
    steps: int,
    dtype: torch.dtype = torch.float64,
    norm_type: float = 2.0,
) -> list[dict[str, Any]]:
    """The plain full-batch step, ``steps`` times; per step: grads (post-clip), pre-clip
    norm, clip coefficient, mean loss, token count, parameters after the step."""
    model = tiny_gpt(dtype)
    opt = adamw(model.parameters())
    out = []
    for step in range(steps):
        batch = concat([mb for rank in data[step] for mb in rank])
        result = reference_step(model, batch, opt, max_norm, norm_type)
        result["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        out.append(result)
    return out


def single_backward_reference(seed: int) -> dict[str, torch.Tensor]:
    """What ``raising_window_run``'s last backward must give (float64, one process): the
    ranks' mean-token-loss gradients of their first micro-batch, averaged over ranks."""
    model = tiny_gpt(torch.float64)
    first = [rank[0] for rank in make_windows(1, 2, 3, seed=seed)[0]]
    grads: dict[str, torch.Tensor] = {}
    for mb in first:
        model.zero_grad()
        total, count = lm_loss(model, mb)
        (total / count).backward()
        for n, p in model.named_parameters():
            grads[n] = grads.get(n, 0) + p.grad / len(first)
    return grads


# ---------------------------------------------------------------- rank-side scenarios


def _name(n: str) -> str:
    return n.removeprefix("module.")


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (an FSDP2 DTensor shard is all-gathered)."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


# Every torch.distributed collective a step could issue from Python (DDP's comm hook,
# FSDP2's all-gathers and reduce-scatters and gradstep all call them as ``dist.<name>``),
# and the functional collectives DTensor reduces with (the FSDP2 norm), ``funcol.<name>``.
_COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "all_gather_object", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "all_to_all", "all_to_all_single", "gather", "scatter",
    "gather_object", "scatter_object_list", "broadcast_object_list", "barrier",
    "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
)  # fmt: skip
_FUNCOL = (
    "all_reduce", "all_gather_tensor", "all_gather_single", "reduce_scatter_tensor",
    "reduce_scatter_single", "all_to_all_single", "broadcast", "all_reduce_coalesced",
)  # fmt: skip


class CollectiveSpy:
    """Records every ``torch.distributed`` collective called while installed, as
    ``(name, numel, dtype, caller_module)``: numel and dtype of the first tensor argument
    (0 and None without one), and the module that called it, which tells the backend's
    gradient collectives (DDP's comm hook, FSDP2's internals, the counting reduce-scatter
    of ``gradstep.parallel.instrumentation``) from gradstep's own small ones."""

    def __init__(self) -> None:
        import sys

        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        self.calls: list[tuple[str, int, torch.dtype | None, str]] = []
        self._orig = [(dist, n, getattr(dist, n)) for n in _COLLECTIVES if hasattr(dist, n)]
        self._orig += [(funcol, n, getattr(funcol, n)) for n in _FUNCOL if hasattr(funcol, n)]

        def wrap(name: str, fn: Any) -> Any:
            def spy(*args: Any, **kwargs: Any) -> Any:
                first = next((a for a in args if isinstance(a, torch.Tensor)), None)
                caller = sys._getframe(1).f_globals.get("__name__", "?")
                numel, dtype = (0, None) if first is None else (first.numel(), first.dtype)
                self.calls.append((name, numel, dtype, caller))
                return fn(*args, **kwargs)

            return spy

        for module, name, fn in self._orig:
            label = name if module is dist else f"funcol.{name}"
            setattr(module, name, wrap(label, fn))

    def remove(self) -> None:
        for module, name, fn in self._orig:
            setattr(module, name, fn)


# The Stepper's one all-reduce of the window: loss sum, items, negative counts, count
# mismatches, n, n^2, mixed aux names, and the aux names' fingerprint (6 numbers); under
# FSDP2 (finite norm types) one more, this rank's gradient norm**p.
WINDOW_NUMBERS = 13
WINDOW_AND_NORM = WINDOW_NUMBERS + 1
_TOTALS = {("all_reduce", n, torch.float64) for n in (WINDOW_NUMBERS, WINDOW_AND_NORM)}


def _is_backend(caller: str) -> bool:
    """A collective issued by DDP's or FSDP2's own gradient machinery."""
    return caller.startswith(
        (
            "torch.distributed.algorithms.ddp_comm_hooks",
            "torch.distributed.fsdp",
            "gradstep.parallel.instrumentation",
        )
    )


def split_collectives(calls: list[tuple]) -> tuple[list[tuple], list[tuple]]:
    """(the backend's gradient collectives, every other collective) of a spy's calls."""
    backend = [c for c in calls if _is_backend(c[3])]
    return backend, [c for c in calls if not _is_backend(c[3])]


def _setup(
    strategy: str,
    max_norm: float | None,
    sync_each: bool = False,
    dtype: torch.dtype = torch.float32,
    precision: str = "fp32",
    norm_type: float = 2.0,
    value: float | None = None,
) -> tuple:
    import gradstep
    import gradstep.parallel as gd
    from gradstep.parallel.instrumentation import count_gradient_comms

    model = gd.prepare_model(tiny_gpt(dtype), strategy, precision=precision)
    counter = count_gradient_comms(model)
    opt = adamw(model.parameters())
    clip = gradstep.ClipNorm(max_norm, norm_type) if max_norm is not None else None
    if value is not None:
        clip = gradstep.ClipValue(value)
    stepper = gradstep.Stepper(
        model, opt, clip=clip, precision=precision, sync_each_micro_batch=sync_each
    )
    return model, opt, stepper, counter


def parity_run(
    rank: int,
    data: list,
    strategy: str,
    steps: int,
    max_norm: float | None,
    sync_each: bool,
    dtype: torch.dtype,
    precision: str = "fp32",
    norm_type: float = 2.0,
    value: float | None = None,
) -> dict[str, Any]:
    """``steps`` optimizer steps on this rank's share of ``data``; per step the stats,
    the full gradients after the step, gradient collectives and the window's all-reduces."""
    model, _, stepper, counter = _setup(
        strategy, max_norm, sync_each, dtype, precision, norm_type, value
    )
    per_step = []
    for step in range(steps):
        counter.reset()
        spy = CollectiveSpy()
        try:
            stats = stepper.step(data[step][rank], lm_loss)
        finally:
            spy.remove()
        per_step.append(
            {
                "stats": stats,
                "grads": {_name(n): _full(p.grad) for n, p in model.named_parameters()},
                "comm_calls": counter.calls,
                "comm_bytes": counter.bytes,
                "totals_all_reduces": sum(c[:3] in _TOTALS for c in spy.calls),
                "collectives": spy.calls,
                "grad_dtypes": {_local(p.grad).dtype for p in model.parameters()},
            }
        )
    params = {_name(n): _full(p) for n, p in model.named_parameters()}
    return {"steps": per_step, "params": params}


def nan_run(rank: int, data: list, strategy: str, max_norm: float) -> dict[str, Any]:
    """One good step, then a window whose first micro-batch is NaN on rank 1 only."""
    from gradstep import LossSum

    model, opt, stepper, _ = _setup(strategy, max_norm, False)
    stepper.step(data[0][rank], lm_loss)
    params = [_local(p) for p in model.parameters()]
    state = [_local(v) for s in opt.state.values() for v in s.values()]
    calls = []

    def poisoned(model: nn.Module, mb: Batch) -> LossSum:
        total, count = lm_loss(model, mb)
        calls.append(1)
        if rank == 1 and len(calls) == 1:
            total = total * float("nan")
        return LossSum(total, count)

    stats = stepper.step(data[1][rank], poisoned)
    same_params = all(
        torch.equal(a, _local(p)) for a, p in zip(params, model.parameters(), strict=True)
    )
    now = [_local(v) for s in opt.state.values() for v in s.values()]
    same_state = len(now) == len(state) and all(
        torch.equal(a, b) for a, b in zip(state, now, strict=True)
    )
    return {
        "stats": stats,
        "same_params": same_params,
        "same_state": same_state,
        "step_count": stepper.step_count,
        "grads_cleared": all(p.grad is None for p in model.parameters()),
    }


def uneven_run(rank: int, strategy: str, k: int) -> dict[str, Any]:
    """Rank 0 passes k micro-batches, rank 1 passes k + 1: both must raise, none hang."""
    import torch.distributed as dist

    data = make_windows(1, 2, k + 1)
    _, _, stepper, _ = _setup(strategy, None)
    try:
        stepper.step(data[0][rank][: k + rank], lm_loss)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    # The group must still work afterwards (no half-finished collective left behind).
    probe = torch.ones(1)
    dist.all_reduce(probe)
    return {"error": error, "probe": float(probe)}


def raising_window_run(rank: int, strategy: str) -> dict[str, Any]:
    """A window whose second (not last) micro-batch raises, then the user's own backward.

    That backward must synchronise as usual: the strategy restored the sync flag it turned
    off for the failed micro-batch. Returned: whether every parameter got a gradient, and
    the full gradients (equal on both ranks when they were reduced).
    """
    data = make_windows(1, 2, 3, seed=4)[0][rank]
    model, _, stepper, _ = _setup(strategy, None, dtype=torch.float64)
    fails_second = failing_loss(2)
    try:
        stepper.step(data, fails_second)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    total, count = lm_loss(model, data[0])
    (total / count).backward()
    has_grad = all(p.grad is not None for p in model.parameters())
    grads = {_name(n): _full(p.grad) for n, p in model.named_parameters()} if has_grad else {}
    return {"error": error, "has_grad": has_grad, "grads": grads}


class _SquaredNorms:
    """A hook recording, per micro-batch, each parameter's squared gradient norm."""

    def __init__(self) -> None:
        self.seen: dict[int, dict[str, float]] = {}

    def on_param_grad(self, stepper: Any, index: int, name: str, param: Any, grad: Any) -> None:
        self.seen.setdefault(index, {})[_name(name)] = float(grad.double().square().sum())


def param_grad_run(rank: int, strategy: str, sync_each: bool) -> dict[int, dict[str, float]]:
    """Two windows (the first all-gathers FSDP2's unsharded parameters for the first time)
    with a hook that observes every micro-batch's own gradient."""
    import gradstep

    data = make_windows(2, 2, K, seed=5)
    model, opt, _, _ = _setup(strategy, None, dtype=torch.float64)
    hook = _SquaredNorms()
    stepper = gradstep.Stepper(model, opt, clip=None, hooks=[hook], sync_each_micro_batch=sync_each)
    seen = []
    for window in data:
        stepper.step(window[rank], lm_loss)
        seen.append(hook.seen)
        hook.seen = {}
    return seen


def param_grad_reference(rank: int) -> list[dict[int, dict[str, float]]]:
    """One process: the same two AdamW steps; each micro-batch's own gradient of its loss
    sum, as the hook must see it on ``rank``."""
    import gradstep

    data = make_windows(2, 2, K, seed=5)
    model = tiny_gpt(torch.float64)
    opt = adamw(model.parameters())
    seen = []
    for window in data:
        per_mb = {}
        for i, mb in enumerate(window[rank]):
            model.zero_grad()
            lm_loss(model, mb).total.backward()
            per_mb[i] = {n: float(p.grad.square().sum()) for n, p in model.named_parameters()}
        seen.append(per_mb)
        # The update both ranks take: the full-batch mean over both ranks' micro-batches.
        stepper = gradstep.Stepper(model, opt, clip=None)
        stepper.step([mb for r in window for mb in r], lm_loss)
    return seen


K = 3  # micro-batches per rank in the float64 runs
K_FP32 = 5  # ... and in the float32 run: the communication counts must not depend on k
STEPS = 3
MAX_NORM = 0.5  # below every step's norm (0.54 - 0.60): the clip acts on every step
MAX_NORM_INF = 0.05  # below the first step's largest |gradient| (0.098, in embed.weight)
CLIP_VALUE = 0.05  # below the largest gradient entries of the first step, above most


def data_fp64() -> list:
    return make_windows(STEPS, 2, K, seed=0)


def data_fp32() -> list:
    return make_windows(STEPS, 2, K_FP32, seed=1)


def env_run(rank: int) -> dict[str, Any]:
    """What gradstep.parallel reports inside a torchrun-style launch."""
    import gradstep.parallel as gd

    env = gd.init()  # the group exists: describes it
    return {
        "env": (env.rank, env.world_size, env.local_rank, env.backend, env.is_main),
        "helpers": (gd.rank(), gd.world_size(), gd.is_main()),
        "min_over_ranks": gd.min_over_ranks(5 + 3 * rank),
    }


def scenarios(rank: int, world: int, strategy: str) -> dict[str, Any]:
    """Everything tests/parallel/test_distributed.py checks for one strategy, in one start."""
    d64, d32 = data_fp64(), data_fp32()
    return {
        "env": env_run(rank),
        "fp64": parity_run(rank, d64, strategy, STEPS, MAX_NORM, False, torch.float64),
        "fp32": parity_run(rank, d32, strategy, STEPS, MAX_NORM, False, torch.float32),
        "sync_each": parity_run(rank, d64, strategy, 1, MAX_NORM, True, torch.float64),
        "bf16": parity_run(rank, d64, strategy, 1, MAX_NORM, False, torch.float32, "bf16"),
        "inf": parity_run(
            rank, d64, strategy, 1, MAX_NORM_INF, False, torch.float64, norm_type=math.inf
        ),
        "nan": nan_run(rank, d64, strategy, MAX_NORM),
        "value": parity_run(rank, d64, strategy, 1, None, False, torch.float64, value=CLIP_VALUE),
        "raising": raising_window_run(rank, strategy),
        "param_grad": param_grad_run(rank, strategy, False),
        "param_grad_sync_each": param_grad_run(rank, strategy, True),
    }


def uneven_scenarios(rank: int, world: int) -> dict[str, Any]:
    return {strategy: uneven_run(rank, strategy, K) for strategy in ("ddp", "fsdp")}
