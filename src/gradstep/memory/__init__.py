"""Fitting the step into a memory limit: checkpointing, estimates, probes, plans, recovery."""

from __future__ import annotations

from .checkpointing import checkpoint_blocks
from .hf_config import from_hf_config
from .hf_shape import HFShape
from .model import MemoryEstimate, TransformerShape, estimate_step_memory
from .plan import (
    Candidate,
    Plan,
    default_step_time,
    plan_step,
    probe_step_time,
    step_predictor,
)
from .probe import (
    KERNEL_CACHE_CAPACITY,
    ProbeResult,
    bound_kernel_caches,
    current_bytes,
    peak_bytes,
    pin_mmap_threshold,
    probe_memory,
    reset_peak,
    runtime_bytes,
)
from .units import format_bytes, parse_size

__all__ = [
    "KERNEL_CACHE_CAPACITY",
    "Candidate",
    "HFShape",
    "MemoryEstimate",
    "Plan",
    "ProbeResult",
    "TransformerShape",
    "bound_kernel_caches",
    "checkpoint_blocks",
    "current_bytes",
    "default_step_time",
    "estimate_step_memory",
    "format_bytes",
    "from_hf_config",
    "parse_size",
    "peak_bytes",
    "pin_mmap_threshold",
    "plan_step",
    "probe_memory",
    "probe_step_time",
    "reset_peak",
    "runtime_bytes",
    "step_predictor",
]
