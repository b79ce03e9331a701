"""The one error type of :mod:`gradstep.checkpoint`, and the messages of a failed write."""

from __future__ import annotations

import errno
import os
import re

from ..errors import GradstepError

__all__ = ["CheckpointError", "not_saved", "write_failed"]


class CheckpointError(GradstepError, ValueError):
    """A checkpoint cannot be written or does not fit the objects it is loaded into."""

    filename: str | None = None
    """The file a failed write was writing (a full disk, a file-size limit, no permission);
    None for every other error."""


def write_failed(path: str | os.PathLike, exc: BaseException) -> CheckpointError:
    """The error for a file of a checkpoint that could not be written, naming the file.

    safetensors reports an I/O error as its own ``SafetensorError`` without the file name,
    and a ``write`` that fails (EFBIG, ENOSPC) raises an ``OSError`` without one either.
    """
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    error = CheckpointError(f"cannot write {os.fspath(path)!r}: {reason}")
    error.filename = os.fspath(path)
    return error


def not_saved(step: int, exc: OSError | CheckpointError) -> CheckpointError:
    """One message for a write that failed before the checkpoint was published: the file,
    the reason, and that nothing else changed (the partial folder is already removed)."""
    cause = exc.__cause__ if isinstance(exc, CheckpointError) and exc.__cause__ else exc
    reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(cause)
    error = CheckpointError(
        f"checkpoint of step {step} not saved: cannot write {exc.filename!r}: {reason}. "
        f"Nothing was published and older checkpoints are intact; {_advice(cause)} and save "
        "again"
    )
    error.filename = exc.filename
    return error


def _advice(cause: BaseException) -> str:
    """What to do about a failed write, from its errno (safetensors gives it only in its
    message, as ``(os error N)``)."""
    code = cause.errno if isinstance(cause, OSError) else None
    if code is None and (m := re.search(r"os error (\d+)", str(cause))):
        code = int(m.group(1))
    if code == errno.EFBIG:
        return "raise the file-size limit (ulimit -f)"
    if code in (errno.ENOSPC, errno.EDQUOT):
        return "free disk space"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "make the checkpoint folder writable"
    return "fix the cause"
