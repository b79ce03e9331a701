"""What one ``--data`` / ``--val-data`` argument names, resolved before anything is read.

An argument holds text files or records, never both:

* text: a file, a folder (searched recursively) or a glob of text files (:mod:`.files`); the
  default (no ``--data``) is the standard library's sources;
* records: JSONL, JSON, Parquet, CSV or Arrow files (any mix, by suffix), a ``save_to_disk``
  folder, a dataset folder with ``--data-split``, or a Hub dataset ``OWNER/NAME``
  (:mod:`.reading`).

:class:`Spec` also carries the argument's stamp: every file's path, size and change times
(a Hub dataset's fingerprint), which the token store's key holds, so changed data is
never served from a stale store.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from gradstep_cli.config.data_fields import is_hub_name
from gradstep_cli.data.files import default_corpus_files, user_files
from gradstep_cli.data.reading import RECORD_SUFFIXES, Part, file_part, hub_part, saved_part
from gradstep_cli.data.records import DataError

__all__ = ["Spec", "resolve"]

JSONL = ".jsonl"


@dataclass(frozen=True)
class Spec:
    """One argument's files or dataset, not yet read."""

    source: str
    """The argument (or ``stdlib ROOT`` for the default corpus)."""
    root: Path | None = None
    """Where text files' names are relative to."""
    texts: list[Path] = field(default_factory=list)
    """Text files, in order."""
    parts: list[Part] = field(default_factory=list)
    """Record files or a dataset, in order."""
    stamp: list = field(default_factory=list)
    """What identifies the data for the token store's key."""

    def name(self, path: Path) -> str:
        """A text file's name: its path relative to the root (what the split hashes)."""
        return path.relative_to(self.root).as_posix()


def _stat(path: Path) -> list:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _folder_stamp(folder: Path) -> list:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and ".cache" not in p.parts)
    return [_stat(p) for p in files]


def _is_saved(folder: Path) -> bool:
    return (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file()


def _split_applies(spec: str, flag: str, split: str | None) -> None:
    if split is not None:
        which = "--val-data-split" if flag == "--val-data" else "--data-split"
        raise DataError(
            f"{which} {split!r} picks a split of a Hub dataset, a save_to_disk DatasetDict or "
            f"a dataset folder; {flag} {spec!r} names files, read whole: drop {which}"
        )


def _files(spec: str, flag: str, split: str | None) -> Spec:
    root, paths = user_files(spec, flag)
    records = [p for p in paths if p.suffix.lower() in RECORD_SUFFIXES]
    if records and len(records) < len(paths):
        other = next(p for p in paths if p.suffix.lower() not in RECORD_SUFFIXES)
        kind = "JSONL" if records[0].suffix.lower() == JSONL else "record"
        folder = spec if Path(spec).is_dir() else "DIR"
        raise DataError(
            f"{flag} {spec!r} holds both {kind} files ({records[0].relative_to(root)}) and "
            f"text files ({other.relative_to(root)}): one argument reads one kind; name the "
            f"kind you mean, e.g. with a glob ('{Path(folder) / '**' / ('*' + JSONL)}')"
        )
    _split_applies(spec, flag, split)
    stamp = [_stat(p) for p in paths]
    if not records:
        return Spec(spec, root, texts=paths, stamp=stamp)
    named = lambda p: p.relative_to(root).as_posix() if len(paths) > 1 else str(p)  # noqa: E731
    return Spec(spec, root, parts=[file_part(p, named(p), flag) for p in records], stamp=stamp)


def resolve(spec: str | None, flag: str, split: str | None = None) -> Spec:
    """The files or dataset ``spec`` names (None: the default corpus); ``split``:
    ``--data-split`` / ``--val-data-split`` as given (None: not given)."""
    if spec is None:
        root, paths = default_corpus_files()
        return Spec(f"stdlib {root}", root, texts=paths, stamp=[_stat(p) for p in paths])
    path = Path(spec)
    default = "validation" if flag == "--val-data" else "train"
    if path.is_dir() and (_is_saved(path) or split is not None):
        part = saved_part(path, split or default, flag)
        return Spec(spec, parts=[part], stamp=["folder", split, *_folder_stamp(path)])
    hub = not os.path.lexists(spec) and is_hub_name(spec) and ("/" in spec or split is not None)
    if hub:
        part, fingerprint = hub_part(spec, split or default, flag)
        return Spec(spec, parts=[part], stamp=["hub", spec, split or default, fingerprint])
    return _files(spec, flag, split)
