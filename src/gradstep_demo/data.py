"""Byte-level text data for the demo trainer: corpus loading, chunking and batching.

Design points, each there because the optimizer step depends on it:

* **Variable-length sequences.** Chunks have random lengths and documents end mid-chunk, so
  micro-batches carry different numbers of real tokens. That is exactly the case where
  averaging per-micro-batch mean losses is wrong and the exact token-weighted step matters.
* **Labels are pre-shifted and padded with -100**: ``labels[t]`` is the target of input
  position ``t``; the loss never shifts and never counts padding.
* **Deterministic, resumable order.** The order of an epoch is a pure function of
  ``(seed, epoch)``, so the iterator's position is just ``(epoch, index)``; restoring it
  continues with exactly the micro-batch that would have come next.
* **Rank sharding by stride.** Rank ``r`` of ``W`` takes global micro-batches
  ``r, r + W, r + 2W, ...``: the union over ranks of one optimizer step (``accum_steps``
  micro-batches per rank) is the same set a single process sees with ``accum_steps * W``.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradstep.errors import GradstepError

__all__ = [
    "Corpus",
    "DataError",
    "Document",
    "TextSource",
    "TrainBatches",
    "collate",
    "default_corpus_files",
    "load_corpus",
    "load_source",
    "validation_batches",
]

Batch = dict[str, torch.Tensor]

IGNORE_INDEX = -100
PAD_ID = 0
# ~3 MB of stdlib source: enough text that the demo does not memorise it in a few minutes,
# small enough to load in well under a second.
DEFAULT_CORPUS_BYTES = 3_000_000
# Huge files are mostly data tables (pydoc topics, codecs); they would dominate the corpus.
MAX_DEFAULT_FILE_BYTES = 200_000
SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "__pycache__", "encodings", "pydoc_data"}
)
VAL_BUCKETS = 10  # one file in ten (by path hash) is validation


class DataError(GradstepError, ValueError):
    """The ``--data`` argument names nothing usable; the message says what was searched."""


@dataclass(frozen=True)
class Document:
    """One file's bytes; ``name`` is its path relative to the corpus root."""

    name: str
    data: bytes


@dataclass(frozen=True)
class Corpus:
    train: list[Document]
    val: list[Document]
    source: str

    def describe(self) -> str:
        n_train = sum(len(d.data) for d in self.train)
        n_val = sum(len(d.data) for d in self.val)
        return (
            f"{self.source}: {len(self.train)} train docs ({n_train:,} bytes), "
            f"{len(self.val)} val docs ({n_val:,} bytes)"
        )


def _path_hash(name: str) -> int:
    """Stable across processes and Python versions (unlike ``hash``)."""
    return int.from_bytes(hashlib.sha1(name.encode("utf-8")).digest()[:8], "big")


def default_corpus_files(max_bytes: int = DEFAULT_CORPUS_BYTES) -> tuple[Path, list[Path]]:
    """Pick the stdlib ``.py`` files of the default corpus; return ``(root, sorted files)``.

    Files are taken in order of a hash of their relative path (seed-independent, so every
    run on a machine uses the same corpus) until ``max_bytes`` is reached. Hash order rather
    than alphabetical order spreads the selection over the whole library.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    candidates = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so os.walk never descends into tests or site-packages.
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith("config-")]
        for filename in filenames:
            if not filename.endswith(".py") or filename.startswith("test_"):
                continue
            path = Path(dirpath, filename)
            size = path.stat().st_size
            if 0 < size <= MAX_DEFAULT_FILE_BYTES:
                rel = path.relative_to(root).as_posix()
                candidates.append((_path_hash(rel), rel, path, size))
    chosen, total = [], 0
    for _, _, path, size in sorted(candidates):
        if total + size > max_bytes:
            continue
        chosen.append(path)
        total += size
    return root, sorted(chosen, key=lambda p: p.relative_to(root).as_posix())


def _read_text_file(path: Path) -> bytes | str:
    """The bytes of a UTF-8 text file, or why it is skipped: "binary", "not UTF-8", "empty"."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"--data: cannot read {str(path)!r}: {exc.strerror or exc}") from None
    if not data:
        return "empty"
    if b"\x00" in data:  # NUL anywhere: binary, not text to train on
        return "binary (NUL bytes)"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8 text"
    return data


def _none_usable(source: str, skipped: dict[str, list[str]]) -> DataError:
    """The error for data with no usable file: why each kind of file was skipped."""
    if not skipped:
        return DataError(f"--data {source!r}: no files found (hidden ones are skipped)")
    reasons = "; ".join(
        f"{len(names)} files are {why}, e.g. {names[0]!r}"
        if len(names) > 1
        else f"{names[0]!r} is {why}"
        for why, names in skipped.items()
    )
    return DataError(
        f"--data {source!r}: no non-empty UTF-8 text files found ({reasons}); give text files"
    )


def _user_files(spec: str) -> tuple[Path, list[Path]]:
    """Resolve ``--data``: a file, a folder (recursive, hidden entries skipped) or a glob."""
    if not Path(spec).exists() and any(ch in spec for ch in "*?["):
        paths = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
        root = Path(os.path.commonpath([str(p.parent) for p in paths])) if paths else Path(".")
    elif Path(spec).is_dir():
        root = Path(spec)
        paths = sorted(
            p
            for p in root.rglob("*")
            if p.is_file() and not any(s.startswith(".") for s in p.relative_to(root).parts)
        )
    elif Path(spec).is_file():
        root, paths = Path(spec).parent, [Path(spec)]
    else:
        raise DataError(f"--data {spec!r}: no such file or folder")
    return root, paths


def _split_by_file(docs: list[Document]) -> tuple[list[Document], list[Document]]:
    """Put one file in ``VAL_BUCKETS`` (by path hash) into validation, never part of a file.

    With few files the hash rule may pick none (or all); then the file with the smallest hash
    is validation. A single file cannot be split by file, so its last tenth is validation.
    """
    if len(docs) == 1:
        data = docs[0].data
        cut = max(1, len(data) - max(len(data) // VAL_BUCKETS, 2))
        return [Document(docs[0].name, data[:cut])], [Document(docs[0].name + "#val", data[cut:])]
    is_val = [_path_hash(d.name) % VAL_BUCKETS == 0 for d in docs]
    if not any(is_val) or all(is_val):
        smallest = min(range(len(docs)), key=lambda i: _path_hash(docs[i].name))
        is_val = [i == smallest for i in range(len(docs))]
    train = [d for d, v in zip(docs, is_val, strict=True) if not v]
    val = [d for d, v in zip(docs, is_val, strict=True) if v]
    return train, val


def load_corpus(data: str | None = None, max_bytes: int = DEFAULT_CORPUS_BYTES) -> Corpus:
    """Load the default stdlib corpus (``data=None``) or the user's files, split by file.

    ``max_bytes`` caps only the default corpus; user data is loaded in full.
    """
    if data is None:
        root, paths = default_corpus_files(max_bytes)
        source = f"stdlib {root}"
    else:
        root, paths = _user_files(data)
        source = data
    docs, skipped = [], {}
    for path in paths:
        content = _read_text_file(path)
        name = path.relative_to(root).as_posix()
        if isinstance(content, str):
            skipped.setdefault(content, []).append(name)
        else:
            docs.append(Document(name, content))
    if not docs:
        raise _none_usable(source, skipped)
    train, val = _split_by_file(docs)
    return Corpus(train=train, val=val, source=source)


class _Packed:
    """All documents concatenated into one byte array plus per-document offsets."""

    def __init__(self, docs: Sequence[Document]) -> None:
        lengths = np.array([len(d.data) for d in docs], dtype=np.int64)
        self.offsets = np.concatenate(([0], np.cumsum(lengths)))
        self.buffer = np.frombuffer(b"".join(d.data for d in docs), dtype=np.uint8)

    def chunks(self, seq_len: int, rng: np.random.Generator | None, full_frac: float) -> np.ndarray:
        """Cut every document into ``(start, length)`` spans of 2..seq_len+1 bytes.

        Consecutive spans overlap by one byte so every next-byte transition inside a document
        is a target exactly once. Without ``rng`` spans are full length (validation).
        """
        spans = []
        for doc in range(len(self.offsets) - 1):
            pos, end = int(self.offsets[doc]), int(self.offsets[doc + 1])
            while end - pos >= 2:
                length = seq_len + 1
                if rng is not None and rng.random() >= full_frac:
                    length = int(rng.integers(2, seq_len + 2))
                length = min(length, end - pos)
                spans.append((pos, length))
                pos += length - 1
        return np.array(spans, dtype=np.int64).reshape(-1, 2)

    def batch(self, spans: np.ndarray) -> Batch:
        return collate([self.buffer[s : s + n] for s, n in spans.tolist()])


def collate(chunks: Sequence[np.ndarray | bytes]) -> Batch:
    """Right-pad byte chunks into ``input_ids`` (pad 0) and shifted ``labels`` (pad -100)."""
    width = max(len(c) for c in chunks) - 1
    input_ids = torch.full((len(chunks), width), PAD_ID, dtype=torch.long)
    labels = torch.full((len(chunks), width), IGNORE_INDEX, dtype=torch.long)
    for row, chunk in enumerate(chunks):
        ids = torch.as_tensor(np.frombuffer(bytes(chunk), dtype=np.uint8).astype(np.int64))
        input_ids[row, : len(ids) - 1] = ids[:-1]
        labels[row, : len(ids) - 1] = ids[1:]
    return {"input_ids": input_ids, "labels": labels}


class TrainBatches(Iterator[Batch]):
    """Infinite, seeded stream of training micro-batches; resumable and rank-sharded.

    Each epoch re-chunks every document with random lengths and shuffles the chunks, using a
    generator seeded by ``(seed, epoch)``. Incomplete trailing micro-batches are dropped so
    every micro-batch has ``micro_batch_size`` rows. ``state_dict()`` is the position of the
    next micro-batch this rank will yield.
    """

    def __init__(
        self,
        docs: Sequence[Document],
        seq_len: int,
        micro_batch_size: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        full_frac: float = 0.75,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.seq_len, self.micro_batch_size, self.seed = seq_len, micro_batch_size, seed
        self.rank, self.world_size, self.full_frac = rank, world_size, full_frac
        self._packed = _Packed(docs)
        self.epoch, self.index = 0, rank
        self._plan_epoch: int | None = None
        self._plan = np.empty((0, micro_batch_size, 2), dtype=np.int64)
        self._epoch_plan(0)  # too little data is an error now, not at the first step

    def _epoch_plan(self, epoch: int) -> np.ndarray:
        """Micro-batches of epoch ``epoch`` as ``(n, micro_batch_size, 2)`` spans (cached)."""
        if self._plan_epoch != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            spans = self._packed.chunks(self.seq_len, rng, self.full_frac)
            spans = spans[rng.permutation(len(spans))]
            n = len(spans) // self.micro_batch_size
            if n < self.world_size:
                raise DataError(
                    f"training data yields {n} micro-batches of {self.micro_batch_size} per "
                    f"epoch, fewer than world_size={self.world_size}; use more data"
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
        batch = self._packed.batch(plan[self.index])
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
            "data_bytes": int(self._packed.offsets[-1]),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position, on any rank of any world size.

        Ranks consume micro-batches in lockstep, so any rank's saved ``index`` minus its
        ``rank`` is the GLOBAL position of the next micro-batch no rank has taken yet
        (``index`` may run past the epoch's end; ``__next__`` carries it over). This rank
        continues at that position plus its own rank: a run saved on W ranks resumes on W'
        without repeating or skipping a micro-batch. Refuses a differently built stream.
        """
        for key in ("seed", "seq_len", "micro_batch_size", "data_bytes"):
            mine = self.state_dict()[key]
            if state.get(key, mine) != mine:
                raise ValueError(f"data state mismatch for {key!r}: saved {state[key]}, now {mine}")
        position = int(state["index"]) - int(state.get("rank", 0))
        self.epoch, self.index = int(state["epoch"]), position + self.rank


def validation_batches(
    docs: Sequence[Document],
    seq_len: int,
    micro_batch_size: int,
    num_batches: int,
    rank: int = 0,
    world_size: int = 1,
) -> list[Batch]:
    """A fixed list of validation micro-batches (this rank's stride of them).

    Spans are full length (documents still end mid-span) and shuffled with a fixed,
    seed-independent generator, so validation loss is comparable across runs and seeds
    while covering many files, not just the first few.
    """
    packed = _Packed(docs)
    spans = packed.chunks(seq_len, None, 1.0)
    spans = spans[np.random.default_rng(0).permutation(len(spans))]
    groups = [
        spans[i : i + micro_batch_size]
        for i in range(0, min(len(spans), num_batches * micro_batch_size), micro_batch_size)
    ]
    return [packed.batch(g) for g in groups[rank::world_size]]


@dataclass(frozen=True)
class TextSource:
    """The run's data: where its training stream and validation batches come from."""

    corpus: Corpus

    def describe(self) -> str:
        return self.corpus.describe()

    def train_batches(
        self, seq_len: int, rows: int, seed: int, rank: int, world_size: int
    ) -> TrainBatches:
        """This rank's resumable stream of training micro-batches of ``rows`` sequences."""
        return TrainBatches(self.corpus.train, seq_len, rows, seed, rank, world_size)

    def validation_batches(
        self, seq_len: int, rows: int, num_batches: int, rank: int, world_size: int
    ) -> list[Batch]:
        return validation_batches(self.corpus.val, seq_len, rows, num_batches, rank, world_size)


def load_source(cfg: Any, tokenizer: Any = None) -> TextSource:
    """The data ``cfg`` names (``--data``), read as bytes for the demo GPT (``tokenizer``
    None) or tokenized with the HF model's tokenizer."""
    return TextSource(load_corpus(cfg.data))
