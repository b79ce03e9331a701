"""The checkpoint's atomic-file API: write, publish, verify, prune (and read leases).

A checkpoint is written into ``.tmp-step-N`` (:func:`write_bytes`, :func:`fsync`), given its
manifest (:func:`file_table`, then :func:`write_manifest`: written last, checksummed),
renamed to ``step-N`` in one atomic rename (:func:`publish`), and only then are old ones
pruned (:func:`prune`); :func:`recover` tidies what a killed save left, :func:`step_dirs`
lists the published folders and :func:`verify` checks one against its manifest. Everything
here works on paths and bytes; what goes into the files is decided by :mod:`.checkpointer`,
which calls these functions through the module (``layout.publish(...)``), so that tests can
hook each step of the protocol.

Read leases: ``with read_lease(step_folder): ...`` pins a published checkpoint while another
process reads it (``gradstep export`` of a run a trainer is still writing). The lease is a
shared ``flock`` on the folder's ``manifest.json``; nothing is written, so a read-only run
folder can be leased too. The pruner takes an exclusive ``flock`` on the same file, without
waiting, before it renames the folder away: when a reader holds a lease it skips the folder
(it neither counts towards ``keep`` nor is deleted; a later save prunes it once the lease is
gone), and a reader that asks while the folder is being renamed away waits for the rename,
then finds the folder gone (FileNotFoundError) and never reads half of it. The kernel drops
a lock when its process ends, however it ends (SIGKILL included), so a lease never goes
stale and never blocks pruning after its reader is gone. Where no lock can be had (Windows,
a file system without ``flock``) the reader reads unpinned and the pruner prunes as before.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

from . import lease
from .errors import write_failed

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "file_sha256",
    "file_table",
    "fsync",
    "prune",
    "publish",
    "read_lease",
    "recover",
    "step_dirs",
    "verify",
    "write_bytes",
    "write_manifest",
    "written_by_gradstep",
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
    """The sha256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_bytes(path: Path, data: bytes) -> None:
    """Write and fsync one file; a failed write (disk full, file-size limit) is a
    :class:`CheckpointError` naming the file."""
    try:
        with open(path, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        raise write_failed(path, exc) from exc


# ----------------------------------------------------------------------------- manifest


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Write and fsync ``folder``'s manifest, with its own ``checksum`` added (the sha256 of
    the canonical JSON of the rest, which :func:`verify` checks)."""
    body = {**manifest, "checksum": hashlib.sha256(_canonical(manifest)).hexdigest()}
    write_bytes(folder / MANIFEST, json.dumps(body, sort_keys=True, indent=1).encode() + b"\n")


def file_table(folder: Path) -> dict[str, dict[str, Any]]:
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


def publish(tmp: Path, final: Path) -> None:
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


def recover(directory: Path) -> None:
    """Tidy what a killed save left: partial folders go, a replaced step is put back."""
    for path in directory.iterdir():
        if _LEFTOVER.match(path.name):
            shutil.rmtree(path, ignore_errors=True)
        elif m := _REPLACED.match(path.name):
            original = path.with_name(m.group(1))
            if original.exists():  # the replacement was published: the old copy can go
                shutil.rmtree(path, ignore_errors=True)
            else:  # killed between the two renames of publish: restore the old copy
                os.rename(path, original)
    fsync(directory)


def step_dirs(directory: Path) -> list[tuple[int, Path]]:
    """Published checkpoint folders, newest first (not verified)."""
    if not directory.is_dir():
        return []
    found: dict[int, Path] = {}
    for path in sorted(directory.iterdir(), key=lambda p: p.name.startswith(".")):
        n = _named_step(path)
        if n is not None and path.is_dir():
            found.setdefault(n, path)
    return sorted(found.items(), reverse=True)


def written_by_gradstep(folder: Path) -> bool:
    """True when ``folder`` holds a manifest that names this format (valid or not).

    gradstep publishes a folder only after its manifest is in place, so a ``step-N`` folder
    without one was made by someone else: it is never loaded, never pruned.
    """
    return _raw_manifest(folder) is not None


def _raw_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest's JSON when it names this format (not verified), else None."""
    try:
        raw = json.loads((folder / MANIFEST).read_bytes())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) and raw.get("format") == FORMAT else None


def _misnamed(folder: Path) -> bool:
    """True when the folder's name claims another step than its manifest: a folder renamed
    or copied by hand. Never loaded, and never pruned either: its files may be intact."""
    raw = _raw_manifest(folder)
    named = _named_step(folder)
    return raw is not None and named is not None and raw.get("step") != named


def prune(
    directory: Path,
    keep: int,
    protect: Collection[Path] = (),
    is_valid: Callable[[Path], bool] | None = None,
) -> None:
    """Keep the ``keep`` newest VALID checkpoints, counting every folder in ``protect`` (kept
    whatever its rank); drop the other folders gradstep wrote: rename away (atomic), fsync,
    then delete.

    Only checkpoints that verify count towards ``keep``, so a corrupted or half-copied
    newer folder can never push a good one out; folders gradstep did not write are left
    alone whatever their name, and so are folders whose name claims another step than their
    manifest (renamed or copied by hand: unusable, but maybe intact). A folder a reader
    holds a :func:`read_lease` on is skipped too: a later save prunes it.
    """
    is_valid = is_valid or (lambda path: verify(path)[0] is not None)
    kept = {Path(p) for p in protect}
    trash = []
    valid_seen = 0
    for n, path in step_dirs(directory):
        if path in kept:  # the checkpoint just written: known good, and it counts
            valid_seen += 1
            continue
        if not written_by_gradstep(path):
            continue
        if _misnamed(path):  # renamed or copied by hand: unusable, but its files may be intact
            continue
        if valid_seen < keep and is_valid(path):
            valid_seen += 1
            continue
        with lease.unleased(path / MANIFEST) as free:
            if not free:  # a reader holds a lease on it: a later save prunes it
                continue
            # Named by step (not by folder: a ``.replaced-`` folder would not match
            # _LEFTOVER), so a kill during the delete leaves something the next save cleans up.
            target = directory / f".trash-step-{n:06d}"
            shutil.rmtree(target, ignore_errors=True)
            os.rename(path, target)
        trash.append(target)
    if trash:
        fsync(directory)
    for target in trash:
        shutil.rmtree(target, ignore_errors=True)


# --------------------------------------------------------------------------- read leases


@contextlib.contextmanager
def read_lease(folder: str | os.PathLike) -> Iterator[Path]:
    """Pin the published checkpoint ``folder`` for the block: a save's pruning skips it.

    Raises FileNotFoundError naming the folder when it is gone (pruned since it was listed).
    A folder without a manifest, or on a file system without locks, is read unpinned. See
    the module docs for the protocol.
    """
    path = Path(folder)
    try:
        fd = lease.pin(path / MANIFEST)
    except FileNotFoundError:
        if path.is_dir() and not (path / MANIFEST).exists():
            fd = None  # no manifest: nothing gradstep would load, or prune
        else:
            raise FileNotFoundError(
                errno.ENOENT,
                "the checkpoint folder is gone (pruned since it was listed?)",
                str(path),
            ) from None
    try:
        yield path
    finally:
        if fd is not None:
            os.close(fd)


def _reject_constant(name: str) -> float:
    raise ValueError(f"non-standard JSON constant {name}")


def verify(folder: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None) when every file matches its checksum, else (None, the reason).

    Never raises for what it finds on disk: whatever is wrong with a folder becomes the
    reason, so the caller can fall back to an older checkpoint.
    """
    try:
        raw = json.loads((folder / MANIFEST).read_bytes(), parse_constant=_reject_constant)
    except FileNotFoundError:
        return None, f"{MANIFEST} is missing: not a checkpoint gradstep published (ignored)"
    except OSError as exc:
        return None, f"{MANIFEST} cannot be read ({exc.strerror or exc})"
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, NaN / Infinity
        return None, f"{MANIFEST} is not valid JSON ({exc})"
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        return None, f"{MANIFEST} is not a {FORMAT} manifest"
    checksum = raw.pop("checksum", None)
    if hashlib.sha256(_canonical(raw)).hexdigest() != checksum:
        return None, f"{MANIFEST} does not match its checksum (corrupted)"
    problem = _manifest_problem(raw)
    if problem is not None:
        return None, f"{MANIFEST} is malformed: {problem}"
    if raw["format_version"] > FORMAT_VERSION:
        return None, f"format version {raw['format_version']} is newer than this gradstep's"
    named = _named_step(folder)
    if named is not None and named != raw["step"]:
        # A renamed or copied folder: trusting either number would resume at the wrong
        # step (or let an old checkpoint outrank every newer one).
        return None, (
            f"the folder is named {folder.name} but its {MANIFEST} says step {raw['step']} "
            "(renamed or copied by hand?)"
        )
    for name, meta in raw["files"].items():
        path = folder / name
        try:
            if not path.is_file():
                return None, f"{name} is missing"
            size = path.stat().st_size
            if size != meta["bytes"]:
                return None, f"{name} is truncated or resized ({size} of {meta['bytes']} bytes)"
            if file_sha256(path) != meta["sha256"]:
                return None, f"{name} does not match its sha256 checksum (corrupted)"
        except OSError as exc:
            return None, f"{name} cannot be read ({exc.strerror or exc})"
    return raw, None


def _named_step(folder: Path) -> int | None:
    """The step a ``step-N`` (or ``.replaced-step-N``) folder name claims; None for a
    folder of another name (a user's copy elsewhere, loaded by path)."""
    m = _STEP_DIR.match(folder.name) or _REPLACED.match(folder.name)
    return None if m is None else int(m.group(1).removeprefix("step-"))


def _is_int(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _manifest_problem(raw: dict[str, Any]) -> str | None:
    """What is wrong with the fields the loader relies on, or None."""
    if not _is_int(raw.get("format_version"), 1):
        return f"format_version must be an int >= 1, got {raw.get('format_version')!r}"
    if not _is_int(raw.get("step"), 0):
        return f"step must be an int >= 0, got {raw.get('step')!r}"
    if not _is_int(raw.get("world_size"), 1):
        return f"world_size must be an int >= 1, got {raw.get('world_size')!r}"
    dp = raw.get("dp_size", raw["world_size"])  # absent before gradstep recorded it
    if not _is_int(dp, 1) or raw["world_size"] % dp:
        return f"dp_size must be an int >= 1 dividing world_size, got {dp!r}"
    for key in ("accum_steps", "micro_batch_size"):
        if raw.get(key) is not None and not _is_int(raw[key], 1):
            return f"{key} must be null or an int >= 1, got {raw[key]!r}"
    files, objects = raw.get("files"), raw.get("objects")
    if not isinstance(files, dict) or not isinstance(objects, dict):
        return "files and objects must be JSON objects"
    for name, meta in files.items():
        ok = isinstance(meta, dict) and _is_int(meta.get("bytes"), 0)
        if not ok or not isinstance(meta.get("sha256"), str) or ".." in Path(name).parts:
            return f"the entry of file {name!r} is not {{bytes, sha256}} inside the folder"
    for name, entry in objects.items():
        kinds = ("module", "optimizer", "object")
        if not isinstance(entry, dict) or entry.get("kind") not in kinds:
            return f"object {name!r} has no valid kind"
    return None
