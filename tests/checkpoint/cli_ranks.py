"""Rank functions of the multi-process checkpoint tests, for ``tests.support.multiproc.run_ranks``
(module-level, so the forkserver's ranks import them by name).

``cli_rank`` runs ``gradstep train`` (``gradstep_cli.cli.main``) on every rank, in the
process group ``run_ranks`` made: what torchrun + ``--strategy ddp`` runs, without paying
for a launcher and an interpreter per rank. ``rng_*`` train the checkpoint tests' tiny run
under DDP with dropout on and a different RNG stream on every rank.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from gradstep.checkpoint import Checkpointer
from gradstep.checkpoint.codec import decode
from gradstep.checkpoint.rng import rng_file, set_rng_state
from tests.checkpoint.helpers import MICRO, build, full_state, scramble_rng, train

K = 2  # micro-batches per rank per step in the RNG runs


def cli_rank(rank: int, world: int, argv: list[str]) -> int:
    from gradstep_cli.cli import main

    return main(argv)


def _has_dropout(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())


def rng_save_and_continue(rank: int, world: int, directory: str, steps: int) -> dict[str, Any]:
    """``steps`` steps, save, ``steps`` more. Every rank's torch RNG is seeded differently
    first, so its dropout masks (and its saved RNG state) are its own."""
    run = build(rank=rank, world=world, strategy="ddp")
    assert _has_dropout(run["model"])
    torch.manual_seed(100 + rank)
    train(run, steps, K)
    Checkpointer(directory, accum_steps=K, micro_batch_size=MICRO).save(steps, **run)
    at_save = torch.get_rng_state()
    train(run, steps, K)
    return {"final": full_state(run), "rng_at_save": at_save, "rng_end": torch.get_rng_state()}


def rng_resume(rank: int, world: int, directory: str, steps: int) -> dict[str, Any]:
    """Fresh objects, the global RNGs scrambled, load the newest checkpoint, ``steps`` steps.

    ``own``: as saved. The controls overwrite this rank's restored RNG after the load with
    another rank's saved state: ``swapped`` (rank r gets rank 1-r's), ``rank0`` (every rank
    gets rank 0's): what a checkpointer that saved or restored the wrong rank's RNG does.
    """
    results: dict[str, Any] = {}
    for mode, source in (("own", None), ("swapped", world - 1 - rank), ("rank0", 0)):
        run = build(rank=rank, world=world, strategy="ddp")
        scramble_rng(999 + rank)
        checkpointer = Checkpointer(directory)
        info = checkpointer.latest()
        start = checkpointer.load(info, **run)
        if source is not None:
            saved = json.loads((info.path / rng_file(source)).read_bytes())
            set_rng_state(decode(saved, {}))
        train(run, steps, K)
        results[mode] = {
            "start": start,
            "final": full_state(run),
            "rng_end": torch.get_rng_state(),
        }
    return results
