"""The optimizer step built from many micro-batches, exactly as one large batch would give.

``Stepper.step`` is one linear function: zero grads -> micro-batches (forward, loss,
backward; gradient sync only on the last) -> normalise -> unscale -> global norm ->
finite check -> clip -> optimizer step -> scheduler step.

Normalisation has exactly one owner: the factor ``grad_divisor / (items * loss_hint)``
computed in :meth:`Stepper.step`. Losses are backpropagated as *sums*; the window's item
count (over every micro-batch and every rank) is only known at the end, so the sum is
divided once, afterwards, folded into the same multiply that applies the clip.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from .clip import ClipContext, ClipNorm, as_policies
from .loss import LossSum, check_loss_sum
from .precision import Precision
from .strategy import LocalStrategy, strategy_for, window_length_error

T = TypeVar("T")
LossFn = Callable[[nn.Module, Any], LossSum]
_DEFAULT_CLIP = object()


@dataclass
class StepStats:
    """What one optimizer step did. ``grad_norm`` is the PRE-clip global norm."""

    loss: float
    """Window mean loss: sum of per-item losses / item count, over all ranks."""
    items: int
    micro_batches: int
    grad_norm: float
    """Global norm of the normalised, unscaled gradient before clipping (nan/inf if so)."""
    clip_coef: float
    clipped: bool
    skipped: bool
    lr: float
    step: int
    """Optimizer steps taken so far (skipped steps do not count)."""
    skip_reason: str | None = None
    clip_threshold: float | None = None
    post_clip_norm: float = math.nan
    loss_scale: float | None = None
    policies: list[dict] = field(default_factory=list)
    """Per clip policy: name, threshold used, whether it acted."""


def windows(iterable: Iterable[T], size: int) -> Iterator[list[T]]:
    """Group a stream of micro-batches into windows of ``size`` (the last may be shorter)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"windows: size must be an int >= 1, got {size!r}")
    return _windows(iter(iterable), size)


def _windows(it: Iterator[T], size: int) -> Iterator[list[T]]:
    while True:
        window = []
        for item in it:
            window.append(item)
            if len(window) == size:
                break
        if not window:
            return
        yield window
        if len(window) < size:
            return


def _mark_last(iterable: Iterable[T]) -> Iterator[tuple[bool, T]]:
    """Yield (is_last, item), looking one ahead so the last is known before its forward."""
    it = iter(iterable)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield False, prev
        prev = item
    yield True, prev


@dataclass
class _Window:
    loss_sum: float
    items: int
    micro_batches: int
    raw_norm: float = math.nan
    """Global norm of the summed (not yet normalised) gradient."""


class Stepper:
    """One exact optimizer step from a window of micro-batches.

    Args:
        model: the module (plain, DDP, or FSDP2 ``fully_shard``-ed; detected automatically).
        optimizer: any ``torch.optim.Optimizer``.
        scheduler: any LR scheduler; stepped once per optimizer step, never on a skip.
        clip: a clip policy, a list of them (applied in order), or None.
        precision: ``"fp32"``, ``"bf16"`` (autocast) or ``"fp16"`` (autocast + GradScaler).
        accum_dtype: dtype gradients accumulate in; None means float32 for parameters held
            in bf16/fp16, and the parameter dtype otherwise.
        sync_each_micro_batch: reduce gradients after every micro-batch (FSDP memory)
            instead of only after the last.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any | None = None,
        clip: Any = _DEFAULT_CLIP,
        precision: str = "fp32",
        accum_dtype: torch.dtype | None = None,
        sync_each_micro_batch: bool = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.clip = as_policies(ClipNorm(1.0) if clip is _DEFAULT_CLIP else clip)
        self.sync_each_micro_batch = bool(sync_each_micro_batch)
        self._named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._params = [p for _, p in self._named]
        self._strategy = strategy_for(model)
        distributed = not isinstance(self._strategy, LocalStrategy)
        self._precision = Precision(precision, self._params, accum_dtype, distributed)
        self._norm_type = next(
            (float(p.norm_type) for p in self.clip if hasattr(p, "norm_type")), 2.0
        )
        # fp16 only: backpropagate sum * loss_hint (~ 1 / items per micro-batch, from the
        # previous window, identical on all ranks) so scaled fp16 gradients stay in the
        # range a mean loss would give. None = not known yet (first fp16 window).
        self._loss_hint: float | None = None if precision == "fp16" else 1.0
        self.step_count = 0
        self.skipped_steps = 0
        self.clipped_steps = 0
        self.skip_reasons: Counter[str] = Counter()

    @property
    def precision(self) -> str:
        return self._precision.precision

    @property
    def world_size(self) -> int:
        return self._strategy.world_size

    def step(self, micro_batches: Iterable[Any], loss_fn: LossFn) -> StepStats:
        """Run one window of micro-batches and take (or skip) one optimizer step."""
        if isinstance(micro_batches, (dict, torch.Tensor)):
            raise TypeError(
                "micro_batches must be an iterable of micro-batches forming one window; "
                "wrap a single batch in a list: stepper.step([batch], loss_fn)"
            )
        if self._strategy.forward_communicates:
            # FSDP2's forward all-gathers parameters: a rank with one micro-batch more
            # would pair those all-gathers with the other ranks' reductions and hang, so
            # the window lengths are compared before the first forward (one collective).
            micro_batches = list(micro_batches)
            self._strategy.check_window(len(micro_batches))
        try:
            return self._step(micro_batches, loss_fn)
        except BaseException:
            # A failed step leaves nothing behind: no gradients, no half-done fp16 unscale.
            self._precision.skip(self.optimizer, overflow=False)
            self.optimizer.zero_grad(set_to_none=True)
            raise

    def _step(self, micro_batches: Iterable[Any], loss_fn: LossFn) -> StepStats:
        """zero -> accumulate -> unscale -> norm -> normalise -> finite -> clip -> step."""
        self.optimizer.zero_grad(set_to_none=True)
        totals, n = self._accumulate(micro_batches, loss_fn)
        self._precision.unscale(self.optimizer)
        named_grads = self._precision.named_grads(self._named)
        grads = [g for _, _, g in named_grads]
        raw_norm = self._strategy.total_norm(grads, self._norm_type)
        window = self._read_window(totals, raw_norm, n)
        if window.items == 0:
            return self._skip(window, "empty window: 0 items (every label ignored)", math.nan)
        # THE normalisation: undo the backend's average over ranks and divide the summed
        # losses' gradient by the true global item count, once.
        scale = self._strategy.grad_divisor / (window.items * self._loss_hint)
        norm = window.raw_norm * scale
        if not math.isfinite(norm):
            return self._skip(window, "non-finite gradient norm", norm, overflow=True)
        ctx = ClipContext(
            grads, scale, norm, self._norm_type, window.loss_sum / window.items,
            self.step_count, self._named, self._strategy.total_norm,
            grad_owners=[(n, p) for n, p, _ in named_grads],
        )  # fmt: skip
        coef, threshold, acted, skip, detail = self._apply_policies(ctx)
        if skip is not None:
            return self._skip(window, skip, norm, policies=detail)
        ctx.apply()
        lr = float(self.optimizer.param_groups[0]["lr"])
        self._precision.step(self.optimizer)
        if self.scheduler is not None:
            self.scheduler.step()
        self.step_count += 1
        self.clipped_steps += int(acted)
        if self._precision.scaler is not None:
            self._loss_hint = window.micro_batches * self.world_size / window.items
        return StepStats(
            loss=window.loss_sum / window.items, items=window.items,
            micro_batches=window.micro_batches, grad_norm=norm, clip_coef=coef,
            clipped=acted, skipped=False, lr=lr, step=self.step_count,
            clip_threshold=threshold, post_clip_norm=ctx.norm,
            loss_scale=self._precision.loss_scale, policies=detail,
        )  # fmt: skip

    def _accumulate(
        self, micro_batches: Iterable[Any], loss_fn: LossFn
    ) -> tuple[torch.Tensor, int]:
        """Forward and backward every micro-batch; sync gradients only on the last."""
        loss_sum: Any = 0.0
        items: Any = 0
        negative: Any = 0
        n = 0
        with self._precision.accumulating():
            for n, (is_last, mb) in enumerate(_mark_last(micro_batches), start=1):  # noqa: B007
                with self._strategy.sync(is_last or self.sync_each_micro_batch):
                    with self._precision.autocast():
                        total, count = check_loss_sum(loss_fn(self.model, mb))
                    # Kept on the loss's device: no host sync until the window's end.
                    loss_sum = loss_sum + total.detach().to(torch.float64)
                    items = items + count
                    if isinstance(count, torch.Tensor):
                        negative = negative + (count < 0)
                    if self._loss_hint is None:
                        self._loss_hint = self._first_loss_hint(count)
                    if self._loss_hint != 1.0:
                        total = total * self._loss_hint
                    self._precision.backward(total)
        if n == 0:
            raise ValueError("micro_batches is empty: a window needs at least one micro-batch")
        return self._reduce_totals(loss_sum, items, negative, n), n

    def _first_loss_hint(self, count: Any) -> float:
        """fp16's first window: 1 / mean item count of the first micro-batch over ranks."""
        local = torch.as_tensor(count, dtype=torch.float64).reshape(1).cpu()
        mean = float(self._strategy.all_reduce_sum(local)) / self.world_size
        return 1.0 / max(mean, 1.0)

    def _reduce_totals(self, loss_sum: Any, items: Any, negative: Any, n: int) -> torch.Tensor:
        """The one collective of the window: global loss sum, item count and window checks.

        Issued after the last backward and read later, together with the norm, so the host
        waits for the device once per step. Under DDP a window-length mismatch still pairs
        each rank's single gradient all-reduce, so it is caught when read; strategies whose
        forward communicates check before the first forward.
        """
        dev = loss_sum.device
        local = torch.stack(
            [
                torch.as_tensor(v, dtype=torch.float64, device=dev)
                for v in (loss_sum, items, negative, float(n), float(n * n))
            ]
        )
        return self._strategy.all_reduce_sum(local)

    def _read_window(self, totals: torch.Tensor, raw_norm: torch.Tensor, n: int) -> _Window:
        """The step's one host sync: reduced totals and the un-normalised gradient norm."""
        norm = raw_norm.reshape(1).to(totals.device, torch.float64)
        loss, count, neg, n_sum, n2_sum, raw = torch.cat([totals, norm]).tolist()
        error = window_length_error(n, n_sum, n2_sum, self.world_size)
        if error is not None:
            raise error
        if neg > 0:
            raise ValueError("LossSum.count must be >= 0; loss_fn returned a negative count")
        return _Window(loss_sum=loss, items=int(count), micro_batches=n, raw_norm=raw)

    def _apply_policies(self, ctx: ClipContext) -> tuple:
        coef, threshold, acted = 1.0, None, False
        detail: list[dict] = []
        for policy in self.clip:
            before = ctx.norm
            result = policy.clip(ctx)
            detail.append(
                {"name": type(policy).__name__, "threshold": result.threshold,
                 "acted": result.acted or result.skip is not None}
            )  # fmt: skip
            if result.skip is not None:
                return coef, result.threshold, True, result.skip, detail
            if result.inplace:
                ctx.refresh()
                coef *= ctx.norm / before if before > 0 else 1.0
            elif result.coef != 1.0:
                ctx.scale_by(result.coef)
                coef *= result.coef
            if result.threshold is not None:
                threshold = result.threshold
            acted = acted or result.acted
        return coef, threshold, acted, None, detail

    def _skip(
        self,
        window: _Window,
        reason: str,
        norm: float,
        overflow: bool = False,
        policies: list[dict] | None = None,
    ) -> StepStats:
        """No optimizer or scheduler step: parameters and optimizer state stay untouched."""
        self._precision.skip(self.optimizer, overflow)
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped_steps += 1
        self.skip_reasons[reason] += 1
        loss = window.loss_sum / window.items if window.items else math.nan
        return StepStats(
            loss=loss, items=window.items, micro_batches=window.micro_batches,
            grad_norm=norm, clip_coef=1.0, clipped=False, skipped=True,
            lr=float(self.optimizer.param_groups[0]["lr"]), step=self.step_count,
            skip_reason=reason, loss_scale=self._precision.loss_scale,
            policies=policies or [],
        )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """Counters, the fp16 scaler and every stateful clip policy."""
        return {
            "step_count": self.step_count,
            "skipped_steps": self.skipped_steps,
            "clipped_steps": self.clipped_steps,
            "skip_reasons": dict(self.skip_reasons),
            "loss_hint": self._loss_hint,
            "precision": self._precision.state_dict(),
            "clip": [p.state_dict() if hasattr(p, "state_dict") else {} for p in self.clip],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        clip_states = state.get("clip", [])
        if len(clip_states) != len(self.clip):
            raise ValueError(
                f"Stepper.load_state_dict: checkpoint has {len(clip_states)} clip policies, "
                f"this Stepper has {len(self.clip)}; build the Stepper with the same clip="
            )
        self.step_count = int(state["step_count"])
        self.skipped_steps = int(state["skipped_steps"])
        self.clipped_steps = int(state["clipped_steps"])
        self.skip_reasons = Counter(state.get("skip_reasons", {}))
        self._loss_hint = state.get("loss_hint", self._loss_hint)
        self._precision.load_state_dict(state.get("precision", {}))
        for policy, sd in zip(self.clip, clip_states, strict=True):
            if hasattr(policy, "load_state_dict"):
                policy.load_state_dict(sd)
