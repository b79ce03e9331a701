"""The first pass over a run's data: every file and record checked (nothing tokenized),
then the validation split decided.

Checking everything before encoding anything keeps the order of the refusals a user meets:
a bad file or record first (named by file and line), then a chat template that cannot
train, then data too small to split. The split needs only a 64-bit hash per record (the
hash the split's rule reads), so it is decided in bounded memory however many records
there are.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gradstep_cli.data.files import none_usable, path_hash, scan_text_file
from gradstep_cli.data.formats import Bad, Fields, check
from gradstep_cli.data.records import SKIP_HINT, BadRecords, DataError, Encoder
from gradstep_cli.data.specs import Spec
from gradstep_cli.data.tokenized import plural_records

__all__ = ["Read", "TextDoc", "bounded_val", "held_mask", "overlap_note", "scan", "split"]

VAL_BUCKETS = 10


@dataclass(frozen=True)
class TextDoc:
    """A text document: bytes ``start:end`` of a file (a whole file, or one side of a
    single file's split)."""

    name: str
    path: Path
    start: int
    end: int
    digest: bytes = b""


@dataclass
class Read:
    """One argument, checked: its usable text files or records."""

    spec: Spec
    flag: str
    docs: list[TextDoc] = field(default_factory=list)
    hashes: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint64))
    """Records: the split's hash of each usable record, in order."""
    first_chat: str | None = None
    """Where the first conversation is (its template is checked there)."""
    bad: BadRecords = field(default_factory=BadRecords)

    @property
    def records(self) -> int:
        return len(self.hashes)


def _texts(spec: Spec, flag: str) -> list[TextDoc]:
    docs, skipped = [], {}
    for path in spec.texts:
        why, size, digest = scan_text_file(path, flag)
        if why is not None:
            skipped.setdefault(why, []).append(spec.name(path))
        else:
            docs.append(TextDoc(spec.name(path), path, 0, size, digest))
    if not docs:
        raise none_usable(spec.source, skipped, flag)
    return docs


def _records(read: Read, fields: Fields, skip: bool) -> None:
    hashes = array("Q")
    for part in read.spec.parts:
        for item in part.items():
            try:
                if item.bad is not None:
                    raise item.bad
                kind, _ = check(item.value, fields)
            except Bad as reason:
                if not skip:
                    raise DataError(f"{read.flag} {item.where}: {reason}; {SKIP_HINT}") from None
                read.bad.add(f"{item.where}: {reason}")
                continue
            hashes.append(path_hash(item.key))
            if kind == "messages" and read.first_chat is None:
                read.first_chat = item.where
    read.hashes = np.frombuffer(hashes, dtype=np.uint64)
    if not len(read.hashes):
        bad = read.bad
        raise DataError(
            f"{read.flag} {read.spec.source!r}: no usable records"
            + (f" ({bad.count} bad, e.g. {bad.examples[0]})" if bad.count else "")
        )


def scan(spec: Spec, flag: str, fields: Fields, skip: bool, encoder: Encoder) -> Read:
    """Check every file or record ``spec`` names, and the chat template if it holds
    conversations; bad input raises DataError naming ``flag``, the file and the line."""
    read = Read(spec, flag)
    if spec.texts:
        read.docs = _texts(spec, flag)
    else:
        _records(read, fields, skip)
    if read.first_chat is not None:
        encoder.check_template(f"{flag} {read.first_chat}")
    return read


def _unit(key: str) -> float:
    """A stable pseudo-random number in [0, 1) for ``key``: below ``fraction`` is validation.

    Its first decimal digit is the path hash mod 10, so ``--val-fraction 0.1`` holds out
    exactly the files it always did (hash mod 10 == 0); the rest of the hash fills in the
    digits that other fractions need.
    """
    h = path_hash(key)
    return (h % VAL_BUCKETS + (h // VAL_BUCKETS % 10**9) / 10**9) / VAL_BUCKETS


def _held_out(keys: Sequence[str], fraction: float) -> list[bool]:
    """Which items are validation (docs/guide/cli.md, ``--val-fraction``): every distinct key
    whose :func:`_unit` is below ``fraction``, so copies stay together and an item's side
    never depends on the others. Each side keeps at least one key: when none falls below,
    the key of smallest hash is held out (as it always was); when all do, the key of
    largest unit (the one the fraction holds out last) trains. Needs two distinct keys."""
    units = {key: _unit(key) for key in keys}
    if len(units) < 2:
        raise ValueError(f"two distinct keys are needed to split, got {len(units)}")
    held = {key for key, unit in units.items() if unit < fraction}
    if not held:
        held = {min(units, key=path_hash)}
    elif len(held) == len(units):
        held.discard(max(units, key=units.__getitem__))
    return [key in held for key in keys]


def _units(hashes: np.ndarray) -> np.ndarray:
    """:func:`_unit` of each hash, in the same float arithmetic."""
    low = (hashes % np.uint64(VAL_BUCKETS)).astype(np.float64)
    high = (hashes // np.uint64(VAL_BUCKETS) % np.uint64(10**9)).astype(np.float64)
    return (low + high / 10**9) / VAL_BUCKETS


def held_mask(hashes: np.ndarray, fraction: float) -> np.ndarray:
    """:func:`_held_out` of the records whose keys hash to ``hashes``: which are
    validation (two distinct keys are needed)."""
    units = _units(hashes)
    held = units < fraction
    if not held.any():
        held = hashes == hashes.min()  # the key of smallest hash is held out
    elif held.all():
        held &= hashes != hashes[int(np.argmax(units))]  # the last the fraction holds out trains
    return held


def _too_few(read: Read, fraction: float) -> DataError:
    """The refusal for records that cannot go to both sides of the split."""
    n = read.records
    held = f"{plural_records(n)}" if n == 1 else f"{plural_records(n)}, all copies of one"
    if read.bad.count:
        held += f" ({read.bad.count} more skipped as bad)"
    return DataError(
        f"--data {read.spec.source!r} holds {held}: too few to split, since --val-fraction "
        f"{fraction:g} holds at least 1 record out for validation and at least 1 other must "
        "be left to train on (copies of a record stay on one side); give validation data "
        "with --val-data PATH (then nothing of --data is held out), or more records"
    )


def _held_text(what: str, fraction: float) -> str:
    return (
        f"; --val-fraction {fraction:g} held {what} out for validation: give more data, a "
        "smaller --val-fraction, or validation data with --val-data PATH"
    )


def split(read: Read, fraction: float) -> tuple[object, object, str]:
    """Hold ``fraction`` of ``read`` out: (train part, val part, what was held, for
    refusals). Text: whole files by name, or a single file's last bytes; records: a mask
    (``True``: validation)."""
    if read.docs:
        docs = read.docs
        if len(docs) == 1:
            doc = docs[0]
            size = doc.end
            cut = max(1, size - max(math.floor(size * fraction), 2))
            train = [TextDoc(doc.name, doc.path, 0, cut)]
            val = [TextDoc(doc.name + "#val", doc.path, cut, size)]
            return (
                train,
                val,
                _held_text(f"the last {size - cut:,} of its {size:,} bytes", fraction),
            )
        is_val = _held_out([d.name for d in docs], fraction)
        train = [d for d, v in zip(docs, is_val, strict=True) if not v]
        val = [d for d, v in zip(docs, is_val, strict=True) if v]
        return train, val, _held_text(f"{len(val)} of the {len(docs)} files", fraction)
    if not (read.hashes != read.hashes[0]).any():  # copies of one record only
        raise _too_few(read, fraction)
    held = held_mask(read.hashes, fraction)
    n, total = int(held.sum()), read.records
    return ~held, held, _held_text(f"{n:,} of the {total:,} records", fraction)


def bounded_val(val: list[TextDoc], budget: int) -> tuple[list[TextDoc], str]:
    """The default corpus's held-out files that validate: in path-hash order (spread over the
    library, the same on every run), each that still fits ``budget`` bytes, at least the
    smallest; and the note saying so. The others are left out of both sides, so the
    training side is what the split made it."""
    kept, total = [], 0
    for doc in sorted(val, key=lambda d: path_hash(d.name)):
        if total + doc.end - doc.start <= budget:
            kept.append(doc)
            total += doc.end - doc.start
    if not kept:
        kept = [min(val, key=lambda d: d.end - d.start)]
        total = kept[0].end - kept[0].start
    kept.sort(key=lambda d: d.name)
    said = (
        f"note: the default corpus validates on {len(kept)} of the {len(val)} files it holds out "
        f"({total:,} bytes: its evaluation is bounded to {budget:,} bytes to stay quick; the "
        "other files are neither trained nor scored); --data is always scored whole"
    )
    return kept, said


def overlap_note(train: Read, val: Read) -> str | None:
    """A note when ``--val-data`` repeats ``--data``: its loss would not be held out."""
    if val.records:
        seen, keys, unit = train.hashes, val.hashes, "record"
    else:
        digests = {d.digest for d in train.docs}
        seen, keys, unit = None, [d.digest in digests for d in val.docs], "file"
    shared = int(np.isin(keys, seen).sum()) if seen is not None else sum(keys)
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
