"""Real multi-process runs for tests/test_distributed.py (and bench/distributed.py).

``run_ranks`` spawns ``world`` processes that each join a gloo process group through
gradstep.parallel.init() (the same env:// variables torchrun sets) and run one function;
each rank's return value comes back to the caller. Spawning costs seconds on a 2-core
machine, so one spawn runs every scenario of a strategy and the tests only inspect results.

``reference_run`` is the plain single-process computation the distributed runs must match:
all micro-batches of every rank of a step concatenated into ONE batch, in float64, mean
loss over all its tokens, ``clip_grad_norm_``, AdamW.
"""

from __future__ import annotations

import math
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

from gradstep import token_loss
from gradstep_demo.data import IGNORE_INDEX, PAD_ID
from gradstep_demo.model import GPT, GPTConfig

Batch = dict[str, torch.Tensor]
VOCAB = 32
MODEL = GPTConfig(vocab_size=VOCAB, n_layer=2, n_head=2, d_model=16, max_seq_len=16)
LR = 1e-2
WEIGHT_DECAY = 0.1


def tiny_gpt(dtype: torch.dtype = torch.float32) -> GPT:
    """The same initial weights in every process (fixed seed, CPU)."""
    torch.manual_seed(1234)
    return GPT(MODEL).to(dtype)


def adamw(params: Any) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def _micro_batch(gen: torch.Generator, rows: int, lo: int, hi: int) -> Batch:
    """Right-padded rows of random lengths in [lo, hi]: labels -100 past each row's end."""
    lengths = torch.randint(lo, hi + 1, (rows,), generator=gen)
    width = int(lengths.max())
    ids = torch.randint(1, VOCAB, (rows, width + 1), generator=gen)
    input_ids = torch.full((rows, width), PAD_ID, dtype=torch.long)
    labels = torch.full((rows, width), IGNORE_INDEX, dtype=torch.long)
    for r, n in enumerate(lengths.tolist()):
        input_ids[r, :n] = ids[r, :n]
        labels[r, :n] = ids[r, 1 : n + 1]
    return {"input_ids": input_ids, "labels": labels}


def make_windows(steps: int, world: int, k: int, seed: int = 0) -> list[list[list[Batch]]]:
    """``data[step][rank]`` = that rank's k micro-batches; rank r gets longer sequences
    than rank r-1, so the ranks' token counts differ (rank 0 ~3 tokens/row, rank 1 ~9)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        per_rank = []
        for r in range(world):
            lo, hi = (2, 4) if r == 0 else (6, MODEL.max_seq_len - 1)
            per_rank.append([_micro_batch(gen, 2 + (j + r) % 2, lo, hi) for j in range(k)])
        out.append(per_rank)
    return out


def concat(batches: list[Batch]) -> Batch:
    """One batch of all rows, right-padded to the widest (padding is ignored by the loss)."""
    width = max(b["input_ids"].shape[1] for b in batches)

    def pad(t: torch.Tensor, value: int) -> torch.Tensor:
        return nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    return {
        "input_ids": torch.cat([pad(b["input_ids"], PAD_ID) for b in batches]),
        "labels": torch.cat([pad(b["labels"], IGNORE_INDEX) for b in batches]),
    }


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
        logits = model(batch["input_ids"])
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), batch["labels"].reshape(-1), ignore_index=IGNORE_INDEX
        )
        opt.zero_grad()
        loss.backward()
        params = list(model.parameters())
        norm = float(torch.nn.utils.get_total_norm([p.grad for p in params], norm_type))
        coef = 1.0
        if max_norm is not None:
            coef = min(1.0, max_norm / (norm + 1e-6))
            torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        out.append(
            {
                "grads": grads,
                "grad_norm": norm,
                "clip_coef": coef,
                "loss": loss.item(),
                "items": int((batch["labels"] != IGNORE_INDEX).sum()),
                "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            }
        )
    return out


def single_backward_reference(seed: int) -> dict[str, torch.Tensor]:
    """What ``raising_window_run``'s last backward must give (float64, one process): the
    ranks' mean-token-loss gradients of their first micro-batch, averaged over ranks."""
    model = tiny_gpt(torch.float64)
    first = [rank[0] for rank in make_windows(1, 2, 3, seed=seed)[0]]
    grads: dict[str, torch.Tensor] = {}
    for mb in first:
        model.zero_grad()
        total, count = token_loss(model(mb["input_ids"]), mb["labels"])
        (total / count).backward()
        for n, p in model.named_parameters():
            grads[n] = grads.get(n, 0) + p.grad / len(first)
    return grads


def rel_err(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Largest per-tensor relative error ||got - want|| / ||want||, in float64."""
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    errs = []
    for name, w in want.items():
        g = got[name].to(torch.float64)
        w = w.to(torch.float64)
        errs.append(float((g - w).norm() / w.norm().clamp_min(1e-30)))
    return max(errs)


def flat(tensors: dict[str, torch.Tensor], minus: dict[str, torch.Tensor] | None = None):
    """All tensors as one float64 vector (optionally minus another set, e.g. the init)."""
    parts = [t.to(torch.float64).flatten() for t in tensors.values()]
    if minus is not None:
        parts = [
            p - minus[n].to(torch.float64).flatten() for p, n in zip(parts, tensors, strict=True)
        ]
    return torch.cat(parts)


def global_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| over whole vectors (see :func:`flat`)."""
    return float((got - want).norm() / want.norm())


# Imported once by the forkserver; every rank is then forked from it already warm (a
# spawned rank re-imports torch: ~4-8 s per process on the 2-core CI machine). The server
# itself is a fresh interpreter that never ran torch compute, so forking it is safe.
_PRELOAD = [
    "torch",
    "torch._dynamo",  # DDP.__init__ imports it: ~4 s
    "torch.distributed",
    "torch.distributed.algorithms.ddp_comm_hooks.default_hooks",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.nn.parallel",
    "gradstep",
    "gradstep.parallel",
    "distributed_helpers",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(
    local: int,
    fn: Callable[..., Any],
    world: int,
    port: int,
    out: str,
    collective_timeout_s: float,
    args: tuple,
) -> None:
    # The variables torchrun sets; gradstep.parallel.init() reads them.
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(local),
        LOCAL_RANK=str(local),
        WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    import gradstep.parallel as gd

    gd.init(device="cpu", timeout_s=collective_timeout_s)
    try:
        result: Any = fn(local, world, *args)
    except BaseException:
        result = {"error": traceback.format_exc()}
    torch.save(result, Path(out, f"rank{local}.pt"))
    gd.shutdown()


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 120,
    collective_timeout_s: float = 60,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo ranks; return their results.

    A rank that raises reports the traceback (raised here). A collective that waits longer
    than ``collective_timeout_s`` raises in its rank (gloo's timeout); ranks still running
    after ``timeout`` seconds are killed and reported as a hang.
    """
    mp.set_forkserver_preload(_PRELOAD)  # no effect once the server runs
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(
            _rank_main,
            args=(fn, world, free_port(), out, collective_timeout_s, args),
            nprocs=world,
            join=False,
            start_method="forkserver",
        )
        failure = _wait(ctx, timeout)
        files = [Path(out, f"rank{r}.pt") for r in range(world)]
        results = [torch.load(f, weights_only=False) if f.exists() else None for f in files]
    # A rank's own traceback is the root cause; a peer's exit error is only its echo.
    for r, res in enumerate(results):
        if isinstance(res, dict) and "error" in res:
            raise RuntimeError(f"rank {r} failed:\n{res['error']}")
    if failure is not None:
        raise RuntimeError(failure)
    return results


def _wait(ctx: Any, timeout: float) -> str | None:
    """Join the ranks; kill them all after ``timeout`` seconds. Returns a failure or None."""
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                return f"ranks still running after {timeout:.0f}s: a hang"
    except Exception as exc:  # a rank died; torch terminates the others
        return f"a rank exited abnormally: {exc}"
    return None


# ---------------------------------------------------------------- rank-side scenarios


def _loss(model: nn.Module, mb: Batch) -> Any:
    from gradstep import token_loss

    return token_loss(model(mb["input_ids"]), mb["labels"])


def _name(n: str) -> str:
    return n.removeprefix("module.")


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (an FSDP2 DTensor shard is all-gathered)."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


class _AllReduceSpy:
    """Records (numel, dtype) of every torch.distributed.all_reduce while installed."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.calls: list[tuple[int, torch.dtype]] = []
        self._orig = dist.all_reduce

        def spy(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.calls.append((tensor.numel(), tensor.dtype))
            return self._orig(tensor, *args, **kwargs)

        dist.all_reduce = spy

    def remove(self) -> None:
        import torch.distributed as dist

        dist.all_reduce = self._orig


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
    the full gradients after the step, gradient collectives and 5-scalar all-reduces."""
    model, _, stepper, counter = _setup(
        strategy, max_norm, sync_each, dtype, precision, norm_type, value
    )
    per_step = []
    for step in range(steps):
        counter.reset()
        spy = _AllReduceSpy()
        try:
            stats = stepper.step(data[step][rank], _loss)
        finally:
            spy.remove()
        per_step.append(
            {
                "stats": stats,
                "grads": {_name(n): _full(p.grad) for n, p in model.named_parameters()},
                "comm_calls": counter.calls,
                "comm_bytes": counter.bytes,
                "totals_all_reduces": spy.calls.count((5, torch.float64)),
                "grad_dtypes": {_local(p.grad).dtype for p in model.parameters()},
            }
        )
    params = {_name(n): _full(p) for n, p in model.named_parameters()}
    return {"steps": per_step, "params": params}


def nan_run(rank: int, data: list, strategy: str, max_norm: float) -> dict[str, Any]:
    """One good step, then a window whose first micro-batch is NaN on rank 1 only."""
    from gradstep import LossSum

    model, opt, stepper, _ = _setup(strategy, max_norm, False)
    stepper.step(data[0][rank], _loss)
    params = [_local(p) for p in model.parameters()]
    state = [_local(v) for s in opt.state.values() for v in s.values()]
    calls = []

    def poisoned(model: nn.Module, mb: Batch) -> LossSum:
        total, count = _loss(model, mb)
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
        stepper.step(data[0][rank][: k + rank], _loss)
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
    calls = []

    def fails_second(m: nn.Module, mb: Batch) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("micro-batch 2 failed")
        return _loss(m, mb)

    try:
        stepper.step(data, fails_second)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    total, count = _loss(model, data[0])
    (total / count).backward()
    has_grad = all(p.grad is not None for p in model.parameters())
    grads = {_name(n): _full(p.grad) for n, p in model.named_parameters()} if has_grad else {}
    return {"error": error, "has_grad": has_grad, "grads": grads}


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
    """Everything tests/test_distributed.py checks for one strategy, in one spawn."""
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
    }


def uneven_scenarios(rank: int, world: int) -> dict[str, Any]:
    return {strategy: uneven_run(rank, strategy, K) for strategy in ("ddp", "fsdp")}
