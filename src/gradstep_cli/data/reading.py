"""Records as read, one at a time, from what ``--data`` / ``--val-data`` name.

* JSON Lines (``.jsonl``, or a ``.json`` holding one object per line) are read here, line by
  line in bounded memory, so a bad line is named by its number (``FILE line N``).
* Every other record file (Parquet, CSV, Arrow, a ``.json`` array), a ``save_to_disk``
  folder, a dataset folder with ``--data-split`` and a Hub dataset (``OWNER/NAME``) are read
  through the ``datasets`` library (``load_dataset`` / ``load_from_disk``: memory-mapped
  Arrow); a bad row is named by its number (``FILE row N``).

Each record comes as an :class:`Item`: where it is, the text the validation split hashes (the
line; a row's JSON), and its parsed value or why it could not be parsed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradstep_cli.data.formats import Bad
from gradstep_cli.data.records import DataError

__all__ = ["RECORD_SUFFIXES", "Item", "Part", "file_part", "hub_part", "saved_part"]

RECORD_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".arrow")
WHOLE_READ_BYTES = 16 * 2**20
"""Files up to this size are read in one call; larger ones are streamed."""
_BUILDERS = {".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
_ROWS = 1024  # rows converted from Arrow at a time


@dataclass(frozen=True)
class Item:
    """One record as read."""

    where: str
    """``FILE line N`` / ``FILE row N``, for messages about it."""
    key: str
    """What the validation split hashes: the line as read, or the row as JSON (copies of a
    record land on one side)."""
    value: Any = None
    bad: Bad | None = None
    """Why it could not be parsed (then ``value`` is None)."""


@dataclass(frozen=True)
class Part:
    """One file or dataset of an argument's records."""

    name: str
    """How messages show it."""
    items: Callable[[], Iterator[Item]]
    """Its records, read again on every call (the data stage reads twice: checks, encoding)."""


def _read_error(path: Path, flag: str, exc: OSError) -> DataError:
    return DataError(f"{flag}: cannot read {str(path)!r}: {exc.strerror or exc}")


def _lines(path: Path, flag: str) -> Iterator[bytes]:
    """The file's lines (without their newline): small files in one read, large ones
    streamed, so memory stays bounded whatever the file's size."""
    try:
        if path.stat().st_size <= WHOLE_READ_BYTES:
            yield from path.read_bytes().split(b"\n")
            return
        with path.open("rb") as f:
            for line in f:
                yield line[:-1] if line.endswith(b"\n") else line
    except OSError as exc:
        raise _read_error(path, flag, exc) from None


def _parse(raw: bytes) -> tuple[str, Any]:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Bad(f"not UTF-8 text (byte {exc.start + 1})") from None
    try:
        return line, json.loads(line)
    except json.JSONDecodeError as exc:
        raise Bad(f"invalid JSON ({exc.msg} at column {exc.colno})") from None


def _jsonl_items(path: Path, name: str, flag: str) -> Iterator[Item]:
    for number, raw in enumerate(_lines(path, flag), start=1):
        if number == 1:
            raw = raw.removeprefix(b"\xef\xbb\xbf")  # a byte-order mark some editors write
        if not raw.strip():
            continue
        where = f"{name} line {number}"
        try:
            line, obj = _parse(raw)
        except Bad as reason:
            yield Item(where, "", bad=reason)
            continue
        yield Item(where, line.strip(), obj)


def _is_json_lines(path: Path) -> bool:
    """A ``.json`` file holding one object per line (what most ``.json`` datasets are)."""
    try:
        with path.open("rb") as f:
            first = next((line for line in f if line.strip()), b"")
    except OSError:
        return True  # the line reader says why it cannot be read
    try:
        return isinstance(json.loads(first.removeprefix(b"\xef\xbb\xbf")), dict)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return first.lstrip()[:1] != b"["


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError(
            "reading Parquet, CSV, Arrow, saved or Hub datasets needs the datasets library: "
            "pip install 'gradstep[hf]' (JSONL and text files need nothing more)"
        ) from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors are said as ours
    return datasets


def _loaded(what: str, flag: str, load: Callable[[Any], Any]) -> Any:
    """``load(datasets)``, its failure one DataError naming ``what``."""
    lib = _datasets()
    try:
        return load(lib)
    except DataError:
        raise
    except Exception as exc:  # datasets raises many kinds (ValueError, FileNotFoundError, ...)
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise DataError(
            f"{flag} {what}: the datasets library cannot read it ({type(exc).__name__}: "
            f"{said[:300]})"
        ) from None


def _clean(value: Any) -> Any:
    """A row without Arrow's nulls for absent fields (a column one record lacks)."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _rows(dataset: Any, name: str) -> Iterator[Item]:
    number = 0
    for batch in dataset.iter(batch_size=_ROWS):
        columns = list(batch)
        for values in zip(*(batch[c] for c in columns), strict=True):
            number += 1
            row = _clean(dict(zip(columns, values, strict=True)))
            key = json.dumps(row, sort_keys=True, ensure_ascii=False, default=str)
            yield Item(f"{name} row {number}", key, row)


def _split_of(dataset: Any, split: str, what: str, flag: str) -> Any:
    """One split of a DatasetDict (a dataset as is)."""
    if not hasattr(dataset, "keys"):
        return dataset
    if split not in dataset:
        which = "--val-data-split" if flag == "--val-data" else "--data-split"
        raise DataError(
            f"{flag} {what} has no split {split!r}; its splits are "
            f"{', '.join(map(repr, dataset.keys()))}: pass {which} NAME"
        )
    return dataset[split]


def file_part(path: Path, name: str, flag: str) -> Part:
    """A record file: JSON Lines read here, other formats through ``datasets``."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl" or (suffix == ".json" and _is_json_lines(path)):
        return Part(name, lambda: _jsonl_items(path, name, flag))
    builder = _BUILDERS[suffix]

    def load(lib: Any) -> Any:
        return lib.load_dataset(builder, data_files=[str(path)], split="train")

    return Part(name, lambda: _rows(_loaded(repr(name), flag, load), name))


def saved_part(folder: Path, split: str, flag: str) -> Part:
    """A ``save_to_disk`` folder (a Dataset, or a DatasetDict's ``split``) or, with a split
    asked for, a dataset folder ``load_dataset`` reads (files named by split)."""
    name, what = str(folder), repr(str(folder))

    def load(lib: Any) -> Any:
        saved = (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file()
        if saved:
            return _split_of(lib.load_from_disk(str(folder)), split, what, flag)
        return lib.load_dataset(str(folder), split=split)

    return Part(name, lambda: _rows(_loaded(what, flag, load), name))


def hub_part(name: str, split: str, flag: str) -> tuple[Part, str]:
    """A Hub dataset's split (from the Hub, or the local HF cache offline), and its
    fingerprint (what the token store's key holds: another revision, another store)."""
    what = f"{name!r} (no such file or folder; read as a Hub dataset, split {split!r})"
    dataset = _loaded(what, flag, lambda lib: lib.load_dataset(name, split=split))
    return Part(name, lambda: _rows(dataset, name)), str(dataset._fingerprint)
