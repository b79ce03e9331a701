"""Where this process runs: its rank, device, and which data it reads; and the process
settings of one ``train()`` call (:func:`launched`).

:class:`Launch` is derived once from the launch and the flags that lay the model over the
ranks, and handed on: every later stage reads the number of data ranks from it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from gradstep import parallel
from gradstep_cli.config.settings import TrainConfig
from gradstep_cli.models import parallel_plan

__all__ = ["Launch", "launched"]


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
    test or a notebook calling ``train()`` keeps its own."""
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
