"""Fitting the step into a memory limit: checkpointing, estimates, probes, plans, recovery."""

from __future__ import annotations

from .checkpointing import checkpoint_blocks

__all__ = ["checkpoint_blocks"]
