"""The folder ``gradstep export`` writes: complete or not at all, and one export's own.

``publish(OUT, write)`` has ``write`` fill a temporary folder beside ``OUT`` whose name is
this export's own (``.OUT.export-tmp-HOST-PID-RANDOM``), then renames it to ``OUT`` (which
must be absent or empty). Hence:

- a failed write (a full disk, the file-size limit, a read-only file system) is one OSError
  naming the file at its final place under ``OUT``, the partial folder removed;
- of two exports to one ``OUT`` the one that renames second gets a ConfigError saying the
  folder was taken meanwhile; neither ever writes into the other's folder;
- an export removes the temporary folders of killed exports to the same ``OUT`` (this
  host's, whose process is gone), never a live one's.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

from gradstep_cli.config.checks import ConfigError

__all__ = ["publish"]

_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def publish(out: Path, write: Callable[[Path], None]) -> None:
    """``write`` a folder beside ``out`` (an empty folder or none), then rename it into
    place: the export appears complete or not at all, and exports never share a folder."""
    target = out.resolve()
    prefix = f".{target.name}.export-tmp"
    tmp = target.with_name(f"{prefix}-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _clear_dead(target.parent, prefix)
        tmp.mkdir()
        write(tmp)
    except BaseException as exc:
        failed = _write_failure(exc, tmp, out)
        shutil.rmtree(tmp, ignore_errors=True)
        if failed is None:
            raise
        raise failed from exc
    try:
        os.rename(tmp, target)  # replaces an empty folder, never a filled one
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            raise
        raise ConfigError(
            f"--out {str(out)!r} was taken by another export meanwhile (it was empty or "
            "absent when this one began): nothing of this export was published; choose "
            "another --out"
        ) from None


def _clear_dead(parent: Path, prefix: str) -> None:
    """Remove what killed exports to the same folder left: temporary folders whose process
    is gone (this host's), and the single name older gradsteps used. A live one stays."""
    pattern = re.compile(re.escape(prefix) + r"(?:-([0-9a-f]{8})-(\d+)-[0-9a-f]+)?")
    for name in os.listdir(parent):
        m = pattern.fullmatch(name)
        if m is None or (m.group(1) is not None and m.group(1) != _HOST):
            continue
        if m.group(2) is None or not _alive(int(m.group(2))):
            shutil.rmtree(parent / name, ignore_errors=True)


def _alive(pid: int) -> bool:
    if os.name == "nt":  # os.kill(pid, 0) would send CTRL_C_EVENT there: assume alive
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _write_failure(exc: BaseException, tmp: Path, out: Path) -> OSError | None:
    """A write of the export that failed, as an OSError naming the file under ``out`` (its
    final place) and the errno's reason; None for any other error."""
    code = exc.errno if isinstance(exc, OSError) else None
    # safetensors reports an I/O error as its own exception, with the errno only in its text.
    if code is None and (m := re.search(r"\(os error (\d+)\)", str(exc))):
        code = int(m.group(1))
    if not code:
        return None
    name = getattr(exc, "filename", None)
    if name is None:  # not known: the folder
        name = tmp
    try:
        rel = Path(os.fsdecode(name)).resolve().relative_to(tmp)
    except ValueError:
        return None  # not a file of the export (a file it read): its own error says it
    return OSError(code, os.strerror(code), str(out / rel) if rel.parts else str(out))
