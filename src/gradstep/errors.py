"""The error types gradstep raises, under one base so callers can catch them together.

Each specific error also derives from the built-in it refines (``ValueError`` for bad
input, ``NotImplementedError`` for a setup gradstep does not support), so code written
against the built-ins keeps working.
"""

from __future__ import annotations

__all__ = ["GradstepError", "MicroBatchTooLarge", "UnsupportedSetup"]


class GradstepError(Exception):
    """Base of every error gradstep raises on purpose."""


class UnsupportedSetup(GradstepError, NotImplementedError):
    """A parallel layout or model gradstep cannot keep exact (e.g. tensor parallel meshes)."""


class MicroBatchTooLarge(GradstepError, MemoryError):
    """``on_oom="split"`` reached micro-batches of one item and they still do not fit."""
