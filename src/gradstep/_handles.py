"""Hooks that live for one ``with`` block: every temporary registration goes through here."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["removing"]


@contextlib.contextmanager
def removing(handles: Iterable[Any]) -> Iterator[None]:
    """Yield, then remove every handle (``RemovableHandle``), even when the block raises."""
    held = list(handles)
    try:
        yield
    finally:
        for h in held:
            h.remove()
