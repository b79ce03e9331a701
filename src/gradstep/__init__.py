"""gradstep: the exact accumulate-and-clip optimizer step.

Many micro-batches make one optimizer step equal to the step of one large batch, clipped
on the global, unscaled norm, in any precision, with every event reported.

The package, one concern per module:

- :mod:`gradstep.step.stepper`: the step (``Stepper``), what it reports (:mod:`gradstep.step.stats`:
  ``StepStats``);
- :mod:`gradstep.step.loop`: windows of micro-batches (``windows``) and their accounting;
- :mod:`gradstep.step.oom` and :mod:`gradstep.step.norm`: the step's optional parts (splitting
  micro-batches on out-of-memory, the gradient norm taken during the last backward);
- :mod:`gradstep.step.loss`: ``LossSum`` and ``token_loss``;
- :mod:`gradstep.step.precision`: autocast, fp16 loss scaling, fp32 accumulation buffers;
- :mod:`gradstep.policies`: clip policies and their registry;
- :mod:`gradstep.step.hooks`: observers of the step (``Stepper(..., hooks=[...])``);
- :mod:`gradstep.gns` and :mod:`gradstep.lr`: the gradient noise scale, LR scaling with the batch;
- :mod:`gradstep.hf`: Hugging Face causal LMs (``causal_lm_loss``), imported on first use;
- :mod:`gradstep.parallel`: strategies, collectives and setup for DDP / FSDP2;
- :mod:`gradstep.checkpoint`: atomic, verified, elastic checkpoints;
- :mod:`gradstep.metrics` and :mod:`gradstep_cli.report`: per-step records, plots.
"""

from . import checkpoint, metrics, optim, parallel, policies
from ._version import __version__
from .checkpoint import Checkpointer, CheckpointError, CheckpointInfo, elastic_accum_steps
from .errors import GradstepError, UnsupportedSetup
from .gns import GradientNoiseScale
from .lr import scale_lr
from .metrics import MetricsLogger
from .parallel import Strategy
from .policies import (
    AGC,
    AutoClip,
    ClipNorm,
    ClipPolicy,
    ClipResult,
    ClipValue,
    GradientView,
    SpikeGuard,
    ZClip,
    find_output_layer,
)
from .step.hooks import StepHook
from .step.loop import windows
from .step.loss import LossSum, token_loss
from .step.stats import StepStats
from .step.stepper import Stepper

__all__ = [
    "AGC",
    "AutoClip",
    "CheckpointError",
    "CheckpointInfo",
    "Checkpointer",
    "ClipNorm",
    "ClipPolicy",
    "ClipResult",
    "ClipValue",
    "GradientNoiseScale",
    "GradientView",
    "GradstepError",
    "LossSum",
    "MetricsLogger",
    "SpikeGuard",
    "StepHook",
    "StepStats",
    "Stepper",
    "Strategy",
    "UnsupportedSetup",
    "ZClip",
    "__version__",
    "checkpoint",
    "elastic_accum_steps",
    "find_output_layer",
    "metrics",
    "optim",
    "parallel",
    "policies",
    "scale_lr",
    "token_loss",
    "windows",
]


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    # ``gradstep.hf`` needs the optional transformers: imported on first use.
    if name == "hf":
        import importlib

        return importlib.import_module(".hf", __name__)
    raise AttributeError(f"module 'gradstep' has no attribute {name!r}")
