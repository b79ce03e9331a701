"""The first stage of ``gradstep train`` and ``gradstep plan``: the settings, checked.

:func:`check_train` refuses what the launch cannot run (:mod:`gradstep_cli.config.preflight`),
claims the run folder (rank 0 holds its lock), finds the checkpoint a ``--resume``
continues and merges its settings (the rules: :mod:`gradstep_cli.run.folder`);
:func:`check_plan` is its ``gradstep plan`` half. Both then ready the process for a memory
budget and read an ``hf:`` model's ``config.json`` (the rest of its settings: its shape), so
that every refusal comes before any data is read. The result, :class:`Checked`, is what
every later stage reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradstep import parallel
from gradstep.checkpoint import CheckpointInfo
from gradstep_cli.config.preflight import check_run
from gradstep_cli.config.settings import ConfigError, TrainConfig
from gradstep_cli.data.sources import DataError
from gradstep_cli.models.hf import hf_config
from gradstep_cli.plan.budget import settle_process
from gradstep_cli.run import folder as run_folder
from gradstep_cli.run.launch import Launch

__all__ = ["Checked", "check_plan", "check_train", "given_fields", "on_rank0"]


@dataclass(frozen=True)
class Checked:
    """The settings a run runs, checked against its launch and its run folder."""

    cfg: TrainConfig
    """A resume's: the checkpoint's settings, with what this invocation may change."""
    launch: Launch
    given: frozenset[str] = frozenset()
    """The settings the caller set on purpose (flags, config-file keys)."""
    resume: CheckpointInfo | None = None
    """The checkpoint the run continues (None: a new run)."""
    hf_config: Any = None
    """An ``hf:`` model's config as the run adjusts it (None: the toy GPT)."""
    horizon: int | None = None
    """Where the resumed run's LR schedule ends (None: at --max-steps, a new run's)."""
    notes: tuple[str, ...] = ()
    """What the resume decided, said once the run is built."""


def given_fields(cfg: TrainConfig) -> frozenset[str]:
    """The settings ``cfg`` sets on purpose when the caller does not say: every one that
    differs from its default, except automatic ones left as None (e.g. the warm-up, which
    follows max_steps)."""
    defaults = TrainConfig()
    return frozenset(
        f.name
        for f in dataclasses.fields(cfg)
        if f.name not in cfg.auto_fields and getattr(cfg, f.name) != getattr(defaults, f.name)
    )


def check_train(
    cfg: TrainConfig, launch: Launch, given: frozenset[str], folder: contextlib.ExitStack
) -> Checked:
    """The settings ``gradstep train`` runs on this launch, the run folder claimed.

    Rank 0 locks ``--out`` until ``folder`` closes and writes its pid into the lock once
    the run is accepted; every rank sees the same refusal (:func:`on_rank0`). ``given``:
    the settings the caller set on purpose (see :func:`gradstep_cli.train.train`).
    """
    check_run(cfg, launch)  # before the run folder is touched
    claims: list[Callable[[], None]] = []
    on_rank0(lambda: claims.append(folder.enter_context(run_folder.locked(Path(cfg.out)))))
    info = run_folder.find_checkpoint(cfg)
    on_rank0(lambda: run_folder.prepare(cfg, info))
    horizon = run_folder.schedule_horizon(info) if info is not None else None
    # --tp is this invocation's (never the checkpoint's): its data ranks resume the batch.
    cfg, notes = run_folder.resumed_settings(cfg, info, given, launch.data_ranks, horizon)
    check_run(cfg, launch)  # the resumed settings, before anything is planned
    on_rank0(lambda: claims[0]())  # accepted: the lock file names this process
    settle_process(cfg, launch.device)  # before anything is loaded
    return Checked(cfg, launch, given, info, _hf_config(cfg), horizon, tuple(notes))


def check_plan(cfg: TrainConfig, launch: Launch, given: frozenset[str] = frozenset()) -> Checked:
    """The settings ``gradstep plan`` plans: what train would refuse, refused the same way,
    and what the planner cannot plan (``given``: as :func:`check_train`'s)."""
    check_run(cfg, launch, planning=True)
    settle_process(cfg, launch.device, planning=True)  # before anything is loaded
    return Checked(cfg, launch, given, hf_config=_hf_config(cfg))


def _hf_config(cfg: TrainConfig) -> Any:
    """An hf: model's config.json, read once: its refusals come before any data is read."""
    return hf_config(cfg) if cfg.is_hf else None


def on_rank0(action: Callable[[], Any]) -> Any:
    """Run ``action`` on rank 0 only; every rank returns its result or raises its error, so
    a refusal on rank 0 never leaves the other ranks waiting in a collective."""
    result, error = None, None
    if parallel.is_main():
        try:
            result = action()
        except (ConfigError, DataError) as exc:
            error = exc
    result, error = parallel.broadcast_from_rank0((result, error))
    if error is not None:
        raise error
    return result
