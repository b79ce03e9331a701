"""The budget a refusal quotes (``a budget of at least ... fits it``): one under which the
same plan succeeds, not only the smallest candidate's predicted peak with the margin."""

from __future__ import annotations

import torch

from gradstep.memory import SHAPE_GUESS_BYTES, Candidate, ProbeResult, needed_budget
from gradstep_cli.plan.budget import MARGIN

__all__ = ["QUOTE_SLACK", "needed", "quote", "room"]

QUOTE_SLACK = 0.02
"""A refusal's quoted budget holds the smallest candidate with this much to spare: the
probe of another process measures a few MiB differently (CPU: 7.7 vs 8.3 MiB per item)."""


def room(device: torch.device, packed: bool) -> int:
    """What the probe must leave free above a step for the data's other input shapes to be
    measured (CPU: their kernels; nothing when there is one shape, packed rows)."""
    return 0 if device.type != "cpu" or packed else SHAPE_GUESS_BYTES


def quote(peak: float) -> int:
    """The budget a refusal quotes for a step peaking at ``peak``: its margin, and slack."""
    return needed_budget(peak * (1 + QUOTE_SLACK), MARGIN)


def needed(cand: Candidate, result: ProbeResult | None, room_bytes: int) -> int:
    """The budget a refusal quotes for ``cand``. When the budget left the probe no room to
    run the data's other shapes, the prediction carries the smallest step's whole cost for
    them (the safe side, when planning); at the quoted budget the sweep runs and measures
    them, so the quote holds the step and the sweep's room (``room_bytes``) instead, and
    the probe's first step with that room (what the sweep waits for)."""
    peak = cand.predicted_peak_bytes
    if result is not None and result.shapes_unmeasured:
        first = result.points[0][1]
        peak = max(peak - result.shape_bytes + room_bytes, first + room_bytes)
    return quote(peak)
