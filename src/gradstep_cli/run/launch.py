"""Where this process runs: its rank, device, and which data it reads; the process
settings of one ``train()`` call (:func:`launched`); and ``--nproc-per-node``, the workers
this command starts through torch's own launcher (:func:`launch_workers`).

:class:`Launch` is derived once from the launch and the flags that lay the model over the
ranks, and handed on: every later stage reads the number of data ranks from it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from gradstep import parallel
from gradstep_cli.config.launching import node_range
from gradstep_cli.config.settings import TrainConfig
from gradstep_cli.models import parallel_plan

__all__ = [
    "Launch",
    "is_worker",
    "launch_workers",
    "launched",
    "planned_launch",
    "record_worker_error",
    "wants_launch",
]


@dataclass(frozen=True)
class Launch:
    """This process's place in the launch: its rank, and the data it reads."""

    env: parallel.DistEnv
    data_rank: int
    """The data rank this process reads (under --tp, its tensor-parallel peers read it too)."""
    data_ranks: int
    """Ranks that read different data: the launched ranks, or their data-parallel part."""

    @classmethod
    def of(cls, cfg: TrainConfig, env: parallel.DistEnv) -> Launch:
        data_rank, data_ranks = parallel_plan.data_rank(cfg, env.rank, env.world_size)
        return cls(env, data_rank, data_ranks)

    @property
    def device(self) -> torch.device:
        return self.env.device

    @property
    def world_size(self) -> int:
        """Launched ranks."""
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        """Rank 0: the only process that prints and writes files."""
        return self.env.is_main

    @property
    def backend(self) -> str | None:
        return self.env.backend


@contextlib.contextmanager
def launched(cfg: TrainConfig) -> Iterator[Launch]:
    """This process's place in the launch, for one ``train()`` call: the process group is
    created (unless the caller made one) and closed at the end, and the run has
    ``--threads`` intra-op CPU threads (0: torch's setting), restored afterwards so that a
    test or a notebook calling ``train()`` keeps its own.

    glibc's mmap threshold is left adaptive here: pinning it (what a --memory-budget does,
    gradstep_cli.plan.budget.settle_process) returns freed activations to the OS, so the
    resident set follows the live tensors (the fine-tuning walk's 300-step run: resident
    413 MiB throughout, peak 525, against 556 -> 585 and 640 adaptive;
    bench/long_run_memory.py), but each step then faults them back in: 0.15-0.25 s of
    system CPU a step on that job, 1.4x the unpinned step (bench/finetune_trl.py). Without
    a budget, speed wins."""
    owns_group = not parallel.is_initialized()
    env = parallel.init(cfg.device, timeout_s=cfg.collective_timeout)
    previous = torch.get_num_threads()
    try:
        with parallel.quiet_unless_main():
            if cfg.threads:
                torch.set_num_threads(cfg.threads)
            yield Launch.of(cfg, env)
    except BaseException:
        if owns_group:
            parallel.shutdown(barrier=False)  # the other ranks may never reach a barrier
        raise
    finally:
        torch.set_num_threads(previous)
    if owns_group:
        parallel.shutdown()


# ---------------------------------------------------------------- --nproc-per-node
WORKER_ENV = "GRADSTEP_WORKER"
"""Set by :func:`launch_workers` for its workers: they run the command, never launch."""
ELASTIC_LOGGERS = (
    "torch.distributed.elastic",
    "torch.distributed.run",
    "torch.distributed.launcher",
)


def is_worker() -> bool:
    """True in a worker :func:`launch_workers` started."""
    return os.environ.get(WORKER_ENV) == "1"


def wants_launch(cfg: TrainConfig) -> bool:
    """``--nproc-per-node`` given, in the process that launches (not in its workers)."""
    return cfg.nproc_per_node is not None and not is_worker()


def planned_launch(cfg: TrainConfig) -> Launch | None:
    """rank 0 of the launch ``cfg`` asks for, to check the flags against before any worker
    starts (None: an elastic --nnodes range, whose world size is known at rendezvous)."""
    low, high = node_range(cfg.nnodes)
    if low != high:
        return None
    device = parallel.resolve_device(cfg.device, local_rank=0)
    backend = "nccl" if device.type == "cuda" else "gloo"
    world = cfg.nproc_per_node * low
    return Launch.of(cfg, parallel.DistEnv(0, world, 0, device, backend))


def torchrun_args(cfg: TrainConfig, argv: list[str]) -> list[str]:
    """torchrun's command line for ``python -m gradstep ARGV`` on every worker."""
    args = [
        f"--nproc_per_node={cfg.nproc_per_node}",
        f"--nnodes={cfg.nnodes}",
        f"--node_rank={cfg.node_rank}",
        f"--master_addr={cfg.master_addr}",
        f"--rdzv_backend={cfg.rdzv_backend}",
        f"--rdzv_endpoint={cfg.rdzv_endpoint}",
        f"--rdzv_id={cfg.rdzv_id}",
        f"--rdzv_conf={cfg.rdzv_conf}",
        f"--max_restarts={cfg.max_restarts}",
    ]
    if cfg.master_port is not None:
        args.append(f"--master_port={cfg.master_port}")
    return [*args, "--module", "gradstep", *argv]


def launch_workers(cfg: TrainConfig, argv: list[str]) -> tuple[int, str | None]:
    """Run ``gradstep ARGV`` on ``--nproc-per-node`` workers through torch's launcher
    (``torch.distributed.run.run``: its rendezvous, restarts and, on one node without a
    port, a free port). Returns (exit status, the one-line error of the failed worker)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    os.environ[WORKER_ENV] = "1"  # inherited by the workers
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, without its banner
    levels = {name: logging.getLogger(name).level for name in ELASTIC_LOGGERS}
    for name in ELASTIC_LOGGERS:  # the launcher's own logging would bury the error line
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        torchrun.run(torchrun.get_args_parser().parse_args(torchrun_args(cfg, argv)))
    except ChildFailedError as exc:
        return worker_failure(exc.failures)
    finally:
        os.environ.pop(WORKER_ENV, None)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
    return 0, None


def worker_failure(failures: dict[int, Any]) -> tuple[int, str]:
    """The failure that ended the launch, naming its rank, and the exit status to return.

    The launcher stops the other workers with SIGTERM once one fails, so the cause is, in
    this order: a worker killed by another signal (SIGKILL: the OOM killer, a user), then
    the earliest error a worker wrote (:func:`record_worker_error`: the same one from
    several ranks is said once, naming them), then the earliest other exit."""
    killed = [r for r, f in failures.items() if f.exitcode < 0 and -f.exitcode != signal.SIGTERM]
    ours = {r: f.error_file_data.get("gradstep") for r, f in failures.items()}
    ours = {r: info for r, info in ours.items() if isinstance(info, dict)}
    if ours and not killed:
        rank = min(ours, key=lambda r: (ours[r]["time"], r))
        message, status = ours[rank]["message"], int(ours[rank]["status"])
        alike = sorted(r for r, info in ours.items() if info["message"] == message)
        if len(alike) > 1:  # every rank refused the same (a check all ranks make)
            return status, f"ranks {', '.join(map(str, alike))}: {message}"
        return status, f"rank {rank}: {message}"
    first = killed or [r for r, f in failures.items() if f.exitcode > 0] or list(failures)
    rank = min(first, key=lambda r: (failures[r].timestamp, r))
    failure = failures[rank]
    status = failure.exitcode if failure.exitcode > 0 else 1
    if failure.exitcode < 0:
        return status, f"rank {rank}: {failure.message}"
    return status, f"rank {rank} exited with status {failure.exitcode} (its output above says why)"


def record_worker_error(message: str, status: int) -> bool:
    """Write this worker's one-line error where torch's launcher reads it (its error
    file): the launching gradstep prints it once, naming the rank, and a plain torchrun's
    summary shows it instead of "To enable traceback". True when written."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    now = time.time()
    info = {"message": message, "status": status, "time": now, "rank": os.environ.get("RANK")}
    try:
        with open(path, "w") as fh:
            json.dump({"message": message, "timestamp": int(now), "gradstep": info}, fh)
    except OSError:
        return False
    return True
