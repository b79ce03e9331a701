"""Fitting the step into a memory limit: checkpointing, estimates, probes, plans.

- :mod:`.model` (with :mod:`.states`, :mod:`.activations`, :mod:`.hf_activations`): the
  analytic model, :func:`estimate_step_memory` of a :class:`TransformerShape` or an
  :class:`HFShape` (:func:`from_hf_config`), the optimizer as an :class:`OptimizerMemory`;
- :mod:`.probe`: :func:`probe_memory`, real steps measured (:class:`ProbeResult`);
- :mod:`.plan`: :func:`plan_step`, the fastest split of the global batch within a budget;
  :mod:`.speed`: :func:`step_time_model`, how it ranks candidates (a count of their work);
- :mod:`.process`: what a process's memory is, and the settings a CPU budget relies on;
- :mod:`.checkpointing`: :func:`checkpoint_blocks`; :mod:`.units`: sizes as text.

Constants calibrated on CPU with torch 2.13 and the demo GPT say so where they are defined
(the runtime's lazy costs, the checkpointing time factor, the shape sweep's threshold).
"""

from __future__ import annotations

from .checkpointing import checkpoint_blocks
from .hf_activations import chunks_loss
from .hf_config import from_hf_config, lora_targets
from .hf_shape import HFShape
from .model import MemoryEstimate, Shape, TransformerShape, estimate_step_memory
from .plan import (
    BudgetTooSmall,
    Candidate,
    Plan,
    budget_text,
    default_step_time,
    needed_budget,
    plan_step,
    probe_step_time,
    step_predictor,
    sweep_widths,
)
from .probe import (
    KERNEL_CACHE_CAPACITY,
    SHAPE_GUESS_BYTES,
    ProbeResult,
    bound_kernel_caches,
    current_bytes,
    peak_bytes,
    pin_mmap_threshold,
    probe_memory,
    reset_peak,
    runtime_bytes,
)
from .process import available_bytes
from .speed import step_time_model
from .states import OptimizerMemory
from .units import format_bytes, parse_size

__all__ = [
    "KERNEL_CACHE_CAPACITY",
    "SHAPE_GUESS_BYTES",
    "BudgetTooSmall",
    "Candidate",
    "HFShape",
    "MemoryEstimate",
    "OptimizerMemory",
    "Plan",
    "ProbeResult",
    "Shape",
    "TransformerShape",
    "available_bytes",
    "bound_kernel_caches",
    "budget_text",
    "checkpoint_blocks",
    "current_bytes",
    "default_step_time",
    "estimate_step_memory",
    "format_bytes",
    "chunks_loss",
    "from_hf_config",
    "lora_targets",
    "needed_budget",
    "parse_size",
    "peak_bytes",
    "pin_mmap_threshold",
    "plan_step",
    "probe_memory",
    "probe_step_time",
    "reset_peak",
    "runtime_bytes",
    "step_predictor",
    "step_time_model",
    "sweep_widths",
]
