"""What a ``gradstep train`` checkpoint holds, and a run resumed from one.

- :class:`Progress`: the loop's totals; :class:`Settings`: the run's settings;
- :func:`stateful`: everything a checkpoint holds, by name (the names are keys in it);
- :func:`load`: a checkpoint loaded into a built run; :func:`checkpointer`, the run's;
- :func:`cut_metrics`: ``metrics.jsonl`` cut back to the checkpoint's step.

Which checkpoint a run continues, and with which settings, is decided before anything is
built (:mod:`gradstep_cli.run.start`, by the rules of :mod:`gradstep_cli.run.folder`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradstep.checkpoint import Checkpointer, CheckpointInfo
from gradstep_cli.config.settings import TrainConfig
from gradstep_cli.run import folder as run_folder

if TYPE_CHECKING:
    from gradstep_cli.run.build import Run

__all__ = ["Progress", "Settings", "checkpointer", "cut_metrics", "load", "stateful"]


@dataclass
class Progress:
    """Loop totals a resume carries on, so the summary reads as one uninterrupted run."""

    initial_val_loss: float = math.nan
    tokens: int = 0
    micro_batches: int = 0
    """Micro-batches per rank consumed by the steps so far (skipped ones included)."""
    step_time: float = 0.0
    positions: int = 0
    """Positions the model processed (prompt and padding included), over the data ranks."""
    recent: list[tuple[float, int]] = field(default_factory=list)
    best_step: int | None = None
    """--keep-best: the step of the best evaluation so far (its checkpoint is kept)."""
    best_value: float = math.nan
    stale_evals: int = 0
    """Evaluations since the best one (--early-stopping-patience stops at the patience)."""

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, [tuple(r) for r in value] if key == "recent" else value)


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
    """Keep each step up to ``steps`` once, in order: the later ones will be run again.

    A record names its step (``window``; records from before it did count by their line).
    Of a step written twice, by a run that died after it and the resume that ran it again
    (an older gradstep cut by line count), the last written is kept; an unterminated last
    line (a process killed mid-write) is dropped. Rewritten beside and renamed: a crash
    here leaves the file as it was."""
    if not path.exists():
        return
    kept: dict[int, str] = {}
    for line_number, line in enumerate(path.read_text().splitlines(keepends=True), start=1):
        if not line.endswith("\n"):
            continue
        try:
            step = int(json.loads(line).get("window", line_number))
        except (ValueError, TypeError, AttributeError):
            continue  # not a record
        if step <= steps:
            kept[step] = line
    temporary = path.with_name(path.name + ".cut")
    temporary.write_text("".join(kept[step] for step in sorted(kept)))
    os.replace(temporary, path)
