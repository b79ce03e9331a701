"""``--compile``: ``torch.compile`` of each transformer block, the demo GPT's ``blocks`` and an
HF causal LM's decoder layers (found as activation checkpointing and FSDP2 find them:
:func:`gradstep.parallel.find_blocks`).

- **Per block**: the blocks are alike, so one graph serves them all (one compile, not one
  per layer), and the wrappers around them (DDP, FSDP2's per-block hooks, the loss) stay
  eager.
- **The block's forward is replaced, the module kept** (as
  :func:`gradstep.memory.checkpoint_blocks` does): parameter names and ``state_dict`` keys
  do not change (no ``_orig_mod.``), so checkpoints, export and FSDP2's sharding are those of
  the eager run, and FSDP2's hooks, which run around ``forward``, stay outside the graph.
- **Training only**: a forward without autograd (evaluation, samples, generation) runs the
  block eagerly. Generation grows its context one token at a time, and with fixed shapes
  each length would be a new compile.
- **Fixed shapes** (``dynamic=False``): each micro-batch shape compiles once. Past torch's
  limit of 8 shapes (``torch._dynamo.config.recompile_limit``) new shapes run eagerly, with
  torch's warning; ``--packing`` gives every micro-batch the same shape.
- **Exact against eager**: inductor fuses and reorders float32 arithmetic (results equal to
  rounding), and draws dropout masks from torch's own generator as the eager block does
  (``fallback_random``), so a run with dropout is the eager run's too.

The order is torchtitan's: tensor parallel, activation checkpointing, compile, FSDP2/DDP
(:mod:`gradstep_cli.run.build`). Compiling is lazy, at a block's first training forward
(after ``--tp`` has split the block), so the first step carries the compile time
(:func:`compile_seconds`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from gradstep.parallel import find_blocks
from gradstep_cli.config.checks import ConfigError

__all__ = ["check_compile", "compile_blocks", "compile_note", "compile_seconds"]

_MARK = "_gradstep_compiled"

_INDUCTOR = {"fallback_random": True}
"""Dropout masks from torch's generator, as eager draws them (inductor's own differ)."""


def check_compile(device: torch.device) -> None:
    """Refuse ``--compile`` where torch cannot compile (before the model is built)."""
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        raise ConfigError(
            "--compile: torch.compile is not supported on this Python / torch build; train "
            "without --compile"
        )
    if device.type == "cpu" and _cpp_compiler() is None:
        raise ConfigError(
            "--compile on the CPU needs a C++ compiler (torch.compile's inductor builds its "
            "kernels with g++ or clang++; the CXX environment variable names another): "
            "install one, or train without --compile"
        )


def _cpp_compiler() -> str | None:
    """The C++ compiler inductor would use (None: none found). Asking costs one
    ``--version`` call of the compiler; a torch that cannot be asked is not refused here
    (a failed build is still one line naming the flag: :func:`_training_compiled`)."""
    try:
        from torch._inductor import cpp_builder, exc
    except ImportError:
        return "unknown"
    try:
        return cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        return None


def compile_blocks(model: nn.Module) -> int:
    """Compile the forward of every block of ``model`` (in place) with
    ``torch.compile(dynamic=False)``; returns the number of blocks.

    Call it after :func:`gradstep.memory.checkpoint_blocks` (the checkpointed block is what
    is compiled, recompute included) and before FSDP2/DDP wrap the model. Compiling twice is
    a no-op.
    """
    blocks = find_blocks(model)
    if not blocks:
        raise ValueError("--compile: the model has no nn.ModuleList of transformer blocks")
    for block in blocks:
        if not getattr(block, _MARK, False):
            forward = _training_compiled(block.forward, type(block).__name__)
            block.forward = forward  # type: ignore[method-assign]
            setattr(block, _MARK, True)
    return len(blocks)


def _training_compiled(eager: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``eager``, compiled where autograd records (training); eager elsewhere."""
    import torch._dynamo

    compiled = torch.compile(eager, dynamic=False, options=_INDUCTOR)
    # An HF attention sets and resets a context variable in its forward (the `kernels`
    # package's routing); inside a checkpointed block dynamo would not trace that and would
    # leave the whole block eager. Set and reset within the forward, it needs no replay in
    # the recompute.
    skip = "skip_fwd_side_effects_in_bwd_under_checkpoint"  # absent from older torch
    known = {skip: True} if hasattr(torch._dynamo.config, skip) else {}
    traceable = torch._dynamo.config.patch(known)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return eager(*args, **kwargs)
        try:
            with traceable:
                return compiled(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as exc:
            raise ConfigError(
                f"--compile: torch.compile could not build {name}'s kernels "
                f"({type(exc.inner_exception).__name__}: {exc.inner_exception}); train "
                "without --compile"
            ) from exc

    return forward


def compile_note(model: nn.Module) -> str:
    """The line the run says about its compiled blocks."""
    blocks = find_blocks(model)
    return (
        f"--compile: {len(blocks)} transformer blocks ({type(blocks[0]).__name__}) compiled "
        "with torch.compile (fixed shapes); the first step compiles them, its extra time is "
        "reported at the end"
    )


def compile_seconds(step_seconds: Sequence[float]) -> float | None:
    """What the first step took beyond the median of the later ones: the compile (and any
    other first-step cost an eager run pays too, a fraction of a second on the CPU).
    None with fewer than 2 steps."""
    if len(step_seconds) < 2:
        return None
    return max(0.0, step_seconds[0] - statistics.median(step_seconds[1:]))
