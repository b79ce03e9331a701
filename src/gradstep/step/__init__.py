"""The step, one file per phase, in the order :meth:`Stepper._step` runs them.

- :mod:`.stepper`: ``Stepper``, the step top to bottom;
- :mod:`.loop`: windows of micro-batches and the one micro-batch loop (forward, loss,
  backward; gradient sync on the last micro-batch only);
- :mod:`.loss`: ``LossSum`` (a sum and its item count), ``token_loss`` and
  ``chunked_token_loss`` (never the whole logits);
- :mod:`.tally`: the window's accounting, its one collective and one host read;
- :mod:`.norm`: the global gradient norm, the one owner of how a strategy's gradient
  layout becomes it (after backward, or during the last backward);
- :mod:`.precision`: autocast, fp16 loss scaling, float32 accumulation buffers;
- :mod:`.oom`: out-of-memory turned into a split window every rank agrees on;
- :mod:`.hooks`: observers called at fixed points of the step;
- :mod:`.stats`: ``StepStats``, what one step reports.

Clip policies (:mod:`gradstep.policies`) and strategies (:mod:`gradstep.parallel`) are the
step's two seams; they live in their own packages.
"""

from .hooks import Hooks, StepHook
from .loop import windows
from .loss import CHUNK_TOKENS, LossSum, chunked_token_loss, token_loss
from .oom import (
    MAX_HALVINGS,
    ON_OOM,
    OOMAgreement,
    OOMSplitter,
    SplitFn,
    WindowOOM,
    halve,
    is_out_of_memory,
    split_in_half,
    too_large_error,
)
from .stats import StepStats
from .stepper import LossFn, Stepper

__all__ = [
    "CHUNK_TOKENS",
    "MAX_HALVINGS",
    "ON_OOM",
    "Hooks",
    "LossFn",
    "LossSum",
    "OOMAgreement",
    "OOMSplitter",
    "SplitFn",
    "StepHook",
    "StepStats",
    "Stepper",
    "WindowOOM",
    "chunked_token_loss",
    "halve",
    "is_out_of_memory",
    "split_in_half",
    "too_large_error",
    "token_loss",
    "windows",
]
