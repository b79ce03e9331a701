"""Starting or resuming a ``gradstep train`` run: the plumbing around the training script.

- :func:`launched`: the process group and CPU threads of one ``train()`` call;
- :func:`given_fields`: the settings a call of ``train()`` without ``given`` set;
- :func:`open_run`: on every rank, claim the run folder (rank 0 holds its lock), find the
  checkpoint a ``--resume`` continues, apply the run-folder rules and merge the resumed
  settings (the rules themselves: :mod:`gradstep_cli.run.folder`);
- :func:`stateful`: everything a checkpoint holds, by name: :class:`Settings` (the run's
  settings) and :class:`Progress` (the loop's totals) among them;
- :func:`load`: a checkpoint loaded into a built run; :func:`checkpointer`, the run's;
- :func:`cut_metrics`: ``metrics.jsonl`` cut back to the checkpoint's step;
- :func:`on_rank0`: an action taken by rank 0 alone, its result or refusal every rank's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradstep import GradientNoiseScale, Stepper, parallel
from gradstep.checkpoint import Checkpointer, CheckpointInfo
from gradstep_cli.config import preflight
from gradstep_cli.config.settings import ConfigError, TrainConfig
from gradstep_cli.data.batching import Layout
from gradstep_cli.data.sources import Batch, DataError, TextSource, TrainBatches
from gradstep_cli.run import folder as run_folder
from gradstep_cli.run.schedule import BatchRamp, LRSchedule

__all__ = [
    "Progress",
    "Run",
    "Settings",
    "checkpointer",
    "cut_metrics",
    "given_fields",
    "launched",
    "load",
    "on_rank0",
    "open_run",
    "stateful",
]


@contextlib.contextmanager
def launched(cfg: TrainConfig) -> Iterator[parallel.DistEnv]:
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
            yield env
    except BaseException:
        if owns_group:
            parallel.shutdown(barrier=False)  # the other ranks may never reach a barrier
        raise
    finally:
        torch.set_num_threads(previous)
    if owns_group:
        parallel.shutdown()


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


def open_run(
    cfg: TrainConfig,
    env: parallel.DistEnv,
    given: frozenset[str],
    folder: contextlib.ExitStack,
) -> tuple[TrainConfig, CheckpointInfo | None, list[str]]:
    """(the settings the run runs, the checkpoint it continues, lines to print).

    Rank 0 locks ``--out`` until ``folder`` closes and writes its pid into the lock once
    the run is accepted; every rank sees the same refusal (:func:`on_rank0`). ``given``:
    the settings the caller set on purpose (see :func:`gradstep_cli.train.train`).
    """
    preflight.check_run(cfg, env)  # before the run folder is touched
    claims: list[Callable[[], None]] = []
    on_rank0(lambda: claims.append(folder.enter_context(run_folder.locked(Path(cfg.out)))))
    info = run_folder.find_checkpoint(cfg)
    on_rank0(lambda: run_folder.prepare(cfg, info))
    # --tp is this invocation's (never the checkpoint's): its data ranks resume the batch.
    cfg, notes = run_folder.resumed_settings(cfg, info, given, env.world_size // cfg.tp)
    preflight.check_run(cfg, env)  # the resumed settings, before anything is planned
    on_rank0(lambda: claims[0]())  # accepted: the lock file names this process
    return cfg, info, notes


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


@dataclass
class Progress:
    """Loop totals a resume carries on, so the summary reads as one uninterrupted run."""

    initial_val_loss: float = math.nan
    tokens: int = 0
    micro_batches: int = 0
    """Micro-batches per rank consumed by the steps so far (skipped ones included)."""
    step_time: float = 0.0
    recent: list[tuple[float, int]] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, [tuple(r) for r in value] if key == "recent" else value)


@dataclass
class Run:
    """Everything the loop touches, built once by ``gradstep_cli.train``'s setup."""

    cfg: TrainConfig
    out: Path
    device: torch.device
    world_size: int
    """Launched ranks."""
    data_ranks: int
    """Ranks that read different data (the world, or its data-parallel part under --tp)."""
    is_main: bool
    """Rank 0: the only process that prints and writes files."""
    model: nn.Module
    stepper: Stepper
    train_iter: TrainBatches
    val: list[Batch]
    source: TextSource
    accum_steps: int
    """Micro-batches per window on each rank."""
    layout: Layout
    schedule: LRSchedule
    progress: Progress = field(default_factory=Progress)
    planned_peak_mb: float | None = None
    """The plan's predicted peak (--micro-batch-size auto), logged next to the measured one."""
    start: int = 0
    """Steps already taken: the step of the checkpoint resumed from."""
    checkpointer: Checkpointer | None = None
    ramp: BatchRamp | None = None
    gns: GradientNoiseScale | None = None
    tokenizer: Any = None
    """The HF model's tokenizer (None: the demo GPT's bytes)."""

    @property
    def budget(self) -> int:
        """Micro-batches per rank the run trains on (ramped runs end on it)."""
        return self.cfg.max_steps * self.accum_steps

    def finished(self, steps: int) -> bool:
        if self.ramp is None:
            return steps >= self.cfg.max_steps
        return self.progress.micro_batches >= self.budget


@dataclass
class Settings:
    """The run's settings in its checkpoints, so a resume runs what the run ran. Where the
    run ran (folder, device, launch) is not the run's: it is left out."""

    cfg: TrainConfig

    def state_dict(self) -> dict[str, Any]:
        settings = self.cfg.to_dict()
        return {k: v for k, v in settings.items() if k not in run_folder.ENVIRONMENT}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass  # read from the manifest before the run is built (run_folder.saved_settings)


def stateful(run: Run) -> dict[str, Any]:
    """Everything a checkpoint holds, by name (the names are keys in the checkpoint)."""
    stepper = run.stepper
    return {
        "config": Settings(run.cfg),
        "model": run.model,
        "optimizer": stepper.optimizer,
        "scheduler": run.schedule,
        "stepper": stepper,
        "data": run.train_iter,
        "progress": run.progress,
        **({"ramp": run.ramp} if run.ramp is not None else {}),
    }


def load(run: Run, info: CheckpointInfo) -> list[str]:
    """Load ``info`` into the run (model, optimizer, schedule, stepper, data position);
    returns the lines that say what was resumed."""
    objects = stateful(run)
    if "config" not in info.manifest["objects"]:
        del objects["config"]  # a checkpoint from before the settings were saved
    Checkpointer(info.path.parent, trainable_only=run.cfg.lora > 0).load(info, **objects)
    run.start = info.step
    lines = [f"resumed from {info.path} (step {info.step})"]
    if info.accum_steps is not None and info.dp_size != run.data_ranks:
        rows = run.layout.rows_per_rank
        what = "accum_steps" if rows is None else "sequences per step"
        now = run.accum_steps if rows is None else rows
        ranks = "rank(s)" if info.dp_size == info.world_size else "data-parallel rank(s)"
        lines.append(
            f"the checkpoint ran {info.dp_size} {ranks} x {what} {info.accum_steps}: "
            f"using {what} {now} on {run.data_ranks} to keep the global batch"
        )
    return lines


def checkpointer(run: Run) -> Checkpointer:
    """The run's checkpoints (``OUT/checkpoints``), recording how its windows are laid out."""
    return Checkpointer(
        run.out / "checkpoints",
        run.cfg.keep_checkpoints,
        accum_steps=run.layout.stream_items_per_window,
        micro_batch_size=run.layout.stream_rows,
        dp_size=run.data_ranks,
        trainable_only=run.cfg.lora > 0,  # the frozen base is rebuilt from the seed
    )


def cut_metrics(path: Path, steps: int) -> None:
    """Keep the metrics of the first ``steps`` steps: the later ones will be run again."""
    if path.exists():
        lines = path.read_text().splitlines(keepends=True)[:steps]
        path.write_text("".join(line for line in lines if line.endswith("\n")))
