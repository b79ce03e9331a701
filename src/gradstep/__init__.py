"""gradstep: the exact accumulate-and-clip optimizer step.

Many micro-batches make one optimizer step equal to the step of one large batch, clipped
on the global, unscaled norm, in any precision, with every event reported.
"""

from . import distributed, metrics
from .adaptive import AGC, AutoClip, SpikeGuard, ZClip, find_output_layer
from .checkpoint import Checkpointer, CheckpointError
from .clip import ClipContext, ClipNorm, ClipPolicy, ClipResult, ClipValue, parse_clip
from .loss import LossSum, token_loss
from .stepper import Stepper, StepStats, windows

__version__ = "0.1.0"

__all__ = [
    "AGC",
    "AutoClip",
    "CheckpointError",
    "Checkpointer",
    "ClipContext",
    "ClipNorm",
    "ClipPolicy",
    "ClipResult",
    "ClipValue",
    "LossSum",
    "SpikeGuard",
    "StepStats",
    "Stepper",
    "ZClip",
    "__version__",
    "distributed",
    "find_output_layer",
    "metrics",
    "parse_clip",
    "token_loss",
    "windows",
]
