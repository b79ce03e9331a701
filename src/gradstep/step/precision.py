"""Mixed precision for the step: autocast, fp16 loss scaling, fp32 gradient accumulation.

Three separate concerns, each small:
- ``bf16``/``fp16`` run the forward pass under ``torch.autocast``;
- ``fp16`` scales the loss with ``torch.amp.GradScaler``, unscales exactly once per
  optimizer step (before the norm and the clip), and skips + backs off on overflow;
- parameters stored in a low-precision dtype accumulate their gradients in
  ``accum_dtype`` buffers (float32 by default) and are rounded once, at the step: summing
  many micro-batch gradients in bf16 (8-bit significand) loses precision.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .._handles import removing
from .._validate import check_choice

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
ACCUM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class GradAccumulator:
    """Accumulates the gradients of low-precision parameters in ``dtype`` buffers.

    A post-accumulate-grad hook moves each micro-batch's gradient into the buffer and
    frees ``param.grad`` at once, so at most one low-precision gradient per parameter is
    alive. The hooks exist only inside :meth:`window` (a backward outside ``Stepper.step``,
    or another Stepper on the same model, is left alone). The buffers are kept between
    steps (no re-allocation).
    """

    def __init__(self, params: Sequence[nn.Parameter], dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.params = [p for p in params if p.dtype != dtype]
        self._buffers: dict[int, torch.Tensor] = {}
        self._written: set[int] = set()

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        """Route this window's backward passes into the buffers."""
        self._written.clear()
        with removing(p.register_post_accumulate_grad_hook(self._hook) for p in self.params):
            yield

    def _hook(self, p: torch.Tensor) -> None:
        key = id(p)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty_like(p, dtype=self.dtype)
        if key in self._written:
            buf.add_(p.grad)
        else:
            buf.copy_(p.grad)
            self._written.add(key)
        p.grad = None

    def grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """The accumulated gradient of ``p`` this window, or None."""
        return self._buffers[id(p)] if id(p) in self._written else None

    def round_into_params(self) -> None:
        """The single rounding: buffer -> ``param.grad`` in the parameter's dtype."""
        for p in self.params:
            if id(p) in self._written:
                p.grad = self._buffers[id(p)].to(p.dtype)


class Precision:
    """Owns autocast, the fp16 GradScaler and the accumulation buffers for one Stepper."""

    def __init__(
        self,
        precision: str,
        params: Sequence[nn.Parameter],
        accum_dtype: torch.dtype | None,
        distributed: bool,
        all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
        world_size: int = 1,
    ) -> None:
        check_choice("precision", precision, tuple(PRECISIONS))
        if accum_dtype is not None and accum_dtype not in ACCUM_DTYPES:
            raise ValueError(
                f"accum_dtype must be None or one of {[str(d) for d in ACCUM_DTYPES]}, "
                f"got {accum_dtype!r}"
            )
        self.precision = precision
        self.dtype = PRECISIONS[precision]
        self.device_type = params[0].device.type if params else "cpu"
        low = [p for p in params if p.dtype in (torch.float16, torch.bfloat16)]
        if precision == "fp16" and any(p.dtype == torch.float16 for p in params):
            raise ValueError(
                "precision='fp16' needs float32 parameters: GradScaler cannot unscale fp16 "
                "gradients. Keep the parameters in float32 (autocast computes in fp16) or "
                "use precision='bf16'."
            )
        if accum_dtype is None:
            accum_dtype = torch.float32 if low else None
        self.accumulator: GradAccumulator | None = None
        if accum_dtype is not None and any(p.dtype != accum_dtype for p in params):
            if distributed:
                raise ValueError(
                    "accum_dtype buffers are not supported on a DDP/FSDP model: keep the "
                    "sharded parameters in float32 and compute in bf16 through "
                    "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)"
                )
            self.accumulator = GradAccumulator(params, accum_dtype)
        if precision == "fp16" and self.accumulator is not None:
            # GradScaler unscales only ``param.grad``; scaled gradients in buffers would
            # reach the optimizer multiplied by the loss scale.
            raise ValueError(
                "precision='fp16' needs float32 parameters and accum_dtype None or float32 "
                "(GradScaler unscales param.grad only); use precision='bf16' for bf16 "
                "parameters"
            )
        self.scaler = torch.amp.GradScaler(self.device_type) if precision == "fp16" else None
        self._unscaled = False
        # The first fp16 window measures its pre-scale as the mean item count of its first
        # micro-batch over the ranks: the only collective precision needs.
        self._sum = all_reduce_sum if all_reduce_sum is not None else (lambda t: t)
        self._world = world_size
        self.prescale: float | None = None if precision == "fp16" else 1.0
        """fp16 only: each micro-batch backpropagates ``sum * prescale`` (about 1 / items
        per micro-batch, from the previous window, identical on all ranks) so that scaled
        fp16 gradients stay in the range a mean loss would give; 1.0 otherwise. None: not
        known before the first fp16 backward."""

    @property
    def backward_factor(self) -> float:
        """Loss scale times pre-scale: what a backpropagated loss sum was multiplied by."""
        scale = 1.0 if self.scaler is None else float(self.scaler.get_scale())
        return scale * (1.0 if self.prescale is None else self.prescale)

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def accumulating(self) -> contextlib.AbstractContextManager[None]:
        """Context for the window's backward passes (fp32 buffers when configured)."""
        if self.accumulator is None:
            return contextlib.nullcontext()
        return self.accumulator.window()

    def backward(self, total: torch.Tensor, count: Any) -> None:
        """Backpropagate one micro-batch's loss sum (pre-scaled and loss-scaled in fp16)."""
        if self.prescale is None:
            # fp16's first window: 1 / mean item count of the first micro-batch over ranks.
            local = torch.as_tensor(count, dtype=torch.float64).reshape(1).cpu()
            self.prescale = 1.0 / max(float(self._sum(local)) / self._world, 1.0)
        if self.prescale != 1.0:
            total = total * self.prescale
        (self.scaler.scale(total) if self.scaler is not None else total).backward()

    def end_window(self, global_micro_batches: int, items: int) -> None:
        """After a taken step: the next fp16 window pre-scales by 1 / mean micro-batch items."""
        if self.scaler is not None:
            self.prescale = global_micro_batches / items

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide by the loss scale, once per optimizer step."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
            self._unscaled = True

    def named_grads(
        self, named: Sequence[tuple[str, nn.Parameter]]
    ) -> list[tuple[str, nn.Parameter, torch.Tensor]]:
        """Every gradient of this window with its parameter: ``.grad`` or the fp32 buffer."""
        out = [(n, p, p.grad) for n, p in named if p.grad is not None]
        if self.accumulator is not None:
            out += [(n, p, g) for n, p in named if (g := self.accumulator.grad(p)) is not None]
        return out

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.accumulator is not None:
            self.accumulator.round_into_params()
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        self._unscaled = False

    def skip(self, optimizer: torch.optim.Optimizer, overflow: bool) -> None:
        """Close an fp16 step that will not be taken.

        On overflow the scale backs off. Any other skip (empty window, a spike guard, an
        error) leaves the scale and its growth counter as they were: that step was not a
        step at all.
        """
        if self.scaler is not None and self._unscaled:
            states = _optimizer_states(self.scaler)
            if overflow:
                # The skip decision comes from the global norm, GradScaler's found_inf
                # from the gradients' own values: finite gradients whose norm overflows
                # (or an inf a backend did not spread to every rank) would leave the scale
                # where it is on some ranks. Make the scaler agree with the decision, so
                # every rank backs off the same way.
                for found_inf in states[id(optimizer)]["found_inf_per_device"].values():
                    found_inf.fill_(1.0)
                self.scaler.update()
            else:
                # Forget this step's unscale (the per-optimizer state is a defaultdict
                # that starts fresh), without counting it towards the scale's growth.
                states.pop(id(optimizer), None)
        self._unscaled = False

    @property
    def loss_scale(self) -> float | None:
        return float(self.scaler.get_scale()) if self.scaler is not None else None

    def state_dict(self) -> dict:
        """The fp16 scaler's state and the pre-scale of the next window (None: unknown)."""
        return {
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "prescale": self.prescale,
        }

    def load_state_dict(self, state: dict, prescale: float | None = None) -> None:
        """Restore :meth:`state_dict`. ``prescale`` is for states saved without their own
        (before it moved in here, the Stepper kept it); the state's entry wins."""
        if self.scaler is None:
            return  # fp32/bf16: the pre-scale is 1 whatever the run that saved it used
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.prescale = state.get("prescale", prescale)


def _optimizer_states(scaler: torch.amp.GradScaler) -> dict[int, dict[str, Any]]:
    """GradScaler's per-optimizer record of this step's unscale (``found_inf_per_device``).

    Private torch API (2.13): the one place that reads it, for the next torch upgrade to
    check. A ``defaultdict``: popping an optimizer's entry forgets its unscale.
    """
    return scaler._per_optimizer_states
