"""A run's training stream over token sequences: documents and records in one buffer.

* A **document** (a text file, a ``{"text"}`` record) is language modelling on every token.
  The stream cuts it into spans of 2..seq_len+1 tokens; consecutive spans overlap by one
  token, so every next-token transition inside a document is a target exactly once. Spans
  never cross documents: without a boundary-aware attention kernel a packed row would let
  one document attend to another.
* A **record** (``{"prompt", "completion"}``, ``{"messages"}``) is one sequence, one row,
  trained only where its mask says. A record of more than seq_len + 1 tokens keeps its
  last seq_len + 1 (cut from the left: the prompt, or a conversation's first turns); one
  whose cut would remove a trainable token is left out, and both are counted.

A span ``(start, n)`` gives the row ``input_ids = ids[start : start+n-1]`` and
``labels[t] = ids[start+t+1]`` where that token is trainable, else -100: labels are
pre-shifted, and padding (right) is masked by the labels, never by a pad id (EOS, which
every document and completion ends with, may be the tokenizer's pad token too).

The buffer holds the tokenizer's ids, or UTF-8 bytes for the demo GPT
(:class:`~gradstep_cli.data.records.Encoder` makes them). :class:`TrainBatches` is the
resumable, rank-sharded stream over it, :func:`validation_batches` the fixed evaluation set.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gradstep_cli.data.records import BadRecords, DataError, Encoded

__all__ = [
    "FULL_FRAC",
    "IGNORE_INDEX",
    "PAD_ID",
    "Batch",
    "Document",
    "Sequences",
    "Side",
    "TextSource",
    "TrainBatches",
    "plural_records",
    "validation_batches",
]

Batch = dict[str, torch.Tensor]

IGNORE_INDEX = -100
PAD_ID = 0
FULL_FRAC = 0.75  # share of training spans of full length; the rest random, 2..seq_len+1
DATA_CHANGED = (
    ": the training data is not the checkpoint's (other files or records, another tokenizer, "
    "--val-data, --val-fraction or --skip-bad-records); resume with the run's own data"
)


@dataclass(frozen=True)
class Document:
    """One file's bytes; ``name`` is its path relative to the corpus root."""

    name: str
    data: bytes


class Sequences:
    """Documents and records in one buffer; builds the stream's spans and batches."""

    def __init__(
        self,
        documents: Sequence[np.ndarray],
        records: Sequence[Encoded] = (),
        dtype: type = np.int32,
    ) -> None:
        parts = [np.asarray(d, dtype=dtype) for d in documents]
        parts += [np.asarray(r.ids, dtype=dtype) for r in records]
        doc_lengths = np.array([len(d) for d in documents], dtype=np.int64)
        self.doc_offsets = np.concatenate(([0], np.cumsum(doc_lengths)))
        self.ids = np.concatenate(parts) if parts else np.empty(0, dtype=dtype)
        # None: every token is a target (documents only), the common and cheap case.
        self.trainable: np.ndarray | None = None
        rec_lengths = np.array([len(r.ids) for r in records], dtype=np.int64)
        starts = self.doc_offsets[-1] + np.concatenate(([0], np.cumsum(rec_lengths)))[:-1]
        # First target of each record: a cut from the left may remove tokens before it only.
        first = np.array([r.first_target() for r in records], dtype=np.int64)
        self.records = np.stack([starts, rec_lengths, first], axis=1).reshape(-1, 3)
        if records:
            self.trainable = np.ones(len(self.ids), dtype=bool)
            for start, record in zip(starts.tolist(), records, strict=True):
                self.trainable[start : start + len(record.ids)] = record.trainable
        self._digest: str | None = None

    @property
    def n_documents(self) -> int:
        return len(self.doc_offsets) - 1

    @property
    def n_records(self) -> int:
        return len(self.records)

    def __len__(self) -> int:
        """Tokens in the buffer."""
        return len(self.ids)

    def digest(self) -> str:
        """A fingerprint of the tokens, masks and boundaries: the same data, the same stream."""
        if self._digest is None:
            h = hashlib.blake2b(digest_size=12)
            for part in (self.ids, self.doc_offsets, self.records, self.trainable):
                if part is not None:
                    h.update(np.ascontiguousarray(part).tobytes())
            self._digest = h.hexdigest()
        return self._digest

    def chunks(self, seq_len: int, rng: np.random.Generator | None, full_frac: float) -> np.ndarray:
        """Every document cut into ``(start, length)`` spans of 2..seq_len+1 tokens.

        A span is full length with probability ``full_frac``, else of a random length
        (variable lengths are where a token-weighted step matters). Without ``rng`` every
        span is full length (validation). Documents end mid-span.
        """
        spans = []
        for doc in range(self.n_documents):
            pos, end = int(self.doc_offsets[doc]), int(self.doc_offsets[doc + 1])
            while end - pos >= 2:
                length = seq_len + 1
                if rng is not None and rng.random() >= full_frac:
                    length = int(rng.integers(2, seq_len + 2))
                length = min(length, end - pos)
                spans.append((pos, length))
                pos += length - 1
        return np.array(spans, dtype=np.int64).reshape(-1, 2)

    def _cuts(self, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens cut from each record's left to fit, and whether it keeps every target."""
        start, length, first = self.records.T
        cut = np.maximum(0, length - (seq_len + 1))
        return cut, cut < first  # a target needs the token before it: keep index first-1

    def record_spans(self, seq_len: int) -> np.ndarray:
        """One span per record that fits ``seq_len`` (cut from the left when longer)."""
        cut, keep = self._cuts(seq_len)
        start, length, _ = self.records.T
        return np.stack([start + cut, length - cut], axis=1)[keep].reshape(-1, 2)

    def fit(self, seq_len: int) -> tuple[int, int]:
        """(records cut from the left to fit ``seq_len``, records left out: too long)."""
        cut, keep = self._cuts(seq_len)
        return int(((cut > 0) & keep).sum()), int((~keep).sum())

    def spans(self, seq_len: int, rng: np.random.Generator | None, full_frac: float) -> np.ndarray:
        """Documents' chunks, then records' spans: one item per row of the stream."""
        return np.concatenate([self.chunks(seq_len, rng, full_frac), self.record_spans(seq_len)])

    def batch(self, spans: np.ndarray) -> Batch:
        """The rows of ``spans``, right-padded: ``input_ids`` (pad 0) and shifted ``labels``."""
        width = int(spans[:, 1].max()) - 1
        input_ids = np.full((len(spans), width), PAD_ID, dtype=np.int64)
        labels = np.full((len(spans), width), IGNORE_INDEX, dtype=np.int64)
        for row, (s, n) in enumerate(spans.tolist()):
            input_ids[row, : n - 1] = self.ids[s : s + n - 1]
            targets = self.ids[s + 1 : s + n].astype(np.int64)
            if self.trainable is not None:
                targets[~self.trainable[s + 1 : s + n]] = IGNORE_INDEX
            labels[row, : n - 1] = targets
        return {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels)}


def _sequences(data: Sequence[Document] | Sequences) -> Sequences:
    """Byte documents as a :class:`Sequences` (what the stream reads); one as is."""
    if isinstance(data, Sequences):
        return data
    return Sequences([np.frombuffer(d.data, dtype=np.uint8) for d in data], dtype=np.uint8)


class TrainBatches(Iterator[Batch]):
    """Infinite, seeded stream of training micro-batches; resumable and rank-sharded.

    Each epoch re-chunks every document with random lengths, adds one row per record, and
    shuffles them, using a generator seeded by ``(seed, epoch)``. Incomplete trailing
    micro-batches are dropped so every micro-batch has ``micro_batch_size`` rows.
    ``state_dict()`` is the position of the next micro-batch this rank will yield.
    """

    def __init__(
        self,
        docs: Sequence[Document] | Sequences,
        seq_len: int,
        micro_batch_size: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        full_frac: float = FULL_FRAC,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.seq_len, self.micro_batch_size, self.seed = seq_len, micro_batch_size, seed
        self.rank, self.world_size, self.full_frac = rank, world_size, full_frac
        self._data = _sequences(docs)
        self.epoch, self.index = 0, rank
        self._plan_epoch: int | None = None
        self._plan = np.empty((0, micro_batch_size, 2), dtype=np.int64)
        self._epoch_plan(0)  # too little data is an error now, not at the first step

    def _epoch_plan(self, epoch: int) -> np.ndarray:
        """Micro-batches of epoch ``epoch`` as ``(n, micro_batch_size, 2)`` spans (cached)."""
        if self._plan_epoch != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            spans = self._data.spans(self.seq_len, rng, self.full_frac)
            spans = spans[rng.permutation(len(spans))]
            n = len(spans) // self.micro_batch_size
            if n < self.world_size:
                rows, smaller = len(spans), " or a smaller --micro-batch-size"
                raise DataError(
                    f"training data yields {plural(rows, 'sequence')} per epoch, {n} "
                    f"micro-batches of {self.micro_batch_size}: fewer than the "
                    f"{self.world_size} needed (one per data-parallel rank); use more data"
                    + (smaller if self.micro_batch_size > 1 else "")
                )
            self._plan = spans[: n * self.micro_batch_size].reshape(n, self.micro_batch_size, 2)
            self._plan_epoch = epoch
        return self._plan

    def __next__(self) -> Batch:
        plan = self._epoch_plan(self.epoch)
        while self.index >= len(plan):  # carry the stride over the epoch boundary
            self.index -= len(plan)
            self.epoch += 1
            plan = self._epoch_plan(self.epoch)
        batch = self._data.batch(plan[self.index])
        self.index += self.world_size
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Position of the next micro-batch, plus what must match for it to mean the same."""
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "rank": self.rank,
            "world_size": self.world_size,
            "seq_len": self.seq_len,
            "micro_batch_size": self.micro_batch_size,
            "data_bytes": len(self._data),  # tokens, for tokenized data (the name is older)
            "data_digest": self._data.digest(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position, on any rank of any world size.

        Ranks consume micro-batches in lockstep, so any rank's saved ``index`` minus its
        ``rank`` is the GLOBAL position of the next micro-batch no rank has taken yet
        (``index`` may run past the epoch's end; ``__next__`` carries it over). This rank
        continues at that position plus its own rank: a run saved on W ranks resumes on W'
        without repeating or skipping a micro-batch. Refuses a differently built stream
        (other data, tokenizer, split or records: the digest of its tokens differs).
        """
        mine = self.state_dict()
        for key in ("seed", "seq_len", "micro_batch_size", "data_bytes", "data_digest"):
            if state.get(key, mine[key]) != mine[key]:
                why = DATA_CHANGED if key.startswith("data_") else ""
                raise ValueError(
                    f"data state mismatch for {key!r}: saved {state[key]}, now {mine[key]}{why}"
                )
        position = int(state["index"]) - int(state.get("rank", 0))
        self.epoch, self.index = int(state["epoch"]), position + self.rank


def validation_batches(
    docs: Sequence[Document] | Sequences,
    seq_len: int,
    micro_batch_size: int,
    num_batches: int,
    rank: int = 0,
    world_size: int = 1,
) -> list[Batch]:
    """A fixed list of validation micro-batches (this rank's stride of them).

    Document spans are full length (documents still end mid-span), records are one row
    each; all are shuffled with a fixed, seed-independent generator, so validation loss is
    comparable across runs and seeds while covering many files, not just the first few.
    """
    data = _sequences(docs)
    spans = data.spans(seq_len, None, 1.0)
    spans = spans[np.random.default_rng(0).permutation(len(spans))]
    groups = [
        spans[i : i + micro_batch_size]
        for i in range(0, min(len(spans), num_batches * micro_batch_size), micro_batch_size)
    ]
    return [data.batch(g) for g in groups[rank::world_size]]


def plural(n: int, word: str) -> str:
    """``"1 record"``, ``"2 records"``."""
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def plural_records(n: int) -> str:
    return plural(n, "record")


@dataclass(frozen=True)
class Side:
    """One side of the run's data (training or validation), tokenized."""

    data: Sequences
    files: int
    """Text files (0 for JSONL)."""
    kinds: dict[str, int]
    """JSONL records kept, by kind."""
    no_target: int
    """JSONL records left out: not one token to train on."""

    def describe(self, role: str, unit: str) -> str:
        if not self.kinds:
            return f"{self.files} {role} docs ({len(self.data):,} {unit})"
        kinds = ", ".join(f"{n:,} {kind}" for kind, n in self.kinds.items())
        total = sum(self.kinds.values())
        return f"{total:,} {role} records ({kinds}; {len(self.data):,} {unit})"


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
    """JSONL records skipped with ``--skip-bad-records`` (both arguments)."""
    held: str = ""
    """What ``--val-fraction`` held out, appended to a refusal of the training side."""

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
        self, seq_len: int, rows: int, seed: int, rank: int, world_size: int
    ) -> TrainBatches:
        """This rank's resumable stream of training micro-batches of ``rows`` sequences."""
        return TrainBatches(self.train.data, seq_len, rows, seed, rank, world_size)

    def validation_batches(
        self, seq_len: int, rows: int, num_batches: int, rank: int, world_size: int
    ) -> list[Batch]:
        return validation_batches(self.val.data, seq_len, rows, num_batches, rank, world_size)

    def lengths(self, seq_len: int, seed: int = 0) -> np.ndarray:
        """Positions of every row of one training epoch (its order aside): the real
        lengths a memory plan can probe with."""
        rng = np.random.default_rng([seed, 0])
        return self.train.data.spans(seq_len, rng, FULL_FRAC)[:, 1] - 1
