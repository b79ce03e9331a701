"""Real multi-process runs: ``run_ranks`` starts ``world`` local ranks that each join a gloo
process group through gradstep.parallel.init() (the env:// variables torchrun sets) and run
one function; each rank's return value comes back to the caller (through ``torch.save``).

Used by the distributed, elastic-checkpoint and FSDP2-policy tests and by
bench/distributed.py; the GPU suite (tests/gpu/test_cuda_smoke.py) spawns its NCCL ranks
itself and shares ``free_port`` and ``join_or_kill``. The rank functions live in
``*_ranks.py`` modules beside their tests. Starting ranks costs seconds on a 2-core
machine, so callers run every scenario of a case in one start and inspect the results
afterwards.
"""

from __future__ import annotations

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

# Imported once by the forkserver; every rank is then forked from it already warm (a
# spawned rank re-imports torch: ~4-8 s per process on the 2-core CI machine). The server
# itself is a fresh interpreter that never ran torch compute, so forking it is safe. It
# inherits this process's sys.path, so the ``tests`` package imports there as here.
_PRELOAD = [
    "torch",
    "torch._dynamo",  # DDP.__init__ imports it: ~4 s
    "torch.distributed",
    "torch.distributed.algorithms.ddp_comm_hooks.default_hooks",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.nn.parallel",
    "gradstep",
    "gradstep.checkpoint",
    "gradstep.parallel",
    "gradstep_cli.data.sources",
    "gradstep_cli.models.gpt",
    "tests.support.multiproc",
    "tests.support.models",
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
    # On an error the peers may never reach the barrier: leave without it.
    gd.shutdown(barrier=not (isinstance(result, dict) and "error" in result))


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 120,
    collective_timeout_s: float = 60,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` local gloo ranks; return their results.

    ``fn`` must be importable by module name (a module-level function). A rank that raises
    reports the traceback (raised here). A collective that waits longer than
    ``collective_timeout_s`` raises in its rank (gloo's timeout); ranks still running after
    ``timeout`` seconds are killed and reported as a hang.
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
        failure = join_or_kill(ctx, timeout)
        files = [Path(out, f"rank{r}.pt") for r in range(world)]
        results = [torch.load(f, weights_only=False) if f.exists() else None for f in files]
    # A rank's own traceback is the root cause; a peer's exit error is only its echo.
    for r, res in enumerate(results):
        if isinstance(res, dict) and "error" in res:
            raise RuntimeError(f"rank {r} failed:\n{res['error']}")
    if failure is not None:
        raise RuntimeError(failure)
    return results


def join_or_kill(ctx: Any, timeout: float) -> str | None:
    """Join the ranks of ``ctx`` (``torch.multiprocessing.start_processes(..., join=False)``,
    any start method); kill them all after ``timeout`` seconds. Returns a failure or None."""
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
