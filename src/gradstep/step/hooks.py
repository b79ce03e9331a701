"""Observers of the step: ``Stepper(..., hooks=[...])``.

A hook is any object with some of the methods below; the Stepper calls the ones it has, at
fixed points of every step, in the order the hooks were given. Hooks observe: they must not
change gradients, parameters or optimizer state (clip policies are the things that decide,
:mod:`gradstep.policies`). A hook with ``state_dict()``/``load_state_dict()`` is saved and
restored with ``Stepper.state_dict()``, like a stateful clip policy.

The points, in step order:

- ``on_step_start(stepper)``: before the first micro-batch (gradients already zeroed).
- ``on_param_grad(stepper, index, name, param, grad)``: during micro-batch ``index``'s
  backward, once per parameter, with that micro-batch's OWN gradient before it is summed
  into the accumulation, on every strategy (under FSDP2: the full, unsharded gradient of
  this rank's micro-batch, before the reduce-scatter; ``grad`` is the local, un-normalised
  gradient of the loss SUM,
  multiplied by the fp16 loss scale and pre-scale when fp16 runs: divide by
  ``stepper.loss_scale_factor`` to undo both). Under FSDP2 + tensor parallel it is this
  rank's view of that gradient: a DTensor on the tensor-parallel mesh for a parameter in
  the plan (``Shard``, ``Replicate``, or ``Partial`` for a sequence-parallel norm), a plain
  tensor copied on every tensor-parallel peer for one outside it; measure it whole as
  :class:`~gradstep.GradientNoiseScale` does. The tensor is only lent: read it (a norm, a
  dot product) and keep scalars, so no full-size buffer is needed. Only hooks that define
  this method cost anything: the Stepper registers the gradient hooks for them alone.
- ``on_micro_batch_end(stepper, index, is_last, loss)``: after micro-batch ``index``'s
  backward, with the validated :class:`~gradstep.LossSum` it returned.
- ``on_norm(stepper, view)``: once the global pre-clip norm is known, before any policy
  acts. ``view`` is the :class:`~gradstep.GradientView`: ``view.norm`` (normalised,
  unscaled, every rank and shard), ``view.raw_grads()`` with ``view.pending_scale`` (the
  normalised gradient is their product; read-only), ``view.total_norm(p)``.
- ``on_step_end(stepper, stats)``: after every step, taken or skipped, with its
  :class:`~gradstep.StepStats`.

A step that raises calls no further hook; ``on_step_start`` is then not matched by an
``on_step_end``, so a hook that keeps per-window state resets it in ``on_step_start``. The
same holds for a window redone after out-of-memory (``on_oom="split"``): it starts again
with ``on_step_start``, and its micro-batch indices count the halved micro-batches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from .._handles import removing
from ..policies import GradientView
from .loss import LossSum

# The Stepper passes itself; typed loosely so this module does not import the one that
# imports it.
Stepper = Any
StepStats = Any
Calls = tuple[Callable[..., Any], ...]
"""The bound methods one hook point calls, in the hooks' order (empty: nobody listens)."""

__all__ = ["HOOK_POINTS", "Hooks", "StepHook"]

HOOK_POINTS = ("on_step_start", "on_param_grad", "on_micro_batch_end", "on_norm", "on_step_end")


class StepHook(Protocol):
    """The full set of hook points; a hook implements any subset (see the module docs)."""

    def on_step_start(self, stepper: Stepper) -> None: ...

    def on_param_grad(
        self, stepper: Stepper, index: int, name: str, param: nn.Parameter, grad: torch.Tensor
    ) -> None: ...

    def on_micro_batch_end(
        self, stepper: Stepper, index: int, is_last: bool, loss: LossSum
    ) -> None: ...

    def on_norm(self, stepper: Stepper, view: GradientView) -> None: ...

    def on_step_end(self, stepper: Stepper, stats: StepStats) -> None: ...


class Hooks:
    """The Stepper's dispatcher: for each point, the bound methods of the hooks that have it.

    Looked up once at construction, so a step with no hooks pays one empty-tuple check per
    point and nothing else.
    """

    def __init__(self, hooks: Any) -> None:
        items = [] if hooks is None else list(hooks) if isinstance(hooks, (list, tuple)) else None
        if items is None:
            raise TypeError(f"hooks must be a list of hook objects, got {type(hooks).__name__}")
        for h in items:
            if isinstance(h, type) or not any(callable(getattr(h, p, None)) for p in HOOK_POINTS):
                raise TypeError(
                    f"hooks: {h!r} is not a hook; a hook is an object with at least one of "
                    f"{', '.join(HOOK_POINTS)}"
                )
        self.items = items
        self.on_step_start: Calls = self._bound("on_step_start")
        self.on_param_grad: Calls = self._bound("on_param_grad")
        self.on_micro_batch_end: Calls = self._bound("on_micro_batch_end")
        self.on_norm: Calls = self._bound("on_norm")
        self.on_step_end: Calls = self._bound("on_step_end")

    def _bound(self, point: str) -> Calls:
        """The bound ``point`` methods of the hooks that have one, in the hooks' order."""
        return tuple(getattr(h, point) for h in self.items if hasattr(h, point))

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def param_grads(
        self,
        stepper: Stepper,
        targets: Callable[[], Sequence[tuple[str, nn.Parameter, torch.Tensor]]],
        index: int,
    ) -> contextlib.AbstractContextManager[None]:
        """Lend each parameter's micro-batch gradient to ``on_param_grad`` during one backward.

        ``Tensor.register_hook`` on a leaf sees the gradient before autograd adds it to
        ``.grad`` (and before DDP's reducer or the fp32 accumulation buffers take it).
        ``targets()`` says which tensor carries each parameter's gradient (under FSDP2 the
        unsharded copy: :meth:`gradstep.parallel.Strategy.hook_targets`); it is asked
        only when some hook observes gradients.
        """
        calls = self.on_param_grad
        if not calls:  # the common case costs no generator per micro-batch
            return contextlib.nullcontext()
        return self._lend_grads(stepper, targets, index, calls)

    @staticmethod
    @contextlib.contextmanager
    def _lend_grads(
        stepper: Stepper,
        targets: Callable[[], Sequence[tuple[str, nn.Parameter, torch.Tensor]]],
        index: int,
        calls: Calls,
    ) -> Iterator[None]:
        def make(name: str, param: nn.Parameter):  # type: ignore[no-untyped-def]
            def seen(grad: torch.Tensor) -> None:
                for call in calls:
                    call(stepper, index, name, param, grad)

            return seen

        with removing(t.register_hook(make(n, p)) for n, p, t in targets()):
            yield
