"""The optimizer step built from many micro-batches, exactly as one large batch would give.

``Stepper._step`` is the whole algorithm, top to bottom: zero grads -> micro-batches
(forward, loss, backward; gradient sync only on the last) -> unscale -> global norm ->
normalise -> finite check -> clip policies -> optimizer step -> scheduler step.

Normalisation has exactly one owner, one line in ``_step``: losses are backpropagated as
*sums*, the window's item count (over every micro-batch and every rank) is only known at
the end, so the summed gradient is divided once, afterwards, by the global item count
(times the backend's own average over ranks, undone, and the fp16 pre-scale, undone). The
multiply itself is kept pending and done in the same pass as a norm clip.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._validate import check_optimizer_covers, check_state_count
from .early_norm import EarlyNorm
from .hooks import Hooks
from .loss import LossSum, check_loss_sum
from .oom import (
    MAX_HALVINGS,
    OOMAgreement,
    SplitFn,
    WindowOOM,
    halve,
    split_in_half,
    too_large_error,
)
from .parallel import Strategy, strategy_for
from .policies import ClipNorm, ClipPolicy, GradientView, as_policies
from .precision import Precision
from .tally import CountPlan, Tally, Window, plan_counts
from .windows import mark_last, windows

__all__ = ["LossFn", "StepStats", "Stepper", "windows"]

LossFn = Callable[[nn.Module, Any], LossSum]
_DEFAULT_CLIP = object()
ON_OOM = ("raise", "split")
NORM_IN_BACKWARD_BYTES = 32 * 2**20  # norm_in_backward="auto": gradients at least this big


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
    oom_splits: int = 0
    """Halvings of the micro-batches this step needed after out-of-memory (on_oom="split")."""
    aux: dict[str, float] = field(default_factory=dict)
    """Each ``LossSum.aux`` term's mean over the window's micro-batches on every rank (not
    part of ``loss``, the item-weighted mean of the loss sums)."""


@dataclass
class _Decision:
    """What the clip policies decided, together."""

    coef: float = 1.0
    threshold: float | None = None
    acted: bool = False
    skip: str | None = None
    detail: list[dict] = field(default_factory=list)


class Stepper:
    """One exact optimizer step from a window of micro-batches.

    Args:
        model: the module (plain, DDP, or FSDP2 ``fully_shard``-ed; detected automatically).
        optimizer: any ``torch.optim.Optimizer``.
        scheduler: any LR scheduler; stepped once per optimizer step, never on a skip.
        clip: a clip policy, a list of them (applied in order), or None (no clipping).
            Default: ``ClipNorm(1.0)``, as ``transformers.Trainer``'s ``max_grad_norm=1.0``;
            pass ``clip=None`` for a plain PyTorch step.
        precision: ``"fp32"``, ``"bf16"`` (autocast) or ``"fp16"`` (autocast + GradScaler).
        accum_dtype: dtype gradients accumulate in; None means float32 for parameters held
            in bf16/fp16, and the parameter dtype otherwise.
        sync_each_micro_batch: reduce gradients after every micro-batch (FSDP memory)
            instead of only after the last.
        hooks: observers called at fixed points of every step (:mod:`gradstep.hooks`).
        strategy: how gradients are synchronised (:mod:`gradstep.parallel`); None detects
            it from the model's wrapper.
        on_oom: ``"raise"`` (default), or ``"split"``: on out-of-memory in a micro-batch's
            forward, loss or backward, drop the window's gradients, halve every micro-batch
            (``split_fn``, default :func:`gradstep.oom_in_half`) and run the
            window again; later windows start halved. The update is unchanged (the loss
            is normalised by items). Out-of-memory as the allocators report it
            (:func:`gradstep.oom.is_out_of_memory`: CUDA's, the CPU allocator's,
            oneDNN's). On several ranks every rank splits together, or, when a rank ran
            out in a one-item micro-batch, every rank raises ``MicroBatchTooLarge``.
        split_fn: cuts one micro-batch in two (None when it holds one item).
        norm_in_backward: take each gradient's norm as soon as it is final in the last
            micro-batch's backward (:mod:`gradstep.early_norm`), so that after backward only the
            multiply remains; the same norm as the pass after backward, to rounding. Used
            where the strategy supports it (one process, DDP, FSDP2), without fp16 loss
            scaling and without float32 accumulation buffers; else the pass after backward.
            ``"auto"`` (default): when the gradients hold at least 32 MiB, too much for a
            cache to keep between backward and a later pass (on small models one norm per
            parameter costs more than the single pass it replaces).
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
        hooks: list[Any] | None = None,
        strategy: Strategy | None = None,
        on_oom: str = "raise",
        split_fn: SplitFn | None = None,
        norm_in_backward: bool | str = "auto",
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if strategy is not None and not isinstance(strategy, Strategy):
            raise TypeError(
                "strategy must be None (detect) or a gradstep.parallel strategy (LocalStrategy, "
                f"DDPStrategy, FSDP2Strategy, ...), got {type(strategy).__name__}"
            )
        if scheduler is not None and not callable(getattr(scheduler, "step", None)):
            raise TypeError(
                "scheduler must be None or an LR scheduler with step() (e.g. "
                f"torch.optim.lr_scheduler.LambdaLR), got {type(scheduler).__name__}"
            )
        if on_oom not in ON_OOM:
            raise ValueError(f"on_oom must be one of {', '.join(ON_OOM)}; got {on_oom!r}")
        if split_fn is not None and not callable(split_fn):
            raise TypeError(f"split_fn must be None or a callable, got {type(split_fn).__name__}")
        self.on_oom = on_oom
        self.split_fn = split_fn or split_in_half
        self.oom_halvings = 0
        """How many times every micro-batch is halved before it runs (grows on OOM)."""
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.clip = ClipNorm(1.0) if clip is _DEFAULT_CLIP else clip
        self.sync_each_micro_batch = bool(sync_each_micro_batch)
        self.hooks = Hooks(hooks)
        self._named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._params = [p for _, p in self._named]
        if norm_in_backward not in (True, False, "auto"):
            raise ValueError(
                f"norm_in_backward must be True, False or 'auto'; got {norm_in_backward!r}"
            )
        if norm_in_backward == "auto":
            grad_bytes = sum(p.numel() * p.element_size() for _, p in self._named)
            norm_in_backward = grad_bytes >= NORM_IN_BACKWARD_BYTES
        self.norm_in_backward = bool(norm_in_backward)
        check_optimizer_covers(self._named, optimizer)
        self._strategy = strategy_for(model) if strategy is None else strategy
        self._precision = Precision(
            precision, self._params, accum_dtype, self._strategy.distributed
        )
        self._oom = OOMAgreement(self._strategy.all_reduce_sum, self._strategy.world_size)
        self.step_count = 0
        self.skipped_steps = 0
        self.clipped_steps = 0
        self.skip_reasons: Counter[str] = Counter()
        self._warned: set[str] = set()

    @property
    def clip(self) -> list[ClipPolicy]:
        """The clip policies, in the order they apply (assigning validates them)."""
        return self._clip

    @clip.setter
    def clip(self, value: Any) -> None:
        policies = as_policies(value)
        self._clip = policies
        # The norm every policy is handed is measured in the first norm_type any policy
        # names (ClipNorm(norm_type=inf) makes grad_norm the inf-norm), else L2.
        self._norm_type = next(
            (float(p.norm_type) for p in policies if hasattr(p, "norm_type")), 2.0
        )

    @property
    def precision(self) -> str:
        return self._precision.precision

    @property
    def strategy(self) -> Strategy:
        return self._strategy

    @property
    def world_size(self) -> int:
        return self._strategy.world_size

    @property
    def loss_scale(self) -> float | None:
        """The fp16 GradScaler's current scale (None unless ``precision="fp16"``)."""
        return self._precision.loss_scale

    @property
    def loss_scale_factor(self) -> float:
        """What each micro-batch's backpropagated loss sum was multiplied by (fp16 loss
        scale times pre-scale; 1.0 otherwise)."""
        return self._precision.backward_factor

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """The fp16 ``GradScaler`` (None otherwise)."""
        return self._precision.scaler

    @property
    def accumulator(self) -> Any:
        """The float32 accumulation buffers of low-precision parameters, or None."""
        return self._precision.accumulator

    def step(
        self,
        micro_batches: Iterable[Any],
        loss_fn: LossFn,
        count: Callable[[Any], int] | None = None,
    ) -> StepStats:
        """Run one window of micro-batches and take (or skip) one optimizer step.

        ``count(micro_batch) -> int``: its items, the count ``loss_fn`` will return, asked
        for every micro-batch before the first forward (one collective). Needed by
        ``LossSum.aux`` terms, which are weighted by the window's global item count; it
        also lets ``loss_fn`` return ``count=None`` (counted up front, not after each
        forward).
        """
        if count is not None and not callable(count):
            raise TypeError(f"count must be None or a callable, got {type(count).__name__}")
        if not self.model.training:
            self._warn_once(
                "eval",
                "Stepper.step: the model is in eval mode (dropout and other train-only layers "
                "are off; from_pretrained returns a model in eval mode): call model.train()",
            )
        if isinstance(micro_batches, (dict, torch.Tensor, tuple, str, bytes)):
            # A tuple is refused too: (inputs, targets) is the usual shape of ONE batch, and
            # iterating it would run the inputs and the targets as two micro-batches.
            raise TypeError(
                "micro_batches must be an iterable of micro-batches forming one window (a list "
                f"or a generator; not a tuple or a string), got a {type(micro_batches).__name__}; "
                "wrap a single batch in a list: stepper.step([batch], loss_fn)"
            )
        if self.on_oom == "split":
            micro_batches = halve(list(micro_batches), self.split_fn, self.oom_halvings)
        split_ranks = self.on_oom == "split" and self.world_size > 1
        if self._strategy.forward_communicates or split_ranks:
            # FSDP2's forward all-gathers parameters, and on_oom="split" meets the other
            # ranks after every forward and backward: a rank with one micro-batch more
            # would pair those collectives with the other ranks' reductions and hang, so
            # the window lengths are compared before the first forward (one collective).
            micro_batches = list(micro_batches)
            self._strategy.check_window(len(micro_batches))
        splits = 0
        while True:
            self._oom.reset()
            try:
                stats = self._step(micro_batches, loss_fn, count)
                break
            except WindowOOM:
                self._drop_window()
                # Raised on every rank together, and decided together: give up when a rank
                # ran out in a one-item micro-batch (no split can help it); else every rank
                # halves, so that all windows keep the same length.
                if self._oom.stuck() or self.oom_halvings >= MAX_HALVINGS:
                    raise too_large_error(self.oom_halvings, self._oom.last_error) from None
                self.oom_halvings += 1
                micro_batches = halve(micro_batches, self.split_fn, 1)
                splits += 1
            except BaseException:
                self._drop_window()
                raise
        stats.oom_splits = splits
        for call in self.hooks.on_step_end:
            call(self, stats)
        return stats

    def _drop_window(self) -> None:
        """A failed step leaves nothing behind: no gradients (also none held inside the
        backend), no half-done fp16 unscale."""
        self._precision.skip(self.optimizer, overflow=False)
        self.optimizer.zero_grad(set_to_none=True)
        self._strategy.discard_partial_grads()

    def _step(
        self, micro_batches: Iterable[Any], loss_fn: LossFn, count: Callable | None
    ) -> StepStats:
        self.optimizer.zero_grad(set_to_none=True)
        for call in self.hooks.on_step_start:
            call(self)
        plan = None
        if count is not None:
            micro_batches = list(micro_batches)
            plan = plan_counts(micro_batches, count, self._strategy)
        early = self._early_norm()
        tally, n = self._accumulate(micro_batches, loss_fn, plan, early)
        reduced, local_items = tally.reduce(self._strategy, n)
        self._precision.unscale(self.optimizer)
        named_grads = self._precision.named_grads(self._named)
        grads = [g for _, _, g in named_grads]
        if early is not None and early.armed:  # measured in the last backward
            raw_norm = self._strategy.reduce_norm(early.local(reduced.device), self._norm_type)
        else:
            raw_norm = self._strategy.total_norm(grads, self._norm_type)
        window = tally.read(reduced, local_items, raw_norm, n, self.world_size)
        self._warn_traps(window)
        if window.items == 0:
            return self._skip(window, "empty window: 0 items (every label ignored)", math.nan)
        if not grads and not self._strategy.distributed and self._named:
            # The loss does not depend on any trainable parameter: an update would only
            # apply weight decay. (Under DDP/FSDP2 the backend always leaves gradients.)
            return self._skip(window, "no gradient: the loss does not depend on the model", 0.0)
        view = GradientView(
            grads=grads,
            scale=1.0,
            norm=window.raw_norm,
            norm_type=self._norm_type,
            loss=window.loss,
            step=self.step_count,
            params=self._named,
            global_norm=self._strategy.total_norm,
            grad_owners=[(name, p) for name, p, _ in named_grads],
        )
        # THE normalisation: sum of per-item gradients -> mean over the global item count,
        # with the backend's average over ranks and the fp16 pre-scale undone. Pending: it
        # is applied to the tensors in the same pass as a norm clip (view.materialize).
        view.scale_by(self._strategy.grad_divisor / (window.items * self._precision.prescale))
        if not math.isfinite(view.norm):
            return self._skip(window, "non-finite gradient norm", view.norm, overflow=True)
        for call in self.hooks.on_norm:
            call(self, view)
        norm = view.norm
        decision = self._apply_policies(view)
        if decision.skip is not None:
            return self._skip(window, decision.skip, norm, decision)
        view.materialize()
        lr = float(self.optimizer.param_groups[0]["lr"])
        self._precision.step(self.optimizer)
        # Counted before the scheduler runs: if it raises, the parameters have moved and
        # the counters say so (the error says the step was taken, the LR did not advance).
        self.step_count += 1
        self.clipped_steps += int(decision.acted)
        self._precision.end_window(window.micro_batches * self.world_size, window.items)
        if self.scheduler is not None:
            try:
                self.scheduler.step()
            except Exception as exc:
                raise RuntimeError(
                    f"scheduler.step() raised after optimizer step {self.step_count} was "
                    "taken: the parameters, optimizer state and step_count include that "
                    f"step, the learning rate was not advanced ({type(exc).__name__}: {exc})"
                ) from exc
        return self._stats(window, norm, decision, lr=lr, post_clip_norm=view.norm)

    def _accumulate(
        self,
        micro_batches: Iterable[Any],
        loss_fn: LossFn,
        plan: CountPlan | None,
        early: EarlyNorm | None,
    ) -> tuple[Tally, int]:
        """Forward and backward every micro-batch; sync gradients only on the last."""
        tally = Tally(plan)
        if self._nothing_per_micro_batch():
            return self._accumulate_lean(micro_batches, loss_fn, tally, early)
        n = 0
        split = self.on_oom == "split"
        guard = self._oom.guard if split else _no_guard
        agreeing = self._agreement_before_forwards() if split else contextlib.nullcontext()
        with agreeing, self._precision.accumulating():
            for n, (is_last, mb) in enumerate(mark_last(micro_batches), start=1):  # noqa: B007
                with self._strategy.sync(is_last or self.sync_each_micro_batch):
                    with guard(mb), self._precision.autocast():
                        loss = check_loss_sum(loss_fn(self.model, mb), count=False)
                    if loss.count is None and plan is not None:  # counted up front
                        loss = LossSum(loss.total, plan.counts[n - 1], loss.aux)
                    backprop = tally.add(loss)  # the loss sum (+ weighted aux terms)
                    observed = self.hooks.param_grads(self, self._hook_targets, n - 1)
                    final = self._final_grads(early if is_last else None)
                    with guard(mb), observed, final:
                        self._precision.backward(backprop, loss.count, self._mean_over_ranks)
                for call in self.hooks.on_micro_batch_end:
                    call(self, n - 1, is_last, loss)
        if n == 0:
            raise ValueError("micro_batches is empty: a window needs at least one micro-batch")
        return tally, n

    def _early_norm(self) -> EarlyNorm | None:
        """An EarlyNorm when the norm can be taken in the last backward (see __init__)."""
        if not self.norm_in_backward or not hasattr(self._strategy, "final_grads"):
            return None
        if self._precision.scaler is not None or self._precision.accumulator is not None:
            return None
        return EarlyNorm(self._norm_type, self._params)

    def _final_grads(self, early: EarlyNorm | None) -> contextlib.AbstractContextManager[None]:
        """The strategy's hooks that record each final gradient's norm into ``early``."""
        if early is None:
            return contextlib.nullcontext()
        hooks = self._strategy.final_grads(self._params, early.record)  # type: ignore[attr-defined]
        if hooks is None:  # not possible on this model after all: stop asking
            self.norm_in_backward = False
            return contextlib.nullcontext()
        early.armed = True
        return hooks

    def _nothing_per_micro_batch(self) -> bool:
        """One process, no autocast, no OOM guard, no hook inside the window: then no
        context needs entering per micro-batch."""
        hooks = self.hooks
        return not (
            self._strategy.distributed
            or self._precision.dtype is not None
            or self.on_oom == "split"
            or hooks.on_param_grad  # type: ignore[attr-defined]
            or hooks.on_micro_batch_end  # type: ignore[attr-defined]
        )

    def _accumulate_lean(
        self, micro_batches: Iterable[Any], loss_fn: LossFn, tally: Tally, early: Any
    ) -> tuple[Tally, int]:
        """:meth:`_accumulate` when :meth:`_nothing_per_micro_batch`: the same steps without
        the contexts that would do nothing (each costs microseconds per micro-batch, which
        is what a small model's step is made of)."""
        # fp32 here: no loss scale, no pre-scale, so the backward is the plain one.
        n, model = 0, self.model
        with self._precision.accumulating():
            if early is None:
                for n, mb in enumerate(micro_batches, start=1):  # noqa: B007
                    tally.add(check_loss_sum(loss_fn(model, mb), count=False)).backward()
            else:
                for n, (is_last, mb) in enumerate(mark_last(micro_batches), start=1):  # noqa: B007
                    backprop = tally.add(check_loss_sum(loss_fn(model, mb), count=False))
                    with self._final_grads(early) if is_last else contextlib.nullcontext():
                        backprop.backward()
        if n == 0:
            raise ValueError("micro_batches is empty: a window needs at least one micro-batch")
        return tally, n

    def _agreement_before_forwards(self) -> contextlib.AbstractContextManager[None]:
        """With on_oom="split" on several ranks: an agreement point before every forward
        that communicates (FSDP2's units, DDP broadcasting buffers), see OOMAgreement."""
        if self.world_size == 1:
            return contextlib.nullcontext()
        return self._oom.before_forwards(self._strategy.communicating_modules())

    def _hook_targets(self) -> list[tuple[str, nn.Parameter, torch.Tensor]]:
        return self._strategy.hook_targets(self._named)

    def _mean_over_ranks(self, count: Any) -> float:
        local = torch.as_tensor(count, dtype=torch.float64).reshape(1).cpu()
        return float(self._strategy.all_reduce_sum(local)) / self.world_size

    def _warn_traps(self, window: Window) -> None:
        """Silent traps that do not stop the step: said once per Stepper."""
        if not math.isfinite(window.loss) and window.items and math.isfinite(window.raw_norm):
            self._warn_once(
                "loss",
                f"Stepper.step: the window's loss is {window.loss} but its gradient is finite: "
                "the loss sum includes a non-finite term that carries no gradient (e.g. a "
                "masked position's logit); the step is taken",
            )
        if self.world_size > 1 and window.local_items == 0 and window.items > 0:
            self._warn_once(
                "count",
                "Stepper.step: every micro-batch of this rank had LossSum.count 0 (every "
                "label ignored?): this rank contributed nothing to the step",
            )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, UserWarning, stacklevel=3)

    def _apply_policies(self, view: GradientView) -> _Decision:
        decision = _Decision()
        for policy in self._clip:
            before = view.norm
            result = policy.clip(view)
            acted = result.acted or result.skip is not None
            decision.detail.append(
                {"name": type(policy).__name__, "threshold": result.threshold, "acted": acted}
            )
            if result.skip is not None:
                decision.threshold, decision.acted = result.threshold, True
                decision.skip = result.skip
                return decision
            if result.acted and view.settle():  # edited the tensors: measured again
                decision.coef *= view.norm / before if before > 0 else 1.0
            elif result.coef != 1.0:
                view.scale_by(result.coef)
                decision.coef *= result.coef
            if result.threshold is not None:
                decision.threshold = result.threshold
            decision.acted = decision.acted or result.acted
        return decision

    def _skip(
        self,
        window: Window,
        reason: str,
        norm: float,
        decision: _Decision | None = None,
        overflow: bool = False,
    ) -> StepStats:
        """No optimizer or scheduler step: parameters and optimizer state stay untouched."""
        self._precision.skip(self.optimizer, overflow)
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped_steps += 1
        self.skip_reasons[reason] += 1
        kept = _Decision(detail=decision.detail if decision else [])
        return self._stats(window, norm, kept, skip_reason=reason)

    def _stats(
        self,
        window: Window,
        norm: float,
        decision: _Decision,
        *,
        lr: float | None = None,
        post_clip_norm: float = math.nan,
        skip_reason: str | None = None,
    ) -> StepStats:
        """The one place a StepStats is built, for taken and skipped steps alike."""
        return StepStats(
            aux=window.aux,
            loss=window.loss,
            items=window.items,
            micro_batches=window.micro_batches,
            grad_norm=norm,
            clip_coef=decision.coef,
            clipped=decision.acted and skip_reason is None,
            skipped=skip_reason is not None,
            lr=float(self.optimizer.param_groups[0]["lr"]) if lr is None else lr,
            step=self.step_count,
            skip_reason=skip_reason,
            clip_threshold=decision.threshold,
            post_clip_norm=post_clip_norm,
            loss_scale=self._precision.loss_scale,
            policies=decision.detail,
        )

    def state_dict(self) -> dict[str, Any]:
        """Counters, the fp16 scaler, every stateful clip policy and hook."""
        return {
            "step_count": self.step_count,
            "skipped_steps": self.skipped_steps,
            "clipped_steps": self.clipped_steps,
            "skip_reasons": dict(self.skip_reasons),
            "loss_hint": self._precision.prescale_state,
            "precision": self._precision.state_dict(),
            "clip": [_state_of(p) for p in self._clip],
            "clip_types": [type(p).__name__ for p in self._clip],
            "oom_halvings": self.oom_halvings,
            "hooks": [_state_of(h) for h in self.hooks],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        counters = ("step_count", "skipped_steps", "clipped_steps")
        missing = [k for k in counters if k not in state] if isinstance(state, dict) else counters
        if missing:
            raise ValueError(f"Stepper.load_state_dict: not a Stepper state (missing {missing})")
        clip_states = state.get("clip", [])
        # Checkpoints written before hooks existed hold none: nothing to restore then.
        hook_states = state.get("hooks", [{} for _ in self.hooks])
        check_state_count("clip policies", "clip", clip_states, self._clip)
        saved_types = state.get("clip_types")
        mine = [type(p).__name__ for p in self._clip]
        if saved_types is not None and list(saved_types) != mine:
            raise ValueError(
                f"Stepper.load_state_dict: the checkpoint's clip policies are {saved_types}, "
                f"this Stepper's are {mine}; build the Stepper with the same clip="
            )
        check_state_count("hooks", "hooks", hook_states, self.hooks.items)
        self.step_count = int(state["step_count"])
        self.skipped_steps = int(state["skipped_steps"])
        self.clipped_steps = int(state["clipped_steps"])
        self.skip_reasons = Counter(state.get("skip_reasons", {}))
        self.oom_halvings = int(state.get("oom_halvings", 0))
        self._precision.load_state_dict(state.get("precision", {}), state.get("loss_hint"))
        objects = [*self._clip, *self.hooks.items]
        for obj, sd in zip(objects, [*clip_states, *hook_states], strict=True):
            if hasattr(obj, "load_state_dict"):
                obj.load_state_dict(sd)


def _no_guard(micro_batch: Any = None) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def _state_of(obj: Any) -> dict[str, Any]:
    return obj.state_dict() if hasattr(obj, "state_dict") else {}
