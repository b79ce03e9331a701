"""``gradstep export``: a trained ``hf:`` run as a folder the Hugging Face ecosystem loads.

``export_run(RUN_DIR, OUT, step=N, merge_lora=False)`` rebuilds the run's model from the
settings its checkpoint recorded, loads the checkpoint into it (``best=True``: the one the run's
``--keep-best`` kept, named by ``checkpoints/best.json``) and writes ``OUT``:

- full fine-tuning: ``save_pretrained`` of the model (``config.json``, safetensors);
- ``--lora``: the PEFT adapter folder (``adapter_config.json``,
  ``adapter_model.safetensors``) whose ``base_model_name_or_path`` is the base folder's
  absolute path, or ``base_name`` (``--base-name NAME``: a Hub id, or a path relative to
  where it is loaded), so ``PeftModel.from_pretrained(base, OUT)`` and
  ``AutoModelForCausalLM.from_pretrained(OUT)`` both load it; with ``merge_lora`` the merged
  model (``merge_and_unload``) as for full fine-tuning;
- always: the run's tokenizer files (when it had a tokenizer), a ``generation_config.json``
  whose EOS is the tokenizer's (and its chat template's end-of-turn token), ``use_cache``
  back on in ``config.json``, and ``gradstep_export.json`` (run, step, checkpoint, base
  fingerprint: PEFT itself never checks which base an adapter is put on).

dtype: the weights are written in the dtype the run held them in: float32, or bfloat16 for
the frozen base of a ``--lora --precision bf16`` run (its merged weights too; the adapters
stay float32). ``from_pretrained(dtype=...)`` casts on load.

A LoRA checkpoint is checked against its base before anything is written: the base folder's
weights must still be those the adapters were trained on (the checkpoint's base fingerprint).

The folder appears complete or not at all, and a failed write names its file
(:mod:`.folder`; the files: :mod:`.write`). The checkpoint is read under a
:func:`~gradstep.checkpoint.read_lease`, so a trainer still writing the run does not prune
it meanwhile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradstep.checkpoint import (
    MANIFEST,
    Checkpointer,
    CheckpointError,
    CheckpointInfo,
    read_lease,
)
from gradstep_cli.config.checks import ConfigError
from gradstep_cli.config.settings import TrainConfig, field_names
from gradstep_cli.export.folder import publish
from gradstep_cli.export.write import END_OF_TURN, EXPORT_FILE, KINDS, no_progress_bars
from gradstep_cli.export.write import write as _write
from gradstep_cli.models.hf import HF_PREFIX, WEIGHT_FILES, build_model, load_tokenizer
from gradstep_cli.run.folder import saved_settings
from gradstep_cli.run.validation import BEST_FILE, best_checkpoint

__all__ = ["END_OF_TURN", "EXPORT_FILE", "KINDS", "export_run"]


def export_run(
    run_dir: str | Path,
    out: str | Path,
    *,
    step: int | None = None,
    merge_lora: bool = False,
    best: bool = False,
    base_name: str | None = None,
) -> Path:
    """Write the run's checkpoint (``step``; ``best``: the --keep-best one; default the
    newest valid) to ``out``; return ``out``. An adapter names its base ``base_name``
    (default: the base folder's absolute path). Raises ConfigError (a user mistake: names
    the argument and what to do), CheckpointError (an unusable checkpoint) or OSError (a
    failed write, naming the file)."""
    if not os.fspath(out).strip():  # Path("") is ".": the current folder, written in place
        raise ConfigError("--out must name the folder to write, got an empty path")
    out, run_dir = Path(out), Path(run_dir)
    _check_out(out)
    if best:
        step = _best_step(run_dir, step)
    with _pinned(run_dir, step) as info:
        cfg = run_settings(info, run_dir)
        _check_kind(cfg, info, merge_lora)
        _check_base_name(cfg, merge_lora, base_name)
        model, tokenizer = _rebuild(cfg, info)
    kind = "full" if not cfg.lora else "lora-merged" if merge_lora else "lora-adapter"
    if kind == "lora-merged":
        model = model.merge_and_unload()
    with no_progress_bars():
        write = lambda folder: _write(folder, model, tokenizer, cfg, info, kind, base_name)  # noqa: E731
        publish(out, write)
    print(f"exported {KINDS[kind]} of {info.path} (step {info.step}) to {out}", file=sys.stderr)
    return out


# ----------------------------------------------------------------------------- checks


def _best_step(run_dir: Path, step: int | None) -> int:
    """--best: the step ``best.json`` of the run's checkpoints names."""
    if step is not None:
        raise ConfigError(f"--best exports the best checkpoint; --step {step} another: pass one")
    where = _where(run_dir)
    best = best_checkpoint(where)
    if best is None:
        raise ConfigError(
            f"--best: RUN_DIR {str(run_dir)!r} names no best checkpoint (no {BEST_FILE} in "
            f"{str(where)!r}): train with --keep-best METRIC (val_loss, val_accuracy), or "
            "export the newest (no --best) or one --step"
        )
    return int(best["step"])


def _check_base_name(cfg: TrainConfig, merge_lora: bool, base_name: str | None) -> None:
    """--base-name names an adapter's base: it needs one, and a name."""
    if base_name is None:
        return
    if not base_name.strip():
        raise ConfigError("--base-name must name the base model (a Hub id or a path), got ''")
    if not cfg.lora or merge_lora:
        what = "the merged model" if merge_lora else "the whole model (no --lora)"
        raise ConfigError(
            f"--base-name names the base an adapter loads onto; this export writes {what}, "
            "which needs no base: drop --base-name"
        )


def _check_out(out: Path) -> None:
    """--out must be a new or an empty folder: an export never mixes with other files."""
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(
            f"--out {str(out)!r} is not empty: export writes a complete folder of its own; "
            "choose a new --out or delete that folder first"
        )
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} exists and is not a folder")


def _where(run_dir: Path) -> Path:
    """The checkpoints folder (or one ``step-N`` folder) RUN_DIR names."""
    if not run_dir.exists():
        raise ConfigError(f"RUN_DIR {str(run_dir)!r}: no such folder")
    if not run_dir.is_dir():
        raise ConfigError(f"RUN_DIR {str(run_dir)!r} is not a folder (a run folder is)")
    return run_dir / "checkpoints" if (run_dir / "checkpoints").is_dir() else run_dir


@contextlib.contextmanager
def _pinned(run_dir: Path, step: int | None) -> Iterator[CheckpointInfo]:
    """The checkpoint to export (``step``'s, or the newest valid one), leased while the
    block reads it: a trainer still writing the run does not prune it meanwhile."""
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ConfigError(f"--step must be an int >= 0, got {step!r}")
    with contextlib.ExitStack() as held:
        info = _lease(held, run_dir, step)
        try:
            yield info
        except (OSError, CheckpointError) as exc:
            # Gone although leased: a file system without locks, or a trainer from before
            # leases. Say so, not "No such file or directory".
            if info.path.exists():
                raise
            raise _pruned(info.path) from exc


def _lease(held: contextlib.ExitStack, run_dir: Path, step: int | None) -> CheckpointInfo:
    """Lease (onto ``held``) and verify the checkpoint to export."""
    where = _where(run_dir)
    if (where / MANIFEST).is_file():  # one step-N folder
        info = _leased(held, where, chosen=True)
        if step is not None and step != info.step:
            raise ConfigError(
                f"--step {step}: RUN_DIR {str(run_dir)!r} is the checkpoint of step "
                f"{info.step}; pass its run folder to choose another step"
            )
        return info
    for _ in range(3):  # a trainer pruned what was listed: list again
        for folder in _candidates(run_dir, where, step):
            try:
                info = _leased(held, folder, chosen=step is not None)
            except FileNotFoundError:
                break
            if info is not None:
                return info
        else:
            raise ConfigError(
                f"RUN_DIR {str(run_dir)!r}: no valid checkpoint (the unusable ones are "
                "listed above)"
            )
    raise _pruned(where)


def _leased(held: contextlib.ExitStack, folder: Path, chosen: bool) -> CheckpointInfo | None:
    """``folder`` leased onto ``held`` and verified; None (unleased, with a warning) when it
    is unusable and an older one may do. FileNotFoundError when it was pruned meanwhile."""
    with contextlib.ExitStack() as lease:
        try:
            lease.enter_context(read_lease(folder))
        except FileNotFoundError:
            if chosen:
                raise _pruned(folder) from None
            raise
        try:
            info = Checkpointer(folder.parent).inspect(folder)
        except CheckpointError as exc:
            if not folder.exists():
                raise _pruned(folder) if chosen else FileNotFoundError(folder) from exc
            if chosen:
                raise
            logging.getLogger("gradstep.checkpoint").warning("%s; trying an older one", exc)
            return None
        held.enter_context(lease.pop_all())  # kept until the export has read it
        return info


def _candidates(run_dir: Path, where: Path, step: int | None) -> list[Path]:
    """The folders that may be exported, newest first: ``step``'s, or all."""
    folders = Checkpointer(where).checkpoints()
    if not folders:
        raise ConfigError(
            f"RUN_DIR {str(run_dir)!r} holds no checkpoints (no step-N folders in "
            f"{str(where)!r}): export reads a checkpoint; train with --save-every N, which "
            "also saves at the end of the run"
        )
    if step is None:
        return folders
    chosen = [f for f in folders if f.name == f"step-{step:06d}"]
    if not chosen:
        have = ", ".join(str(int(f.name.removeprefix("step-"))) for f in reversed(folders))
        raise ConfigError(
            f"--step {step}: {str(where)!r} holds no checkpoint of step {step}; it holds "
            f"step(s) {have}"
        )
    return chosen


def _pruned(folder: Path) -> CheckpointError:
    error = CheckpointError(
        f"the checkpoint {folder} was pruned while export read it (a trainer still writing "
        "the run keeps only its newest --keep-checkpoints): export again, pass --step with "
        "a step the run still holds, or wait until the run ends"
    )
    error.filename = str(folder)  # the run changed under the export, no mistake: status 1
    return error


def run_settings(info: CheckpointInfo, run_dir: Path) -> TrainConfig:
    """The settings the run trained with: its checkpoint's, else (older checkpoints) the run
    folder's config.json."""
    saved = saved_settings(info)
    source = f"checkpoint {info.path}"
    if saved is None:
        path = run_dir if (run_dir / "config.json").is_file() else info.path.parent.parent
        path = path / "config.json"
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError):
            raise ConfigError(
                f"RUN_DIR {str(run_dir)!r}: {info.path} records no settings and there is no "
                f"readable config.json beside it ({path}): the run's model cannot be rebuilt"
            ) from None
        source = str(path)
    known = set(field_names())
    values = {k: v for k, v in saved.items() if k in known}
    try:
        return TrainConfig(**values)
    except ConfigError as exc:
        raise ConfigError(f"the settings in {source} do not load: {exc}") from None


def _check_kind(cfg: TrainConfig, info: CheckpointInfo, merge_lora: bool) -> None:
    if not cfg.is_hf:
        raise ConfigError(
            f"{info.path} is a checkpoint of the demo GPT (--model {cfg.model}), not of a "
            "Hugging Face model: gradstep export writes runs of --model hf:DIR only"
        )
    if merge_lora and not cfg.lora:
        raise ConfigError(
            f"--merge-lora: the run of {info.path} trained the whole model (no --lora), so "
            "there are no adapters to merge; drop --merge-lora"
        )
    base = Path(cfg.model[len(HF_PREFIX) :]).expanduser()
    if cfg.lora and not base.is_dir():  # else the adapter alone looks trained on a random base
        raise ConfigError(
            f"the base folder {str(base)!r} of the LoRA run of {info.path} is missing (moved "
            "or deleted?): its adapters are exported against the base they were trained on; "
            "put that folder back at this path and export again"
        )
    if cfg.lora and not merge_lora and not _has_base_weights(cfg):
        raise ConfigError(
            f"the LoRA run of {info.path} trained on a randomly initialised base (--seed "
            f"{cfg.seed}), which no Hugging Face folder holds: its adapter alone cannot be "
            "loaded outside gradstep; pass --merge-lora to export the merged model"
        )


def _has_base_weights(cfg: TrainConfig) -> bool:
    """Whether the run's base came from weight files (not a random init)."""
    path = Path(cfg.model[len(HF_PREFIX) :]).expanduser()
    on_disk = path.is_dir() and any((path / name).is_file() for name in WEIGHT_FILES)
    return on_disk and cfg.init == "pretrained"


# ---------------------------------------------------------------------------- rebuild


def _rebuild(cfg: TrainConfig, info: CheckpointInfo) -> tuple[nn.Module, Any]:
    """The run's model with the checkpoint loaded into it, and its tokenizer."""
    # Full fine-tuning: every weight is in the checkpoint, the base folder's are not needed.
    build_cfg = cfg if cfg.lora else dataclasses.replace(cfg, init="random")
    notes = io.StringIO()
    try:
        with contextlib.redirect_stderr(notes):  # the trainer's notes, not the exporter's
            torch.manual_seed(cfg.seed)
            model = build_model(build_cfg)
            tokenizer = load_tokenizer(cfg)
    except ConfigError as exc:
        raise ConfigError(
            f"cannot rebuild the model of {info.path}: {exc} (the run's --model and "
            "--tokenizer are read from its checkpoint; one recorded relative, by an older "
            "gradstep, is relative to the folder the run was started in)"
        ) from None
    checkpointer = Checkpointer(info.path.parent, rng=False, trainable_only=cfg.lora > 0)
    try:
        checkpointer.load(info, strict=False, model=model)
    except CheckpointError as exc:
        raise CheckpointError(f"cannot export: {exc}") from None
    return model, tokenizer
