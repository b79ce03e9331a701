"""The one error type of :mod:`gradstep.checkpoint`."""

from __future__ import annotations

from ..errors import GradstepError

__all__ = ["CheckpointError"]


class CheckpointError(GradstepError, ValueError):
    """A checkpoint cannot be written or does not fit the objects it is loaded into."""
