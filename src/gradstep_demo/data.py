"""The demo trainer's data: text files and JSONL records, read, split and batched.

``--data`` names text files (a file, a folder searched recursively, or a glob) or JSONL
files of records (:mod:`.records`); one argument holds one kind. Text is UTF-8 bytes for
the demo GPT, or the HF model's tokens (:mod:`.tokenized`: documents end with EOS, records
train on their completion or assistant turns only). Validation is ``--val-data``, or
``--val-fraction`` of ``--data`` held out: whole files for text, records for JSONL.

Design points, each there because the optimizer step depends on it:

* **Variable-length sequences.** Chunks have random lengths and documents end mid-chunk, so
  micro-batches carry different numbers of real tokens. That is exactly the case where
  averaging per-micro-batch mean losses is wrong and the exact token-weighted step matters.
* **Labels are pre-shifted and padded with -100**: ``labels[t]`` is the target of input
  position ``t``; the loss never shifts and never counts padding or a prompt.
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
import math
import os
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .records import BadRecords, DataError, Encoder, Record, read_jsonl
from .tokenized import (
    IGNORE_INDEX,
    PAD_ID,
    Batch,
    Document,
    Sequences,
    Side,
    TextSource,
    TrainBatches,
    plural_records,
    validation_batches,
)

__all__ = [
    "IGNORE_INDEX",
    "PAD_ID",
    "Batch",
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

# ~3 MB of stdlib source: enough text that the demo does not memorise it in a few minutes,
# small enough to load in well under a second.
DEFAULT_CORPUS_BYTES = 3_000_000
# Huge files are mostly data tables (pydoc topics, codecs); they would dominate the corpus.
MAX_DEFAULT_FILE_BYTES = 200_000
SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "__pycache__", "encodings", "pydoc_data"}
)
VAL_BUCKETS = 10  # --val-fraction 0.1: one file in ten (by path hash) is validation
JSONL = ".jsonl"


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


def _read_text_file(path: Path, flag: str = "--data") -> bytes | str:
    """The bytes of a UTF-8 text file, or why it is skipped: "binary", "not UTF-8", "empty"."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"{flag}: cannot read {str(path)!r}: {exc.strerror or exc}") from None
    if not data:
        return "empty"
    if b"\x00" in data:  # NUL anywhere: binary, not text to train on
        return "binary (NUL bytes)"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8 text"
    return data


def _none_usable(source: str, skipped: dict[str, list[str]], flag: str = "--data") -> DataError:
    """The error for data with no usable file: why each kind of file was skipped."""
    if not skipped:
        return DataError(f"{flag} {source!r}: no files found (hidden ones are skipped)")
    reasons = "; ".join(
        f"{len(names)} files are {why}, e.g. {names[0]!r}"
        if len(names) > 1
        else f"{names[0]!r} is {why}"
        for why, names in skipped.items()
    )
    return DataError(
        f"{flag} {source!r}: no non-empty UTF-8 text files found ({reasons}); give text files"
    )


def _user_files(spec: str, flag: str = "--data") -> tuple[Path, list[Path]]:
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
        raise DataError(f"{flag} {spec!r}: no such file or folder")
    return root, paths


def _unit(key: str) -> float:
    """A stable pseudo-random number in [0, 1) for ``key``: below ``fraction`` is validation.

    Its first decimal digit is the path hash mod 10, so ``--val-fraction 0.1`` holds out
    exactly the files it always did (hash mod 10 == 0); the rest of the hash fills in the
    digits that other fractions need.
    """
    h = _path_hash(key)
    return (h % VAL_BUCKETS + (h // VAL_BUCKETS % 10**9) / 10**9) / VAL_BUCKETS


def _held_out(keys: Sequence[str], fraction: float) -> list[bool]:
    """Which items are validation: ``fraction`` of them by hash of their key; when that picks
    none (or all), the one with the smallest hash alone."""
    is_val = [_unit(k) < fraction for k in keys]
    if not any(is_val) or all(is_val):
        smallest = min(range(len(keys)), key=lambda i: _path_hash(keys[i]))
        is_val = [i == smallest for i in range(len(keys))]
    return is_val


def _split_by_file(
    docs: list[Document], fraction: float = 1 / VAL_BUCKETS
) -> tuple[list[Document], list[Document]]:
    """Put ``fraction`` of the files (by path hash) into validation, never part of a file.

    A single file cannot be split by file, so its last ``fraction`` is validation.
    """
    if len(docs) == 1:
        data = docs[0].data
        cut = max(1, len(data) - max(math.floor(len(data) * fraction), 2))
        return [Document(docs[0].name, data[:cut])], [Document(docs[0].name + "#val", data[cut:])]
    is_val = _held_out([d.name for d in docs], fraction)
    train = [d for d, v in zip(docs, is_val, strict=True) if not v]
    val = [d for d, v in zip(docs, is_val, strict=True) if v]
    return train, val


def _text_files(
    root: Path, paths: Sequence[Path], source: str, flag: str = "--data"
) -> list[Document]:
    """The usable text files among ``paths``; none usable is an error saying why."""
    docs, skipped = [], {}
    for path in paths:
        content = _read_text_file(path, flag)
        name = path.relative_to(root).as_posix()
        if isinstance(content, str):
            skipped.setdefault(content, []).append(name)
        else:
            docs.append(Document(name, content))
    if not docs:
        raise _none_usable(source, skipped, flag)
    return docs


def load_corpus(data: str | None = None, max_bytes: int = DEFAULT_CORPUS_BYTES) -> Corpus:
    """Load the default stdlib corpus (``data=None``) or the user's text files, split by file.

    ``max_bytes`` caps only the default corpus; user data is loaded in full.
    """
    if data is None:
        root, paths = default_corpus_files(max_bytes)
        source = f"stdlib {root}"
    else:
        root, paths = _user_files(data)
        source = data
    train, val = _split_by_file(_text_files(root, paths, source))
    return Corpus(train=train, val=val, source=source)


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


@dataclass
class _Read:
    """What one ``--data`` / ``--val-data`` argument holds, before tokenization."""

    source: str
    docs: list[Document]
    """Text files (none when the argument names JSONL files)."""
    records: list[Record]
    bad: BadRecords


def _read(spec: str | None, flag: str, skip_bad: bool) -> _Read:
    """Read the text files or JSONL files ``spec`` names (None: the default corpus)."""
    if spec is None:
        root, paths = default_corpus_files()
        return _Read(f"stdlib {root}", _text_files(root, paths, f"stdlib {root}"), [], BadRecords())
    root, paths = _user_files(spec, flag)
    jsonl = [p for p in paths if p.name.endswith(JSONL)]
    if jsonl and len(jsonl) < len(paths):
        other = next(p for p in paths if not p.name.endswith(JSONL))
        folder = spec if Path(spec).is_dir() else "DIR"
        raise DataError(
            f"{flag} {spec!r} holds both JSONL files ({jsonl[0].relative_to(root)}) and text "
            f"files ({other.relative_to(root)}): one argument reads one kind; name the kind "
            f"you mean, e.g. with a glob ('{Path(folder) / '**' / '*.jsonl'}')"
        )
    if not jsonl:
        return _Read(spec, _text_files(root, paths, spec, flag), [], BadRecords())
    bad, records = BadRecords(), []
    for path in jsonl:
        name = path.relative_to(root).as_posix() if len(paths) > 1 else str(path)
        records += read_jsonl(path, name, flag, skip_bad, bad)
    if not records:
        raise DataError(
            f"{flag} {spec!r}: no usable records"
            + (f" ({bad.count} bad, e.g. {bad.examples[0]})" if bad.count else "")
        )
    return _Read(spec, [], records, bad)


def _split(read: _Read, fraction: float) -> tuple[_Read, _Read]:
    """Hold out ``fraction`` of ``read`` for validation: whole files, or records."""
    if read.docs:
        train, val = _split_by_file(read.docs, fraction)
        return _Read(read.source, train, [], read.bad), _Read(read.source, val, [], BadRecords())
    is_val = _held_out([r.line for r in read.records], fraction)
    sides: tuple[list[Record], list[Record]] = ([], [])
    for record, held in zip(read.records, is_val, strict=True):
        sides[held].append(record)
    return _Read(read.source, [], sides[0], read.bad), _Read(
        read.source, [], sides[1], BadRecords()
    )


def _encode(read: _Read, encoder: Encoder, flag: str, skip_bad: bool) -> Side:
    """One side's text files or records as tokens (or bytes) in one buffer."""
    if read.docs:
        docs = encoder.documents([d.data.decode("utf-8") for d in read.docs])
        return Side(Sequences(docs, dtype=encoder.dtype), len(read.docs), {}, 0)
    out = encoder.encode(read.records, flag, skip_bad, read.bad)
    data = Sequences(out.documents, out.records, dtype=encoder.dtype)
    return Side(data, 0, out.kinds, out.no_target)


def _check_fits(side: Side, what: str, seq_len: int) -> None:
    """A side with no row at ``seq_len`` is an error saying why (not an empty stream)."""
    if len(side.data.spans(seq_len, None, 1.0)):
        return
    _, too_long = side.data.fit(seq_len)
    reasons = []
    if too_long:
        reasons.append(
            f"{plural_records(too_long)} too long: their targets alone need more than --seq-len "
            f"{seq_len} positions (raise --seq-len)"
        )
    if side.no_target:
        reasons.append(f"{plural_records(side.no_target)} with no token to train on")
    empty = not side.data.n_documents and not side.data.n_records
    short = "its text is under 2 tokens: no micro-batches can be made; use more data"
    why = "; ".join(reasons) or ("no record is left" if empty else short)
    raise DataError(f"{what}: no sequence to use ({why})")


def _check_template(read: _Read, encoder: Encoder, flag: str) -> None:
    """Conversations the tokenizer cannot train on: an error at the first one in the files."""
    chat = next((r for r in read.records if r.kind == "messages"), None)
    if chat is not None:
        encoder.check_template(f"{flag} {chat.where}")


def load_source(cfg: Any, tokenizer: Any = None) -> TextSource:
    """The data ``cfg`` names (``--data``, ``--val-data`` or ``--val-fraction`` held out),
    read as bytes for the demo GPT (``tokenizer`` None) or tokenized with the HF model's
    tokenizer. Bad input raises :class:`DataError` naming the flag, file and line."""
    skip, encoder = cfg.skip_bad_records, Encoder(tokenizer)
    train = _read(cfg.data, "--data", skip)
    _check_template(train, encoder, "--data")
    if cfg.val_data is None:
        train, val = _split(train, cfg.val_fraction)
    else:
        val = _read(cfg.val_data, "--val-data", skip)
        _check_template(val, encoder, "--val-data")
    val_flag = "--val-data" if cfg.val_data else "--data"
    sides = _encode(train, encoder, "--data", skip), _encode(val, encoder, val_flag, skip)
    bad = BadRecords(train.bad.count + val.bad.count, [*train.bad.examples, *val.bad.examples])
    source = TextSource(*sides, train.source, cfg.val_data, cfg.seq_len, encoder.unit, bad)
    _check_fits(source.train, f"--data {train.source!r}", cfg.seq_len)
    held_out = f"the --val-fraction {cfg.val_fraction} of --data {train.source!r} held out"
    _check_fits(source.val, f"--val-data {val.source!r}" if cfg.val_data else held_out, cfg.seq_len)
    return source
