"""A run's data: text files and JSONL records, read, split and batched.

``--data`` names text files (a file, a folder searched recursively, or a glob:
:mod:`.data_files`) or JSONL files of records (:mod:`.records`); one argument holds one
kind. Text is UTF-8 bytes for the demo GPT, or the HF model's tokens (:mod:`.tokenized`:
documents end with EOS, records train on their completion or assistant turns only).
Validation is ``--val-data``, or ``--val-fraction`` of ``--data`` held out: whole files for
text, records for JSONL, at least one on each side (:func:`_held_out`).

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

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradstep_cli.config.preflight import note
from gradstep_cli.data.files import (
    DEFAULT_CORPUS_BYTES,
    default_corpus_files,
    text_files,
    user_files,
)
from gradstep_cli.data.files import path_hash as _path_hash
from gradstep_cli.data.records import BadRecords, DataError, Encoder, Record, read_jsonl
from gradstep_cli.data.tokenized import (
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


def _unit(key: str) -> float:
    """A stable pseudo-random number in [0, 1) for ``key``: below ``fraction`` is validation.

    Its first decimal digit is the path hash mod 10, so ``--val-fraction 0.1`` holds out
    exactly the files it always did (hash mod 10 == 0); the rest of the hash fills in the
    digits that other fractions need.
    """
    h = _path_hash(key)
    return (h % VAL_BUCKETS + (h // VAL_BUCKETS % 10**9) / 10**9) / VAL_BUCKETS


def _held_out(keys: Sequence[str], fraction: float) -> list[bool]:
    """Which items are validation (docs/demo.md, ``--val-fraction``): every distinct key
    whose :func:`_unit` is below ``fraction``, so copies stay together and an item's side
    never depends on the others. Each side keeps at least one key: when none falls below,
    the key of smallest hash is held out (as it always was); when all do, the key of
    largest unit (the one the fraction holds out last) trains. Needs two distinct keys."""
    units = {key: _unit(key) for key in keys}
    if len(units) < 2:
        raise ValueError(f"two distinct keys are needed to split, got {len(units)}")
    held = {key for key, unit in units.items() if unit < fraction}
    if not held:
        held = {min(units, key=_path_hash)}
    elif len(held) == len(units):
        held.discard(max(units, key=units.__getitem__))
    return [key in held for key in keys]


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


def load_corpus(data: str | None = None, max_bytes: int = DEFAULT_CORPUS_BYTES) -> Corpus:
    """Load the default stdlib corpus (``data=None``) or the user's text files, split by file.

    ``max_bytes`` caps only the default corpus; user data is loaded in full.
    """
    if data is None:
        root, paths = default_corpus_files(max_bytes)
        source = f"stdlib {root}"
    else:
        root, paths = user_files(data)
        source = data
    train, val = _split_by_file(text_files(root, paths, source))
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
        return _Read(f"stdlib {root}", text_files(root, paths, f"stdlib {root}"), [], BadRecords())
    root, paths = user_files(spec, flag)
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
        return _Read(spec, text_files(root, paths, spec, flag), [], BadRecords())
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


def _too_few(read: _Read, fraction: float) -> DataError:
    """The refusal for records that cannot go to both sides of the split."""
    n = len(read.records)
    held = f"{plural_records(n)}" if n == 1 else f"{plural_records(n)}, all copies of one"
    if read.bad.count:
        held += f" ({read.bad.count} more skipped as bad)"
    return DataError(
        f"--data {read.source!r} holds {held}: too few to split, since --val-fraction "
        f"{fraction:g} holds at least 1 record out for validation and at least 1 other must "
        "be left to train on (copies of a record stay on one side); give validation data "
        "with --val-data PATH (then nothing of --data is held out), or more records"
    )


def _split(read: _Read, fraction: float) -> tuple[_Read, _Read]:
    """Hold out ``fraction`` of ``read`` for validation: whole files, or records."""
    if read.docs:
        train, val = _split_by_file(read.docs, fraction)
        return _Read(read.source, train, [], read.bad), _Read(read.source, val, [], BadRecords())
    if len({r.line for r in read.records}) < 2:
        raise _too_few(read, fraction)
    is_val = _held_out([r.line for r in read.records], fraction)
    sides: tuple[list[Record], list[Record]] = ([], [])
    for record, held in zip(read.records, is_val, strict=True):
        sides[held].append(record)
    return _Read(read.source, [], sides[0], read.bad), _Read(
        read.source, [], sides[1], BadRecords()
    )


def _held(train: _Read, val: _Read, fraction: float) -> str:
    """What ``--val-fraction`` moved to validation, for an error about the training side."""
    if val.records:
        n, total = len(val.records), len(val.records) + len(train.records)
        what = f"{n:,} of the {total:,} records"
    elif len(val.docs) == 1 and val.docs[0].name.endswith("#val"):
        n, total = len(val.docs[0].data), len(val.docs[0].data) + len(train.docs[0].data)
        what = f"the last {n:,} of its {total:,} bytes"
    else:
        what = f"{len(val.docs)} of the {len(val.docs) + len(train.docs)} files"
    return (
        f"; --val-fraction {fraction:g} held {what} out for validation: give more data, a "
        "smaller --val-fraction, or validation data with --val-data PATH"
    )


def _encode(read: _Read, encoder: Encoder, flag: str, skip_bad: bool) -> Side:
    """One side's text files or records as tokens (or bytes) in one buffer."""
    if read.docs:
        docs = encoder.documents([d.data.decode("utf-8") for d in read.docs])
        return Side(Sequences(docs, dtype=encoder.dtype), len(read.docs), {}, 0)
    out = encoder.encode(read.records, flag, skip_bad, read.bad)
    data = Sequences(out.documents, out.records, dtype=encoder.dtype)
    return Side(data, 0, out.kinds, out.no_target)


def _check_fits(side: Side, what: str, seq_len: int, held: str = "") -> None:
    """A side with no row at ``seq_len`` is an error saying why (not an empty stream).
    ``held``: what the split moved to the other side, said unless the fix is --seq-len."""
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
    raise DataError(f"{what}: no sequence to use ({why}){'' if too_long else held}")


def _check_template(read: _Read, encoder: Encoder, flag: str) -> None:
    """Conversations the tokenizer cannot train on: an error at the first one in the files."""
    chat = next((r for r in read.records if r.kind == "messages"), None)
    if chat is not None:
        encoder.check_template(f"{flag} {chat.where}")


def _overlap(train: _Read, val: _Read) -> str | None:
    """A note when ``--val-data`` repeats ``--data``: its loss would not be held out."""
    if val.records:
        seen, keys, unit = {r.line for r in train.records}, [r.line for r in val.records], "record"
    else:
        digest = lambda doc: hashlib.blake2b(doc.data, digest_size=16).digest()  # noqa: E731
        seen, keys, unit = {digest(d) for d in train.docs}, [digest(d) for d in val.docs], "file"
    shared = sum(key in seen for key in keys)
    if not shared:
        return None
    if shared == len(keys):
        which = f"every --val-data {unit} is"
    else:
        which = f"{shared:,} of the {len(keys):,} --val-data {unit}s are"
    return (
        f"note: {which} also in --data: the validation loss is measured on training data "
        "there and will not show overfitting; give held-out data as --val-data, or leave "
        "it out (--val-fraction then holds part of --data out)"
    )


def _bytes_why(cfg: Any) -> str | None:
    """Why the data is bytes, for a refusal of chat records (None: the demo GPT)."""
    if not getattr(cfg, "is_hf", False):
        return None
    return (
        f"model {cfg.model!r} has no tokenizer (no tokenizer files in its folder, no "
        "--tokenizer), so the data is read as bytes: pass --tokenizer PATH (a tokenizer "
        "folder with a chat template), or give text or prompt/completion records"
    )


def load_source(cfg: Any, tokenizer: Any = None) -> TextSource:
    """The data ``cfg`` names (``--data``, ``--val-data`` or ``--val-fraction`` held out),
    read as bytes for the demo GPT (``tokenizer`` None) or tokenized with the HF model's
    tokenizer. Bad input raises :class:`DataError` naming the flag, file and line."""
    skip, encoder = cfg.skip_bad_records, Encoder(tokenizer, _bytes_why(cfg))
    train = _read(cfg.data, "--data", skip)
    _check_template(train, encoder, "--data")
    held = ""
    if cfg.val_data is None:
        train, val = _split(train, cfg.val_fraction)
        held = _held(train, val, cfg.val_fraction)
    else:
        val = _read(cfg.val_data, "--val-data", skip)
        _check_template(val, encoder, "--val-data")
        overlap = _overlap(train, val)
        if overlap is not None:
            note(overlap)
    val_flag = "--val-data" if cfg.val_data else "--data"
    sides = _encode(train, encoder, "--data", skip), _encode(val, encoder, val_flag, skip)
    bad = BadRecords(train.bad.count + val.bad.count, [*train.bad.examples, *val.bad.examples])
    source = TextSource(*sides, train.source, cfg.val_data, cfg.seq_len, encoder.unit, bad, held)
    _check_fits(source.train, f"--data {train.source!r}", cfg.seq_len, held)
    if cfg.val_data is not None:
        _check_fits(source.val, f"--val-data {val.source!r}", cfg.seq_len)
        return source
    held_out = f"the --val-fraction {cfg.val_fraction} of --data {train.source!r} held out"
    more = "; give validation data with --val-data PATH, or more data"
    _check_fits(source.val, held_out, cfg.seq_len, more)
    return source
