"""The run folder's lock, and where a run folder may be: one trainer per folder, never one
run folder inside another (:mod:`gradstep_cli.run.folder` has the rest of the rules).

Rank 0 holds an exclusive ``flock`` on ``OUT/.gradstep.lock`` for the whole run; the kernel
releases it when the process ends, however it ends.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from gradstep.checkpoint import Checkpointer, written_by_gradstep
from gradstep_cli.config.checks import ConfigError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks, the folder rules stay
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_FILE", "locked"]

LOCK_FILE = ".gradstep.lock"
# The lock file cannot be opened because nothing in the folder can be written: deleting the
# lock file would not help (and cannot be done either).
_NOT_WRITABLE = {
    errno.EROFS: "is on a read-only file system",
    errno.EACCES: "is not writable by this user (permission denied)",
    errno.EPERM: "is not writable by this user (operation not permitted)",
}


def _lock_error(out: Path, lock: Path, exc: OSError) -> ConfigError:
    """Why the lock file of ``out`` cannot be opened, and what helps."""
    why = _NOT_WRITABLE.get(exc.errno or 0)
    if why is None:
        return ConfigError(
            f"--out {str(out)!r}: cannot open its lock file {str(lock)!r} "
            f"({exc.strerror or exc}); it only keeps two trainers apart: delete it and retry"
        )
    return ConfigError(
        f"--out {str(out)!r} {why}: cannot open its lock file {str(lock)!r}, and a run writes "
        "its lock, metrics and checkpoints there. Train into a writable --out; to continue "
        f"the run kept there, pass --resume {str(out)!r} with a new, writable --out"
    )


@contextlib.contextmanager
def locked(out: Path) -> Iterator[Callable[[], None]]:
    """Create ``out`` and hold its lock for the ``with`` block (rank 0 only).

    Yields ``claim()``, which writes this process's pid into the lock file (what a second
    trainer's refusal names): called once the run is accepted, so a refused invocation
    leaves the lock file of a folder holding a run as it was.
    """
    _refuse_nested(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"--out {str(out)!r} exists and is not a folder") from None
    except OSError as exc:
        raise ConfigError(
            f"--out {str(out)!r}: cannot write the run folder ({exc.strerror or exc})"
        ) from None
    lock = out / LOCK_FILE
    try:
        handle = open(lock, "a+")  # noqa: SIM115 - held open for the whole run
    except OSError as exc:
        raise _lock_error(out, lock, exc) from None
    with handle:
        if fcntl is not None:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "?"
                raise ConfigError(
                    f"--out {str(out)!r} is in use by another gradstep train (pid {holder}); "
                    "wait for it to finish or train into another --out"
                ) from None

        def claim() -> None:
            handle.seek(0)
            handle.truncate()
            handle.write(f"{os.getpid()}\n")
            handle.flush()

        yield claim


def _has_checkpoints(folder: Path) -> bool:
    """True when ``folder`` holds gradstep ``step-N`` checkpoint folders."""
    try:
        return any(written_by_gradstep(p) for p in Checkpointer(folder).checkpoints())
    except OSError:
        return False


def _holds_metrics(folder: Path) -> bool:
    try:
        return (folder / "metrics.jsonl").is_file()
    except OSError:
        return False


def _refuse_nested(out: Path) -> None:
    """``out`` must not be a checkpoints folder, nor lie inside a run folder or a
    checkpoints folder: training there would change that run's tree. Checked before the
    folder or its lock file is created."""
    here = out.resolve()
    if _has_checkpoints(here):
        raise ConfigError(
            f"--out {str(out)!r} holds checkpoints (step-N folders): it is a checkpoints "
            f"folder, not a run folder; to continue it pass --resume {str(out)!r} with a new "
            "--out"
        )
    for parent in here.parents:
        # metrics.jsonl marks a run folder; a project folder that merely holds a
        # checkpoints/ of the library's own use is not one (its runs/ stays usable).
        if _holds_metrics(parent) or _has_checkpoints(parent):
            raise ConfigError(
                f"--out {str(out)!r} lies inside {str(parent)!r}, which holds a run or "
                "checkpoints; a run folder never goes inside another: choose an --out "
                "outside it"
            )
