"""The process's memory in bytes, checked against a second, independent reading.

``current_bytes``/``peak_bytes`` read ``/proc/self/status`` (kB); the reference here is
``/proc/self/statm`` (pages times the page size), a different file in different units, so
a wrong unit (kB taken as 1000 bytes: 2.3 % low, some 10 MiB on this process) shows. A
held-out mutation audit found that bug surviving (issue 20, section 4).
"""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

import pytest
import torch

from gradstep.memory import current_bytes, peak_bytes, reset_peak

MiB = 2**20
TOLERANCE = MiB
"""What the process may change between two readings a few microseconds apart."""

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not Path("/proc/self/statm").exists(),
    reason="needs Linux's /proc/self/statm",
)


def statm_bytes() -> int:
    """Resident set from /proc/self/statm: pages, times the page size."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def bracketed(read: object) -> tuple[int, int, int]:
    """(statm before, ``read()``, statm after), retried until the process held still."""
    for _ in range(20):
        before, got, after = statm_bytes(), read(), statm_bytes()  # type: ignore[operator]
        if abs(after - before) <= TOLERANCE:
            break
    return before, got, after


def test_current_bytes_is_the_resident_set_in_bytes():
    held = torch.ones(64 * MiB // 4)  # touched: resident, so the process is well above 64 MiB
    before, got, after = bracketed(lambda: current_bytes("cpu"))
    assert min(before, after) - TOLERANCE <= got <= max(before, after) + TOLERANCE
    assert got > 64 * MiB
    del held


def test_the_peak_since_a_reset_is_the_high_water_mark_in_bytes():
    if reset_peak("cpu") != "vmhwm":
        pytest.skip("/proc/self/clear_refs cannot be written here: no peak reset")
    held = torch.ones(96 * MiB // 4)
    with_block = statm_bytes()  # the highest the process has been since the reset
    del held  # a large block goes back to the system: the resident set drops again
    peak = peak_bytes("cpu")
    assert peak >= with_block - TOLERANCE
    # The process's lifetime peak (never reset; KiB on Linux) bounds it from above.
    assert peak <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 + TOLERANCE
    assert peak > statm_bytes() + 64 * MiB  # the freed block is in the peak, not in use
