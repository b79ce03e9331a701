"""The data stage: the run's tokenizer and data, read and tokenized once (:class:`Data`).

The data is tokenized into a token store on disk, or an earlier run's store is reused
(:mod:`.prepare`): rank 0 prepares it while the other ranks wait, then every rank opens it
(on a node that cannot see rank 0's store, the rank builds its own: the same tokens). Only
the boundaries stay in memory; rows are read as batches are made. The planner measures the
rows' lengths on it; its peak while preparing (CPU, under a memory budget) is part of every
plan, so a budget holds the data stage too. The run cuts its rank's training stream and
validation batches from it.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gradstep.memory import peak_bytes, reset_peak
from gradstep_cli.config.preflight import note
from gradstep_cli.data.sources import TextSource, load_source
from gradstep_cli.models.hf import load_tokenizer

if TYPE_CHECKING:
    from gradstep_cli.run.start import Checked

__all__ = ["Data", "held_out_warning", "load_data"]


@dataclass(frozen=True)
class Data:
    """The run's data: both sides of the split, as tokens (or bytes)."""

    tokenizer: Any
    """The HF model's tokenizer (None: bytes, the toy GPT's and a tokenizer-less model's)."""
    source: TextSource
    seconds: float = 0.0
    """The data stage's wall time (tokenizer, reading, tokenizing or reusing the store)."""


def held_out_warning(source: TextSource, fraction: float) -> str:
    """What ``--val-fraction`` took from ``--data`` when it was not asked for: training
    data withheld is said, with its count, never silent (docs/guide/cli.md, the
    validation split)."""
    train, val = source.train, source.val
    if val.kinds:
        n, total = sum(val.kinds.values()), sum(val.kinds.values()) + sum(train.kinds.values())
        what = f"{n:,} of the {total:,} records"
    elif val.files == train.files == 1:
        what = "the end of its one file"
    else:
        what = f"{val.files:,} of the {val.files + train.files:,} files"
    return (
        f"warning: --val-fraction {fraction:g} holds {what} of --data out for validation "
        f"({len(val.data):,} {source.unit}), never trained on; give --val-data PATH to "
        "train on all of --data (or --val-fraction F to choose the share and silence this)"
    )


def _trim() -> None:
    """Hand the tokenizer's freed memory back to the OS (glibc keeps its threads' arenas):
    what the probe then measures as the baseline is what the run holds. The process's own
    symbols hold libc's: ``ctypes.util.find_library`` would fork ``ldconfig`` from a
    process of hundreds of MiB, a transient an outside RSS sampler counts twice."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL(None).malloc_trim(0)


def _prepare(checked: Checked, tokenizer: Any) -> TextSource:
    """Rank 0 first (the others wait), then every rank opens the store."""
    from gradstep_cli.run.start import on_rank0  # the checks stage: imports the data stage

    cfg, made = checked.cfg, []
    on_rank0(lambda: made.append(load_source(cfg, tokenizer)))
    return made[0] if made else load_source(cfg, tokenizer)


def load_data(checked: Checked) -> Data:
    """The data ``--data``/``--val-data`` name, tokenized as the model reads it."""
    started, cfg = time.perf_counter(), checked.cfg
    device = checked.launch.device
    budgeted = device.type == "cpu" and (cfg.memory_budget is not None or cfg.auto_micro_batch)
    if budgeted:
        reset_peak(device)  # the data stage's own peak, which every plan must hold
    tokenizer = load_tokenizer(cfg, checked.hf_config)
    source = _prepare(checked, tokenizer)
    if device.type == "cpu":
        _trim()
    prepared = dataclasses.replace(
        source.prepared, peak_bytes=peak_bytes(device) if budgeted else 0
    )
    source = dataclasses.replace(source, prepared=prepared)
    said = prepared.describe(len(source.train.data) + len(source.val.data), source.unit)
    if said:
        note(said)
    if cfg.data is not None and cfg.val_data is None and "val_fraction" not in checked.given:
        note(held_out_warning(source, cfg.val_fraction))
    return Data(tokenizer, source, time.perf_counter() - started)
