"""The locks behind read leases (:func:`.layout.read_lease`, whose module docs give the
protocol): a reader's shared ``flock`` on a checkpoint's manifest, held while it reads, and
the pruner's exclusive one, tried without waiting around the rename that prunes the folder.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks, so no leases
    fcntl = None  # type: ignore[assignment]

__all__ = ["pin", "unleased"]


def pin(manifest: Path) -> int | None:
    """A descriptor of ``manifest`` holding a shared lock (close it to end the lease), or
    None when no lock can be had. Raises FileNotFoundError when the manifest is gone, or was
    renamed away while this waited for a prune to finish."""
    try:
        fd = os.open(manifest, os.O_RDONLY)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        return None  # unreadable: the load will say why
    gone = False
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits while a prune renames the folder away
            if os.path.samestat(os.fstat(fd), os.stat(manifest)):
                return fd
            gone = True  # renamed away (and maybe replaced) while this waited
    except FileNotFoundError:
        gone = True
    except OSError:  # no locks on this file system: read unpinned
        pass
    os.close(fd)
    if gone:
        raise FileNotFoundError(manifest)
    return None


@contextlib.contextmanager
def unleased(manifest: Path) -> Iterator[bool]:
    """The pruner's side: True, holding off new leases for the block, when no reader holds
    one on ``manifest``; False when one does. A manifest that cannot be locked: True."""
    try:
        fd = os.open(manifest, os.O_RDONLY)
    except OSError:
        yield True
        return
    try:
        free = True
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                free = False
            except OSError:  # no locks on this file system: prune as without leases
                pass
        yield free
    finally:
        os.close(fd)
