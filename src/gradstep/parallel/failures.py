"""Recognising a collective that failed because another rank is stuck or gone.

A rank that stops (paused, deadlocked, swapping) or dies (crashed, killed, out of memory)
leaves its peers blocked in a collective. With a timeout they raise, but what they raise
depends on the backend and on where the collective ran:

- gloo raises a plain ``RuntimeError`` carrying gloo's source location, e.g.
  ``[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 15000ms for recv
  operation to complete`` (stuck peer) or ``[.../pair.cc:553] Connection closed by peer``
  / ``Read error ...: Connection reset by peer`` (dead peer), from the collective itself,
  a DDP bucket's all-reduce in backward, an FSDP2 all-gather in forward or a barrier; any
  later collective on the same connection raises ``Application timeout caused pair
  closure`` (no location);
- NCCL raises ``torch.distributed.DistBackendError`` (``NCCL communicator was aborted on
  rank N``, ``NCCL error ... remote process exited``) where Python sees the failure; its
  watchdog logs ``Watchdog caught collective operation timeout: WorkNCCL(...,
  Timeout(ms)=N)`` and, by default (``TORCH_NCCL_ASYNC_ERROR_HANDLING``), ends the process
  itself, so no Python handler runs then;
- the c10d store (rendezvous, ``monitored_barrier``) raises ``DistStoreError`` /
  ``DistNetworkError``.

:func:`collective_failure` turns any of these into one message that says which of the two
it was, the timeout in force, and what to do. :func:`remember_timeout` is how
:func:`gradstep.parallel.init` tells it the timeout it set.
"""

from __future__ import annotations

import math
import numbers
import re

import torch.distributed as dist

__all__ = ["TIMEOUT_RANGE_S", "check_timeout", "collective_failure", "remember_timeout"]

# Below a second, the rendezvous itself (which uses the same timeout) fails on a busy
# machine (1e-9 s: an immediate c10d time-out with a C++ stack). Above a week it no longer
# ends a hang in useful time, and huge values break: 1e308 s overflows timedelta, 1e6 days
# wraps torch's clock into an immediate time-out (measured, torch 2.13).
TIMEOUT_RANGE_S = (1.0, 7 * 24 * 3600.0)

_timeout_s: float | None = None

# What the backends put in the message; matched only on errors from torch.distributed
# (gloo's carry their source path, so an unrelated "timed out" never matches), except the
# one a gloo pair raises for every later operation once an earlier one timed out.
_GLOO = re.compile(r"[/\\]gloo[/\\]|Application timeout caused pair closure")
_NCCL = re.compile(r"NCCL communicator was aborted|Watchdog caught collective|NCCL error")
_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_LOST = re.compile(
    r"closed by peer|reset by peer|broken pipe|remote (worker|process)|connection refused",
    re.IGNORECASE,
)
_TIMEOUT_MS = re.compile(r"Timed out waiting (\d+)ms|Timeout\(ms\)=(\d+)")
_CONNECT = re.compile(r"connectFullMesh")  # gloo building its pairs: the group's creation


def check_timeout(timeout_s: float | None, name: str = "timeout_s") -> None:
    """Raise ``ValueError`` naming ``name`` unless ``timeout_s`` is None or a number of
    seconds within :data:`TIMEOUT_RANGE_S`."""
    if timeout_s is None:
        return
    low, high = TIMEOUT_RANGE_S
    ok = isinstance(timeout_s, numbers.Real) and not isinstance(timeout_s, bool)
    if not (ok and math.isfinite(timeout_s) and low <= timeout_s <= high):
        raise ValueError(
            f"{name} must be None or a number of seconds from {low:g} to {high:g} (7 days), "
            f"got {timeout_s!r}: it is how long a rank waits in a collective for the others"
        )


def remember_timeout(timeout_s: float | None) -> None:
    """Record the collective timeout in force (None: torch's default), for the message."""
    global _timeout_s
    _timeout_s = timeout_s


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or during (cycles cut)."""
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not e for e in seen):
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _from_backend(exc: BaseException) -> bool:
    """True when ``exc`` is a distributed backend's error, not any RuntimeError."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and bool(_GLOO.search(text) or _NCCL.search(text))


def _reason(exc: BaseException) -> str:
    """The backend's own words, first line, without its source location and sign-off."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    first = re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", first)
    return first.split(" This is typically caused by")[0].strip()


def _timeout_words(exc: BaseException, setting: str) -> str:
    """``--collective-timeout N s``: the group's own timeout where the backend states it,
    else the one :func:`init` set."""
    found = _TIMEOUT_MS.search(str(exc))
    seconds = int(found.group(1) or found.group(2)) / 1000 if found else _timeout_s
    return setting if seconds is None else f"{setting} {seconds:g} s"


def collective_failure(exc: BaseException, setting: str = "--collective-timeout") -> str | None:
    """A gradstep message when ``exc`` (or what it was raised from) is a collective that
    timed out or lost a peer rank; None for any other error.

    The message says which of the two happened, names the timeout in force (``setting``
    is what the user calls it: the demo's flag by default, e.g. ``"timeout_s"`` for
    :func:`init`'s argument) and what to do. It is meant for the surviving ranks: the
    stuck or dead rank's own log holds the cause.
    """
    cause = next((e for e in _chain(exc) if _from_backend(e)), None)
    if cause is None:
        return None
    text = str(cause)
    timeout = _timeout_words(cause, setting)
    said = f"(backend: {_reason(cause)})"
    if _CONNECT.search(text):
        return (
            "could not connect to another rank while creating the process group. After a "
            "torchrun restart (--max-restarts) the new workers may read the dead workers' "
            "addresses from the rendezvous store (torch 2.13, pytorch#135712): launch with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and c10d rendezvous (--rdzv_backend=c10d "
            f"or --standalone). Else check that every rank can reach the others. {said}"
        )
    # Timeout first: NCCL's abort after a watchdog timeout also says the comm was aborted.
    if _TIMED_OUT.search(text):
        return (
            f"a collective timed out ({timeout}): another rank never joined it, so it is "
            "stuck (paused, deadlocked, swapping) or far slower. Check that rank's log; if "
            "a rank is legitimately slow (a long checkpoint, evaluation or data load), "
            f"raise {setting}. {said}"
        )
    if _LOST.search(text):
        return (
            "lost the connection to another rank in a collective: a rank died (crashed, was "
            "killed, ran out of memory) or left early. Check its log; torchrun's summary "
            f"names the rank that failed first. {timeout} did not expire here. {said}"
        )
    return (
        f"a collective failed: a rank is stuck or gone ({timeout} is how long ranks wait). "
        f"Check the other ranks' logs. {said}"
    )
