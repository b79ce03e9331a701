"""The atomic folder protocol of :mod:`gradstep.checkpoint`: write, publish, verify, prune.

A checkpoint is written into ``.tmp-step-N``, fsynced, given its manifest (written last,
checksummed), renamed to ``step-N`` in one atomic rename, and only then are old ones
pruned. Everything here works on paths and bytes; what goes into the files is decided
by :mod:`.checkpointer`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "_file_table",
    "_prune",
    "_publish",
    "_recover",
    "_step_dirs",
    "_verify",
    "_write_manifest",
    "file_sha256",
    "fsync",
    "write_bytes",
]

FORMAT = "gradstep-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_LEFTOVER = re.compile(r"^\.(tmp|trash)-step-\d+$")
_REPLACED = re.compile(r"^\.replaced-(step-\d+)$")
_CHUNK = 1 << 20


# ------------------------------------------------------------------------ files and fsync


def fsync(path: Path) -> None:
    """Flush a file's or a folder's metadata/contents to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


# ----------------------------------------------------------------------------- manifest


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    body = {**manifest, "checksum": hashlib.sha256(_canonical(manifest)).hexdigest()}
    write_bytes(folder / MANIFEST, json.dumps(body, sort_keys=True, indent=1).encode() + b"\n")


def _file_table(folder: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file under ``folder`` (DCP's hidden ``.metadata`` included)."""
    table = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = Path(root, name)
            rel = path.relative_to(folder).as_posix()
            if rel != MANIFEST:
                table[rel] = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
    return dict(sorted(table.items()))


# ----------------------------------------------------------------- the atomic protocol


def _publish(tmp: Path, final: Path) -> None:
    """Make a complete, fsynced folder visible under its final name in one rename.

    Saving a step that exists replaces it: the old copy is renamed to ``.replaced-step-N``
    first, and stays loadable under that name until the new one is in place.
    """
    replaced = final.with_name(f".replaced-{final.name}")
    if final.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
    os.rename(tmp, final)
    fsync(final.parent)
    shutil.rmtree(replaced, ignore_errors=True)


def _recover(directory: Path) -> None:
    """Tidy what a killed save left: partial folders go, a replaced step is put back."""
    for path in directory.iterdir():
        if _LEFTOVER.match(path.name):
            shutil.rmtree(path, ignore_errors=True)
        elif m := _REPLACED.match(path.name):
            original = path.with_name(m.group(1))
            if original.exists():  # the replacement was published: the old copy can go
                shutil.rmtree(path, ignore_errors=True)
            else:  # killed between the two renames of _publish: restore the old copy
                os.rename(path, original)
    fsync(directory)


def _step_dirs(directory: Path) -> list[tuple[int, Path]]:
    """Published checkpoint folders, newest first (not verified)."""
    if not directory.is_dir():
        return []
    found: dict[int, Path] = {}
    for path in sorted(directory.iterdir(), key=lambda p: p.name.startswith(".")):
        m = _STEP_DIR.match(path.name) or _REPLACED.match(path.name)
        if m and path.is_dir():
            found.setdefault(int(m.group(1).removeprefix("step-")), path)
    return sorted(found.items(), reverse=True)


def _prune(directory: Path, keep: int) -> None:
    """Drop all but the ``keep`` newest: rename away (atomic), fsync, then delete."""
    trash = []
    for n, path in _step_dirs(directory)[keep:]:
        # Named by step (not by folder: a ``.replaced-`` folder would not match _LEFTOVER),
        # so a kill during the delete leaves something the next save cleans up.
        target = directory / f".trash-step-{n:06d}"
        shutil.rmtree(target, ignore_errors=True)
        os.rename(path, target)
        trash.append(target)
    if trash:
        fsync(directory)
    for target in trash:
        shutil.rmtree(target, ignore_errors=True)


def _verify(folder: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None) when every file matches its checksum, else (None, the reason)."""
    try:
        raw = json.loads((folder / MANIFEST).read_bytes())
    except FileNotFoundError:
        return None, f"{MANIFEST} is missing (the save did not finish)"
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"{MANIFEST} is not valid JSON ({exc})"
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        return None, f"{MANIFEST} is not a {FORMAT} manifest"
    checksum = raw.pop("checksum", None)
    if hashlib.sha256(_canonical(raw)).hexdigest() != checksum:
        return None, f"{MANIFEST} does not match its checksum (corrupted)"
    if raw.get("format_version", 0) > FORMAT_VERSION:
        return None, f"format version {raw['format_version']} is newer than this gradstep's"
    for name, meta in raw["files"].items():
        path = folder / name
        if not path.is_file():
            return None, f"{name} is missing"
        size = path.stat().st_size
        if size != meta["bytes"]:
            return None, f"{name} is truncated or resized ({size} of {meta['bytes']} bytes)"
        if file_sha256(path) != meta["sha256"]:
            return None, f"{name} does not match its sha256 checksum (corrupted)"
    return raw, None
