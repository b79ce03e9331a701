"""Windows of micro-batches: one window is one optimizer step."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

__all__ = ["mark_last", "windows"]

T = TypeVar("T")


def windows(iterable: Iterable[T], size: int) -> Iterator[list[T]]:
    """Group a stream of micro-batches into windows of ``size`` (the last may be shorter)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"windows: size must be an int >= 1, got {size!r}")
    return _windows(iter(iterable), size)


def _windows(it: Iterator[T], size: int) -> Iterator[list[T]]:
    while True:
        window = []
        for item in it:
            window.append(item)
            if len(window) == size:
                break
        if not window:
            return
        yield window
        if len(window) < size:
            return


def mark_last(iterable: Iterable[T]) -> Iterator[tuple[bool, T]]:
    """Yield (is_last, item), looking one ahead so the last is known before its forward."""
    it = iter(iterable)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield False, prev
        prev = item
    yield True, prev
