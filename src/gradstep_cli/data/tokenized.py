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
(:class:`~gradstep_cli.data.records.Encoder` makes them), in memory or in a token store
on disk (:mod:`.store`), read a row at a time. :class:`TrainBatches` is the resumable,
rank-sharded stream over it (:mod:`.validation`: the fixed evaluation set).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradstep_cli.data.packed import PackedPlan, pack_epoch, packed_batch
from gradstep_cli.data.records import DataError, Encoded
from gradstep_cli.data.store import StoreFile

__all__ = [
    "FULL_FRAC",
    "IGNORE_INDEX",
    "PAD_ID",
    "Batch",
    "Document",
    "Sequences",
    "as_sequences",
    "TrainBatches",
    "plural_records",
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
    """Documents and records in one buffer; builds the stream's spans and batches.

    In memory (built from arrays, as here), or a side of a token store on disk
    (:meth:`stored`): then only the boundaries are in memory and each row is read when its
    batch is made."""

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
        self.ids: np.ndarray | StoreFile = (
            np.concatenate(parts) if parts else np.empty(0, dtype=dtype)
        )
        # None: every token is a target (documents only), the common and cheap case.
        self.trainable: np.ndarray | StoreFile | None = None
        rec_lengths = np.array([len(r.ids) for r in records], dtype=np.int64)
        starts = self.doc_offsets[-1] + np.concatenate(([0], np.cumsum(rec_lengths)))[:-1]
        # First target of each record: a cut from the left may remove tokens before it only.
        first = np.array([r.first_target() for r in records], dtype=np.int64)
        self.records = np.stack([starts, rec_lengths, first], axis=1).reshape(-1, 3)
        if records:
            self.trainable = np.ones(len(self.ids), dtype=bool)
            for start, record in zip(starts.tolist(), records, strict=True):
                self.trainable[start : start + len(record.ids)] = record.trainable
        self._tokens = len(self.ids)
        self._digest: str | None = None

    @classmethod
    def stored(cls, folder: Path, side: str, info: dict[str, Any], dtype: Any) -> Sequences:
        """One side of the token store in ``folder`` (its meta: ``info``)."""
        self = cls.__new__(cls)
        self.doc_offsets = np.load(folder / f"{side}.offsets.npy")
        self.records = np.load(folder / f"{side}.records.npy")
        self.ids = StoreFile(folder / f"{side}.ids", dtype)
        self.trainable = StoreFile(folder / f"{side}.mask", np.bool_) if info["mask"] else None
        self._tokens, self._digest = int(info["tokens"]), str(info["digest"])
        return self

    @property
    def n_documents(self) -> int:
        return len(self.doc_offsets) - 1

    @property
    def n_records(self) -> int:
        return len(self.records)

    def __len__(self) -> int:
        """Tokens in the buffer."""
        return self._tokens

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
        if rng is None:
            return self._full_chunks(seq_len)
        spans = array("q")  # 16 bytes a span: an epoch's plan of a large corpus stays small
        offsets, random, integers = self.doc_offsets.tolist(), rng.random, rng.integers
        for pos, end in zip(offsets[:-1], offsets[1:], strict=True):
            while end - pos >= 2:
                length = seq_len + 1
                if random() >= full_frac:
                    length = int(integers(2, seq_len + 2))
                length = min(length, end - pos)
                spans.append(pos)
                spans.append(length)
                pos += length - 1
        return np.frombuffer(spans, dtype=np.int64).reshape(-1, 2)

    def _full_chunks(self, seq_len: int) -> np.ndarray:
        """:meth:`chunks` without ``rng``: every span full length, computed at once."""
        starts, lengths = self.doc_offsets[:-1], np.diff(self.doc_offsets)
        per_doc = np.where(lengths >= 2, -(-(lengths - 1) // seq_len), 0)
        doc = np.repeat(np.arange(len(lengths)), per_doc)
        k = np.arange(len(doc)) - np.repeat(np.cumsum(per_doc) - per_doc, per_doc)
        pos = starts[doc] + k * seq_len
        length = np.minimum(seq_len + 1, starts[doc] + lengths[doc] - pos)
        return np.stack([pos, length], axis=1).astype(np.int64).reshape(-1, 2)

    def has_rows(self, seq_len: int) -> bool:
        """Whether :meth:`spans` yields any row at ``seq_len`` (without making them)."""
        return bool((np.diff(self.doc_offsets) >= 2).any() or self._cuts(seq_len)[1].any())

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

    def _read(self, part: np.ndarray | StoreFile, start: int, count: int) -> np.ndarray:
        if isinstance(part, StoreFile):
            return part.read(start, count)
        return part[start : start + count]

    def row(self, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The span ``(start, n)``: its ``n - 1`` input ids and shifted targets (-100 where
        the token is not trainable), as int64."""
        tokens = self._read(self.ids, start, n)
        targets = tokens[1:].astype(np.int64)
        if self.trainable is not None:
            targets[~self._read(self.trainable, start + 1, n - 1)] = IGNORE_INDEX
        return tokens[:-1].astype(np.int64), targets

    def batch(self, spans: np.ndarray) -> Batch:
        """The rows of ``spans``, right-padded: ``input_ids`` (pad 0) and shifted ``labels``."""
        width = int(spans[:, 1].max()) - 1
        input_ids = np.full((len(spans), width), PAD_ID, dtype=np.int64)
        labels = np.full((len(spans), width), IGNORE_INDEX, dtype=np.int64)
        for row, (s, n) in enumerate(spans.tolist()):
            input_ids[row, : n - 1], labels[row, : n - 1] = self.row(s, n)
        return {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels)}


def as_sequences(data: Sequence[Document] | Sequences) -> Sequences:
    """Byte documents as a :class:`Sequences` (what the stream reads); one as is."""
    if isinstance(data, Sequences):
        return data
    return Sequences([np.frombuffer(d.data, dtype=np.uint8) for d in data], dtype=np.uint8)


class TrainBatches(Iterator[Batch]):
    """Infinite, seeded stream of training micro-batches; resumable and rank-sharded.

    Each epoch re-chunks every document with random lengths, adds one row per record, and
    shuffles them, using a generator seeded by ``(seed, epoch)``, then cuts them into
    micro-batches of ``micro_batch_size`` rows in that order; the epoch's last micro-batch
    holds the rows left (fewer when they do not divide), so every row of an epoch trains
    exactly once (the exact step weights a micro-batch by its tokens, not its rows).
    ``packing=True``: the shuffled rows are whole spans packed into rows of ``seq_len``
    positions (:mod:`.packed`), and micro-batches are of ``micro_batch_size`` such rows.
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
        packing: bool = False,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.seq_len, self.micro_batch_size, self.seed = seq_len, micro_batch_size, seed
        self.rank, self.world_size, self.full_frac = rank, world_size, full_frac
        self.packing = packing
        self._padding = 0.0
        self._data = as_sequences(docs)
        self.epoch, self.index = 0, rank
        self._plan_epoch: int | None = None
        self._plan: list[np.ndarray] | PackedPlan = []
        self._epoch_plan(0)  # too little data is an error now, not at the first step

    def epoch_length(self, epoch: int) -> int:
        """Micro-batches of epoch ``epoch``, over all ranks (the last one may be short)."""
        return len(self._epoch_plan(epoch))

    def epoch_rows(self, epoch: int) -> int:
        """Rows of epoch ``epoch``: one per record, a document's chunks (packed: the rows
        they were packed into)."""
        plan = self._epoch_plan(epoch)
        return plan.rows if isinstance(plan, PackedPlan) else sum(len(batch) for batch in plan)

    def epoch_sequences(self, epoch: int) -> int:
        """Sequences (spans) of epoch ``epoch``: its rows' unpacked, the packed rows' parts."""
        plan = self._epoch_plan(epoch)
        return len(plan.spans) if isinstance(plan, PackedPlan) else self.epoch_rows(epoch)

    def padding(self, epoch: int = 0) -> float:
        """Share of epoch ``epoch``'s packed positions that are padding (0 unpacked)."""
        self._epoch_plan(epoch)
        return self._padding

    def _epoch_plan(self, epoch: int) -> list[np.ndarray] | PackedPlan:
        """Micro-batches of epoch ``epoch``, every span once (cached): ``(rows, 2)`` spans, or
        packed, a list of each row's spans."""
        if self._plan_epoch != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            spans = self._data.spans(self.seq_len, rng, self.full_frac)
            spans = spans[rng.permutation(len(spans))]
            mbs = self.micro_batch_size
            if self.packing:
                packed, self._padding = pack_epoch(spans, self.seq_len, rng, mbs)
            rows = packed.rows if self.packing else len(spans)
            n = rows // mbs  # full ones: one for every rank
            if n < self.world_size:
                smaller = " or a smaller --micro-batch-size"
                unit = "packed row" if self.packing else "sequence"
                raise DataError(
                    f"training data yields {plural(rows, unit)} per epoch, {n} "
                    f"micro-batches of {self.micro_batch_size}: fewer than the "
                    f"{self.world_size} needed (one per data-parallel rank); use more data"
                    + (smaller if self.micro_batch_size > 1 else "")
                )
            if self.packing:
                self._plan = packed
            else:
                self._plan = [spans[i : i + mbs] for i in range(0, len(spans), mbs)]
            self._plan_epoch = epoch
        return self._plan

    def __next__(self) -> Batch:
        plan = self._epoch_plan(self.epoch)
        while self.index >= len(plan):  # carry the stride over the epoch boundary
            self.index -= len(plan)
            self.epoch += 1
            plan = self._epoch_plan(self.epoch)
        item = plan[self.index]
        if self.packing:
            batch = packed_batch(self._data, item, self.seq_len)
        else:
            batch = self._data.batch(item)
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
            "packing": self.packing,
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
        for key in ("seed", "seq_len", "micro_batch_size", "packing", "data_bytes", "data_digest"):
            if state.get(key, mine[key]) != mine[key]:
                why = DATA_CHANGED if key.startswith("data_") else ""
                raise ValueError(
                    f"data state mismatch for {key!r}: saved {state[key]}, now {mine[key]}{why}"
                )
        position = int(state["index"]) - int(state.get("rank", 0))
        self.epoch, self.index = int(state["epoch"]), position + self.rank


def plural(n: int, word: str) -> str:
    """``"1 record"``, ``"2 records"``."""
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def plural_records(n: int) -> str:
    return plural(n, "record")
