"""Which files ``--data`` / ``--val-data`` name, and which of them are usable text.

A spec is a file, a folder (searched recursively; hidden entries skipped, symlinked folders
not followed, so a symlink loop cannot hang the search) or a glob. Only regular files are
read: a named pipe, a device or a socket is refused by ``stat`` alone, never opened (a
FIFO would block the open, ``/dev/zero`` would never end). The default corpus is a sample
of the standard library's sources.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import os
import stat
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

from gradstep_cli.data.records import DataError
from gradstep_cli.data.tokenized import Document

__all__ = [
    "DEFAULT_CORPUS_BYTES",
    "DEFAULT_VAL_BYTES",
    "none_usable",
    "default_corpus_files",
    "path_hash",
    "read_range",
    "scan_text_file",
    "text_files",
    "user_files",
]

# ~3 MB of stdlib source: enough text that the demo does not memorise it in a few minutes,
# small enough to load in well under a second.
DEFAULT_CORPUS_BYTES = 3_000_000
# Huge files are mostly data tables (pydoc topics, codecs); they would dominate the corpus.
MAX_DEFAULT_FILE_BYTES = 200_000
# The default corpus's validation side: its held-out files up to this many bytes. Scoring all
# ~450 KB it holds out (3,500 rows) at each of the demo's 4 evaluations took `make train` ~80 s
# longer; ~32 KB (~250 rows) costs a few seconds. User data is always scored whole.
DEFAULT_VAL_BYTES = 32_000
SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "__pycache__", "encodings", "pydoc_data"}
)
_SPECIAL = (
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)
SYMLINKED = "a symlinked folder (not followed)"
HIDDEN = "hidden (skipped)"
WHOLE_READ_BYTES = 16 * 2**20  # files up to this size are read in one call
BLOCK_BYTES = 2**20  # larger ones in blocks of this size (a str of one holds up to 4 MiB)


def path_hash(name: str) -> int:
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
                candidates.append((path_hash(rel), rel, path, size))
    chosen, total = [], 0
    for _, _, path, size in sorted(candidates):
        if total + size > max_bytes:
            continue
        chosen.append(path)
        total += size
    return root, sorted(chosen, key=lambda p: p.relative_to(root).as_posix())


def _kind(path: Path) -> str | None:
    """What ``path`` is when it is neither a regular file nor a folder (None: it is one,
    or it does not exist). ``stat`` only: a named pipe is never opened."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        if not os.path.islink(path):
            return None
        return f"a symbolic link to {os.readlink(path)!r}, which does not exist"
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return next((what for test, what in _SPECIAL if test(mode)), "neither a file nor a folder")


def _walk(root: Path) -> tuple[list[Path], dict[str, list[str]]]:
    """The regular files under ``root``, and what was passed over, by why."""
    paths, skipped = [], {}
    for dirpath, dirnames, filenames in os.walk(root):  # followlinks=False: no symlink loops
        here = Path(dirpath)
        for name in list(dirnames):
            why = HIDDEN if name.startswith(".") else None
            if why is None and (here / name).is_symlink():
                why = SYMLINKED  # os.walk lists it but does not go in
            if why is not None:
                skipped.setdefault(why, []).append((here / name).relative_to(root).as_posix())
                dirnames.remove(name)
        for name in filenames:
            path = here / name
            why = HIDDEN if name.startswith(".") else _kind(path)
            if why is None:
                paths.append(path)
            else:
                skipped.setdefault(why, []).append(path.relative_to(root).as_posix())
    return sorted(paths), skipped


def _globbed(spec: str) -> tuple[Path, list[Path], dict[str, list[str]]]:
    matches = sorted(Path(p) for p in glob.glob(spec, recursive=True))
    paths = [p for p in matches if p.is_file()]
    skipped: dict[str, list[str]] = {}
    for path in matches:
        why = _kind(path)
        if why is not None:
            skipped.setdefault(why, []).append(str(path))
    root = Path(os.path.commonpath([str(p.parent) for p in paths])) if paths else Path(".")
    return root, paths, skipped


def _nothing_found(spec: str, skipped: dict[str, list[str]], flag: str) -> DataError:
    """No regular file under ``spec``: what was there instead, so the fix is clear."""
    if not skipped:
        return DataError(f"{flag} {spec!r}: no files found (hidden ones are skipped)")
    parts = [
        f"{len(names)} entries are {why}, e.g. {names[0]!r}"
        if len(names) > 1
        else f"{names[0]!r} is {why}"
        for why, names in skipped.items()
    ]
    hint = "give regular text or JSONL files"
    if SYMLINKED in skipped:
        linked = Path(spec) / skipped[SYMLINKED][0]
        hint += f" (to read a symlinked folder, name it: {flag} {linked})"
    return DataError(f"{flag} {spec!r}: no files found ({'; '.join(parts)}); {hint}")


def user_files(spec: str, flag: str = "--data") -> tuple[Path, list[Path]]:
    """Resolve ``--data``: a file, a folder (recursive, hidden entries skipped) or a glob;
    at least one regular file, or an error saying what ``spec`` is instead."""
    path = Path(spec)
    kind = _kind(path)
    if kind is not None:
        # Reading a pipe could block for ever and a device could never end: refused unopened.
        what = kind if kind.startswith("a symbolic link") else f"{kind}, not a regular file"
        raise DataError(
            f"{flag} {spec!r} is {what} (it is not opened); give a text or JSONL file, a "
            "folder of them or a glob"
        )
    if not path.exists() and any(ch in spec for ch in "*?["):
        root, paths, skipped = _globbed(spec)
    elif path.is_dir():
        root = path
        paths, skipped = _walk(root)
    elif path.is_file():
        root, paths, skipped = path.parent, [path], {}
    else:
        raise DataError(f"{flag} {spec!r}: no such file or folder")
    if not paths:
        raise _nothing_found(spec, skipped, flag)
    return root, paths


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


def _blocks(path: Path, flag: str) -> Iterator[bytes]:
    """The file's bytes: a small file in one read, a large one in bounded blocks."""
    try:
        if path.stat().st_size <= WHOLE_READ_BYTES:
            yield path.read_bytes()
            return
        with path.open("rb") as f:
            while block := f.read(BLOCK_BYTES):
                yield block
    except OSError as exc:
        raise DataError(f"{flag}: cannot read {str(path)!r}: {exc.strerror or exc}") from None


def scan_text_file(path: Path, flag: str = "--data") -> tuple[str | None, int, bytes]:
    """Why the file is skipped ("binary", "not UTF-8", "empty"; None: it is usable text),
    its size and a digest of its bytes, read in bounded blocks (as :func:`_read_text_file`
    judges)."""
    decoder, digest = codecs.getincrementaldecoder("utf-8")(), hashlib.blake2b(digest_size=16)
    size, nul, utf8 = 0, False, True
    for block in _blocks(path, flag):
        size += len(block)
        digest.update(block)
        nul = nul or b"\x00" in block
        if utf8 and not nul:
            try:
                decoder.decode(block)
            except UnicodeDecodeError:
                utf8 = False
    if utf8 and not nul:
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            utf8 = False
    why = "empty" if not size else "binary (NUL bytes)" if nul else None
    return why or (None if utf8 else "not UTF-8 text"), size, digest.digest()


def read_range(path: Path, start: int, end: int, flag: str = "--data") -> Iterator[bytes]:
    """Bytes ``start:end`` of the file, in bounded blocks."""
    try:
        with path.open("rb") as f:
            f.seek(start)
            while start < end and (block := f.read(min(BLOCK_BYTES, end - start))):
                start += len(block)
                yield block
    except OSError as exc:
        raise DataError(f"{flag}: cannot read {str(path)!r}: {exc.strerror or exc}") from None


def none_usable(source: str, skipped: dict[str, list[str]], flag: str = "--data") -> DataError:
    """The error for data with no usable file: why each kind of file was skipped."""
    if not skipped:
        return _nothing_found(source, {}, flag)
    reasons = "; ".join(
        f"{len(names)} files are {why}, e.g. {names[0]!r}"
        if len(names) > 1
        else f"{names[0]!r} is {why}"
        for why, names in skipped.items()
    )
    return DataError(
        f"{flag} {source!r}: no non-empty UTF-8 text files found ({reasons}); give text files"
    )


def text_files(
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
        raise none_usable(source, skipped, flag)
    return docs
