"""The rules that keep one run per run folder, and make ``--resume`` honest.

- A folder that holds a run (its config, metrics, summary or checkpoints) is only trained
  into again with ``--resume`` / ``--resume-or-start`` (continue it) or ``--overwrite``
  (delete that run's files first; a symbolic link among them is refused before anything is
  deleted): two runs never mix in one folder.
- A run folder never lies inside another run's folder or a checkpoints folder, and a run
  resumed from another folder's checkpoint trains into an empty folder: a folder holding
  another run is never written to.
- One trainer at a time: rank 0 holds an exclusive ``flock`` on ``OUT/.gradstep.lock`` for
  the whole run; the kernel releases it when the process ends, however it ends
  (:mod:`gradstep_cli.run.lock`).
- ``--resume`` that finds no valid checkpoint is an error (``--resume-or-start`` is the
  explicit "continue if there is something to continue"). ``--resume DIR`` accepts a
  checkpoints folder, a run folder (its ``checkpoints/``) or one ``step-N`` folder.
- A resumed run runs the checkpoint's settings. A flag given on the command line that
  differs from them is applied when it only says how far or how visibly to go on
  (``CONTINUABLE``), left to the checkpoint's own checks when it changes the model or the
  data (shapes, data layout: refused there with the details), and refused here otherwise
  (the learning-rate schedule, the clip policy, precision, the global batch).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

from gradstep.checkpoint import Checkpointer, CheckpointInfo, saved_state
from gradstep.metrics import FINISHED_FILE
from gradstep_cli.config.checks import GPT_SHAPE, ConfigError, flag
from gradstep_cli.config.launching import LAUNCH_FIELDS
from gradstep_cli.config.recipe import adam_refusal, recipe_note
from gradstep_cli.config.settings import RESUME_AUTO, TrainConfig
from gradstep_cli.run.lock import LOCK_FILE, locked

__all__ = [
    "CONTINUABLE",
    "ENVIRONMENT",
    "LOCK_FILE",
    "RUN_FILES",
    "find_checkpoint",
    "holds_run",
    "locked",
    "merge_settings",
    "prepare",
    "resumed_settings",
    "schedule_horizon",
]

RUN_FILES = (
    "config.json",
    "metrics.jsonl",
    "summary.json",
    FINISHED_FILE,
    "checkpoints",
    "tensorboard",
    "report",
    "samples.jsonl",
    "trackers.json",
    "wandb",
)
# What a run may change when it is resumed: how far it goes and what it shows.
CONTINUABLE = frozenset(
    {
        "max_steps",
        "epochs",
        "eval_every",
        "eval_batches",
        "log_every",
        "sample_tokens",
        "save_every",
        "keep_checkpoints",
        "tensorboard",
        "report_to",
        "early_stopping_patience",
        "sample_every",
        "sample_prompts",
        "memory_budget",
        "activation_checkpointing",
        "loss_chunk_tokens",
        "compile",
    }
)
# With an exact global batch the split into micro-batches is only a memory setting.
CONTINUABLE_EXACT = frozenset({"micro_batch_size", "accum_steps"})
# Where and how this process runs: always this invocation's, never the checkpoint's.
ENVIRONMENT = frozenset(
    {
        "out",
        "resume",
        "resume_or_start",
        "overwrite",
        "device",
        "threads",
        "strategy",
        "tp",
        "hsdp",
        "collective_timeout",
        "stop_after",
        *LAUNCH_FIELDS,
    }
)
# Changes the model or the data stream: the checkpoint's own checks refuse a misfit with
# the exact shapes / fields, so a flag given is passed on to them unchanged.
CHECKED_ON_LOAD = frozenset(
    {"n_layer", "n_head", "d_model", "seq_len", "micro_batch_size", "data", "seed"}
)


def holds_run(out: Path) -> bool:
    """True when ``out`` has files of an earlier run."""
    return any((out / name).exists() for name in RUN_FILES)


def find_checkpoint(cfg: TrainConfig) -> CheckpointInfo | None:
    """The checkpoint this invocation continues, None for a new run; raises ConfigError
    for a resume that finds nothing."""
    out = Path(cfg.out)
    if cfg.resume is None and not cfg.resume_or_start:
        return None
    which = _resume_flag(cfg)
    if cfg.resume_or_start or cfg.resume == RESUME_AUTO:
        where = out / "checkpoints"
    else:
        where = Path(cfg.resume)
        if not where.exists():
            raise ConfigError(f"--resume {cfg.resume!r}: no such checkpoint folder")
        if (where / "checkpoints").is_dir():  # a run folder
            where = where / "checkpoints"
    if (where / "manifest.json").exists():  # one step-N folder
        info = Checkpointer(where.parent).inspect(where)
    else:
        info = Checkpointer(where).latest() if where.is_dir() else None
    if info is not None or (cfg.resume_or_start and not holds_run(out)):
        return info
    hint = (
        f"{str(out)!r} holds a run without one: --overwrite starts over"
        if cfg.resume_or_start
        else "--resume-or-start starts a new run when there is none"
    )
    listed = Checkpointer(where).checkpoints() if where.is_dir() else []
    why = " (the unusable ones are listed above)" if listed else ""
    raise ConfigError(f"{which}: no valid checkpoint in {str(where)!r}{why}; {hint}")


def _resume_flag(cfg: TrainConfig) -> str:
    return "--resume-or-start" if cfg.resume_or_start else "--resume"


def _own_checkpoint(out: Path, info: CheckpointInfo) -> bool:
    """True when ``info`` is one of ``out``'s own checkpoints (``OUT/checkpoints/step-N``)."""
    return info.path.resolve().parent == (out / "checkpoints").resolve()


def prepare(cfg: TrainConfig, info: CheckpointInfo | None, delete: bool = True) -> None:
    """Enforce the one-run-per-folder rule on rank 0, before anything is written; with
    ``--overwrite`` delete the run there (unless not ``delete``: a check only)."""
    out = Path(cfg.out)
    if not holds_run(out):
        return
    if info is not None:
        if _own_checkpoint(out, info):
            return  # continuing this folder's own run
        raise ConfigError(
            f"--out {str(out)!r} holds another run; a run resumed from {str(info.path)!r} "
            "needs an empty --out (or that run's own folder)"
        )
    if not cfg.overwrite:
        raise ConfigError(
            f"--out {str(out)!r} already holds a run; pass --resume to continue it, "
            "--overwrite to delete it and start over, or choose a new --out"
        )
    if delete:
        _delete_run(out)


def _delete_run(out: Path) -> None:
    """``--overwrite``: delete the run's entries once every one is known to be deletable. A
    symbolic link points at something the folder does not own (checkpoints kept on another
    disk), so one is refused before anything is deleted."""
    present = [
        out / name for name in RUN_FILES if (out / name).is_symlink() or (out / name).exists()
    ]
    linked = [path for path in present if path.is_symlink()]
    if linked:
        links = ", ".join(f"{str(path)!r} (-> {os.readlink(path)!r})" for path in linked)
        raise ConfigError(
            f"--overwrite: {links}: a symbolic link; --overwrite deletes only what a run wrote, "
            "never a link or what it points to, so nothing was deleted. Remove the link (and, "
            "if you mean to, what it points to) yourself, or choose a new --out"
        )
    for path in present:
        try:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError as exc:
            raise ConfigError(
                f"--overwrite: cannot delete {str(path)!r} ({exc.strerror or exc}); delete the "
                f"run in {str(out)!r} yourself, or choose a new --out"
            ) from None


def saved_settings(info: CheckpointInfo) -> dict[str, Any] | None:
    """The settings the checkpointed run ran with (None for checkpoints that predate them)."""
    saved = saved_state(info.manifest, "config")
    if saved is None:
        return None
    if str(saved.get("model", "gpt")).startswith("hf:"):
        # Older checkpoints recorded the demo GPT's shape for an hf: model, where it never
        # applied (the model's config.json sets it): null, as a new run records.
        saved.update(dict.fromkeys(GPT_SHAPE))
    if "lr_schedule" not in saved:  # from before --lr-schedule: what such a run ran
        betas = {"adamw": ("0.9,0.95", 1e-8), "lamb": ("0.9,0.999", 1e-6)}
        saved["adam_betas"], saved["adam_eps"] = betas.get(saved.get("optimizer"), (None, None))
        saved.update(lr_schedule="cosine", decay_ratio=None, epochs=None)
    return saved


def schedule_horizon(info: CheckpointInfo) -> int | None:
    """The max_steps where the checkpointed run's LR schedule ends: saved with the schedule
    (it survives extensions), else (older checkpoints) the run's max_steps, else None."""
    state = saved_state(info.manifest, "scheduler")
    if isinstance(state, dict) and "max_steps" in state:
        return int(state["max_steps"])
    saved = saved_settings(info)
    return None if saved is None else int(saved["max_steps"])


def merge_settings(
    cfg: TrainConfig,
    saved: dict[str, Any],
    given: frozenset[str],
    elastic_accum: int,
    horizon: int | None = None,
) -> tuple[TrainConfig, list[str]]:
    """The settings a resumed run runs with, and the lines that say what was decided.

    ``given`` are the fields this invocation set explicitly (flags, config file). A field
    not given takes the checkpoint's value; a given one must be continuable or fit.
    ``horizon``: the checkpoint's LR schedule horizon (default: its max_steps).
    """
    now = dataclasses.asdict(cfg)
    merged, refused, taken = dict(saved), [], []
    continuable = CONTINUABLE | (CONTINUABLE_EXACT if saved.get("global_batch") else set())
    for name, value in now.items():
        # A setting newer than the checkpoint, where this process runs, or a given flag the
        # run may change (or the load will check): this invocation's value.
        mine = name not in saved or name in ENVIRONMENT
        if mine or (name in given and name in continuable | CHECKED_ON_LOAD):
            merged[name] = value
        elif name in continuable:
            pass  # not given: the checkpoint's
        elif name == "accum_steps":
            if name in given and value not in (saved[name], elastic_accum):
                refused.append(
                    f"--accum-steps {value} (the checkpoint's global batch needs "
                    f"{elastic_accum} on this world size)"
                )
            merged[name] = elastic_accum
        elif name in given and value != saved[name]:
            refused.append(f"{flag(name)} {value!r} (the checkpoint ran {saved[name]!r})")
        elif value != saved[name] and not (saved[name] is None and name in cfg.auto_fields):
            taken.append(f"{name}={saved[name]!r}")
    if refused:
        raise ConfigError(
            f"{_resume_flag(cfg)} continues a run with its own settings; refused: "
            + "; ".join(refused)
            + ". Drop these flags, or start a new run with another --out"
        )
    notes = [f"resume: the checkpoint's settings apply: {', '.join(taken)}"] if taken else []
    horizon = saved["max_steps"] if horizon is None else horizon
    stop = _length(merged, given)
    if stop is not None:  # else derived from --epochs, once the data is read
        notes += _horizon_notes(stop, horizon, merged["min_lr"])
    # The schedule keeps its horizon, so --warmup is checked against it, not against where
    # this resume stops: a run may stop before the checkpoint's warm-up would have ended.
    try:
        resumed = TrainConfig(**{**merged, "max_steps": max(stop or horizon, horizon)})
    except ConfigError as exc:
        raise ConfigError(f"{_resume_flag(cfg)}: the resumed settings do not fit: {exc}") from None
    resumed._set("max_steps", stop)
    return resumed, notes


def _length(merged: dict[str, Any], given: frozenset[str]) -> int | None:
    """The resumed run's --max-steps: a given --max-steps replaces the run's --epochs, a
    given --epochs its derived steps (None: derived again from the data)."""
    if "max_steps" in given:
        merged["epochs"] = None
    elif "epochs" in given or merged.get("epochs") is not None:
        merged["max_steps"] = None
    return merged["max_steps"]


def _horizon_notes(max_steps: int, horizon: int, min_lr: float) -> list[str]:
    """What a resume to another --max-steps does to the LR schedule, which keeps its
    horizon (docs/guide/cli.md, run-folder rules)."""
    keeps = f"the learning-rate schedule keeps the checkpoint's max_steps {horizon}"
    if max_steps > horizon:
        return [
            f"resume: training to step {max_steps}; {keeps}: its cosine ends at step "
            f"{horizon} and the later steps run at --min-lr {min_lr:g}"
        ]
    if max_steps < horizon:
        return [
            f"resume: stopping at step {max_steps}; {keeps}, so the run ends before its "
            f"learning rate has decayed to --min-lr {min_lr:g}"
        ]
    return []


def resumed_settings(
    cfg: TrainConfig,
    info: CheckpointInfo | None,
    given: frozenset[str],
    world: int,
    horizon: int | None = None,
) -> tuple[TrainConfig, list[str]]:
    """What a resumed run runs (the checkpoint's settings, plus what may change) on
    ``world`` data-parallel ranks (the ranks, except under --tp). ``horizon``: the
    checkpoint's :func:`schedule_horizon` (read here when not given). A new run's note says
    which defaults applied (gradstep_cli.config.recipe)."""
    if {"epochs", "max_steps"} <= given:
        raise ConfigError("--epochs and --max-steps both set the run's length: pass one of them")
    if (unused := adam_refusal(cfg, given)) is not None:
        raise ConfigError(unused)
    if info is None:
        return cfg, [recipe_note(cfg)]
    saved = saved_settings(info)
    if (saved or {}).get("batch_ramp") is not None and info.dp_size != world:
        ranks = "rank(s)" if info.dp_size == info.world_size else "data-parallel rank(s)"
        raise ConfigError(
            f"this run ramps its batch (batch_ramp={saved['batch_ramp']!r}) and was saved on "
            f"{info.dp_size} {ranks}: resume it on {info.dp_size}, not {world} (a ramp's "
            "micro-batches per rank do not rescale)"
        )
    if (saved or {}).get("global_batch", cfg.global_batch) is not None:
        # An exact global batch is split per rank by the layout: accum_steps plays no part.
        elastic = (saved or {}).get("accum_steps", cfg.accum_steps)
        if info.accum_steps is not None:
            info.accum_steps_for(world)  # the global batch must still divide over the ranks
    else:
        elastic = cfg.accum_steps if info.accum_steps is None else info.accum_steps_for(world)
    if saved is None:  # an older checkpoint: only the global batch is known
        return dataclasses.replace(cfg, accum_steps=elastic), []
    horizon = schedule_horizon(info) if horizon is None else horizon
    return merge_settings(cfg, saved, given, elastic, horizon)
