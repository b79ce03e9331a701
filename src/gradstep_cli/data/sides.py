"""The run's data as the later stages see it: its training and validation sides
(:class:`Side`), and :class:`TextSource`, which cuts the training stream and the validation
batches from them and says, in one line, what trains, what validates and what was left out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradstep_cli.data.records import BadRecords
from gradstep_cli.data.tokenized import FULL_FRAC, Sequences, TrainBatches, plural_records
from gradstep_cli.data.validation import ValidationBatches, validation_batches

__all__ = ["Prepared", "Side", "TextSource"]


@dataclass(frozen=True)
class Side:
    """One side of the run's data (training or validation), tokenized."""

    data: Sequences
    files: int
    """Text files (0 for records)."""
    kinds: dict[str, int]
    """Records kept, by kind."""
    no_target: int
    """Records left out: not one token to train on."""

    def describe(self, role: str, unit: str) -> str:
        if not self.kinds:
            return f"{self.files} {role} docs ({len(self.data):,} {unit})"
        kinds = ", ".join(f"{n:,} {kind}" for kind, n in self.kinds.items())
        total = sum(self.kinds.values())
        return f"{total:,} {role} records ({kinds}; {len(self.data):,} {unit})"


@dataclass(frozen=True)
class Prepared:
    """How the data stage came by the tokens: built now or reused, where, how long."""

    store: str = ""
    """The token store's folder ("": built in memory)."""
    reused: bool = False
    seconds: float = 0.0
    """Tokenization time when built now (0 when reused)."""
    built: str = ""
    """When the store was built (ISO time)."""
    notes: tuple[str, ...] = ()
    """Notes about the data, said on every run that reads it (e.g. --val-data overlap)."""
    peak_bytes: int = 0
    """The process's peak while the data stage ran (CPU, with a memory budget; else 0)."""

    def describe(self, tokens: int, unit: str) -> str:
        if not self.store:
            return ""
        if self.reused:
            return (
                f"data: reused the token store {self.store} (built {self.built}; nothing tokenized)"
            )
        return f"data: tokenized {tokens:,} {unit} in {self.seconds:.1f}s into {self.store}"


@dataclass(frozen=True)
class TextSource:
    """The run's data: where its training stream and validation batches come from."""

    train: Side
    val: Side
    source: str
    """``--data`` (or the default corpus)."""
    val_source: str | None
    """``--val-data``; None: held out of ``--data``."""
    seq_len: int
    """The run's ``--seq-len``: what the counts of cut and left-out records are for."""
    unit: str
    """"bytes" (the demo GPT) or "tokens"."""
    bad: BadRecords
    """Records skipped with ``--skip-bad-records`` (both arguments)."""
    held: str = ""
    """What ``--val-fraction`` held out, appended to a refusal of the training side."""
    prepared: Prepared = field(default_factory=Prepared)

    def counts(self) -> dict[str, Any]:
        """What was read, kept and left out, by number (for summaries and tests)."""
        fits = [side.data.fit(self.seq_len) for side in (self.train, self.val)]
        return {
            "unit": self.unit,
            "train_tokens": len(self.train.data),
            "val_tokens": len(self.val.data),
            "train_records": dict(self.train.kinds),
            "val_records": dict(self.val.kinds),
            "truncated": sum(cut for cut, _ in fits),
            "too_long": sum(out for _, out in fits),
            "no_target": self.train.no_target + self.val.no_target,
            "bad_skipped": self.bad.count,
        }

    def describe(self) -> str:
        """One line: what trains, what validates, and every record cut or left out."""
        val = self.val.describe("val", self.unit)
        line = f"{self.source}: {self.train.describe('train', self.unit)}, "
        line += f"{val} from {self.val_source}" if self.val_source else val
        n, seq = self.counts(), self.seq_len
        if n["truncated"]:
            line += f"; {plural_records(n['truncated'])} cut from the left to fit --seq-len {seq}"
        if n["too_long"]:
            line += (
                f"; {plural_records(n['too_long'])} left out as too long: their targets alone need "
                f"more than --seq-len {seq} positions (raise --seq-len)"
            )
        if n["no_target"]:
            line += f"; {plural_records(n['no_target'])} left out: no token to train on"
        if self.bad.count:
            line += (
                f"; {plural_records(self.bad.count)} skipped as bad (first: {self.bad.examples[0]})"
            )
        return line

    def train_batches(
        self, seq_len: int, rows: int, seed: int, rank: int, world_size: int, packing: bool = False
    ) -> TrainBatches:
        """This rank's resumable stream of training micro-batches of ``rows`` sequences
        (``packing``: of ``rows`` rows of ``seq_len`` positions, whole sequences packed)."""
        return TrainBatches(self.train.data, seq_len, rows, seed, rank, world_size, packing=packing)

    def validation_batches(
        self, seq_len: int, rows: int, num_batches: int | None, rank: int, world_size: int
    ) -> ValidationBatches:
        return validation_batches(self.val.data, seq_len, rows, num_batches, rank, world_size)

    def lengths(self, seq_len: int, seed: int = 0) -> np.ndarray:
        """Positions of every row of one training epoch (its order aside): the real
        lengths a memory plan can probe with."""
        rng = np.random.default_rng([seed, 0])
        return self.train.data.spans(seq_len, rng, FULL_FRAC)[:, 1] - 1
