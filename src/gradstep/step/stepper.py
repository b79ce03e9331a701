"""The optimizer step built from many micro-batches, exactly as one large batch would give.

``Stepper._step`` is the whole algorithm, top to bottom: zero grads -> micro-batches
(forward, loss, backward; gradient sync only on the last: :mod:`.loop`) -> unscale ->
the window's totals and this rank's part of the global norm in one collective and one
host read (:mod:`.tally`, :mod:`.norm`) -> normalise -> finite check -> clip policies ->
optimizer step -> scheduler step. Out-of-memory splitting is :mod:`.oom`'s; the policies'
decision :mod:`gradstep.policies`'; the strategy's capabilities are read once, here.

Normalisation has exactly one owner, one line in ``_step``: losses are backpropagated as
*sums*, and the summed gradient is divided once, afterwards, by the window's global item
count (the backend's average over ranks and the fp16 pre-scale undone), in the same
pending multiply as a norm clip.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch import nn

from .. import _validate
from ..parallel import Strategy, capabilities, strategy_for
from ..policies import ClipNorm, ClipPolicy, GradientView, as_policies
from ..policies.base import Decision, apply_policies, norm_type_of
from .hooks import Hooks
from .loop import NULL, Loop, check_micro_batches, compose, plain_backward, windows
from .loss import LossSum
from .norm import EarlyNorm, decide, global_norm, window_norm
from .oom import ON_OOM, OOMSplitter, SplitFn, split_in_half
from .precision import Precision
from .stats import StepStats, step_stats
from .tally import Tally, Window, plan_counts

__all__ = ["LossFn", "StepStats", "Stepper", "windows"]

LossFn = Callable[[nn.Module, Any], LossSum]
_DEFAULT_CLIP = object()


class Stepper:
    """One exact optimizer step from a window of micro-batches.

    Args:
        model: the module: plain, DDP, FSDP2 ``fully_shard``-ed (HSDP included), or FSDP2
            over the data-parallel dims of a mesh whose other dim is tensor parallel;
            detected automatically.
        optimizer: any ``torch.optim.Optimizer``.
        scheduler: any LR scheduler; stepped once per optimizer step, never on a skip.
        clip: a clip policy, a list of them (applied in order), or None (no clipping).
            Default: ``ClipNorm(1.0)``, as ``transformers.Trainer``'s ``max_grad_norm=1.0``;
            pass ``clip=None`` for a plain PyTorch step.
        precision: ``"fp32"``, ``"bf16"`` (autocast) or ``"fp16"`` (autocast + GradScaler).
        accum_dtype: dtype gradients accumulate in; None: float32 for bf16/fp16 parameters.
        sync_each_micro_batch: reduce after every micro-batch, not only the last (memory).
        hooks: observers called at fixed points of every step (:mod:`gradstep.step.hooks`).
        strategy: a :mod:`gradstep.parallel` strategy; None detects it from the model.
        on_oom: ``"raise"`` (default), or ``"split"``: after out-of-memory in a micro-batch
            (on any rank), drop the window, halve every micro-batch and run it again; later
            windows start halved; the update is unchanged (:mod:`gradstep.step.oom`).
        split_fn: cuts one micro-batch in two (default :func:`gradstep.step.oom.split_in_half`).
        norm_in_backward: take each gradient's norm as soon as it is final in the last
            backward (:mod:`gradstep.step.norm`), leaving only the multiply for after it;
            the same norm to rounding. ``"auto"`` (default): when the gradients hold at
            least 32 MiB and the strategy and precision allow it.
    """

    on_oom = _validate.Fixed()
    split_fn = _validate.Fixed()
    norm_in_backward = _validate.Fixed()

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
        _validate.check_stepper_args(model, optimizer, scheduler, on_oom, ON_OOM, split_fn)
        if strategy is not None and not isinstance(strategy, Strategy):
            raise TypeError(
                "strategy must be None (detect) or a gradstep.parallel strategy (LocalStrategy, "
                f"DDPStrategy, FSDP2Strategy, ...), got {type(strategy).__name__}"
            )
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.clip = ClipNorm(1.0) if clip is _DEFAULT_CLIP else clip
        self.sync_each_micro_batch = bool(sync_each_micro_batch)
        self.hooks = Hooks(hooks)
        self._named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._params = [p for _, p in self._named]
        _validate.check_optimizer_covers(self._named, optimizer)
        self._strategy = strategy_for(model) if strategy is None else strategy
        self._caps = caps = capabilities(self._strategy)
        self._precision = Precision(
            precision, self._params, accum_dtype, self._strategy.distributed,
            self._strategy.all_reduce_sum, self._strategy.world_size,
        )  # fmt: skip
        self.on_oom = on_oom
        self.split_fn = split_fn or split_in_half
        self._oom = OOMSplitter(caps, self.split_fn) if on_oom == "split" else None
        self.norm_in_backward = self._early = decide(
            norm_in_backward, self._params, caps, self._precision
        )
        # Ranks must agree on the window's length before its first forward when forwards
        # communicate (FSDP2's all-gathers), or when on_oom="split" meets the other ranks
        # after every forward and backward: a rank with one micro-batch more would pair
        # those collectives with the other ranks' reductions and hang. count=fn's
        # all-reduce carries that agreement when it spans every rank.
        self._agree_first = caps.forward_communicates or (
            self._oom is not None and caps.agree_ranks > 1
        )
        self._plan_agrees = self._agree_first and caps.agree_ranks == self.world_size
        self._loop = self._build_loop()
        self.step_count = 0
        self.skipped_steps = 0
        self.clipped_steps = 0
        self.skip_reasons: Counter[str] = Counter()
        self._warned: set[str] = set()

    def _build_loop(self) -> Loop:
        """The micro-batch loop, with only the contexts of the features in use."""
        oom, hooks, precision, caps = self._oom, self.hooks, self._precision, self._caps
        lend = None
        if hooks.on_param_grad:
            targets = lambda: caps.hook_targets(self._named)  # noqa: E731
            lend = lambda mb, i: hooks.param_grads(self, targets, i)  # noqa: E731
        guard = (lambda mb, *_: oom.guard(mb)) if oom is not None else None
        return Loop(
            self.model,
            around_window=compose(
                precision.accumulating if precision.accumulator is not None else None,
                oom.window if oom is not None else None,
            ),
            around_micro_batch=self._strategy.micro_batch,
            around_forward=compose(
                guard, (lambda mb: precision.autocast()) if precision.dtype is not None else None
            ),
            around_backward=compose(guard, lend),
            backward=precision.backward if precision.scaler is not None else plain_backward,
            after_micro_batch=[partial(call, self) for call in hooks.on_micro_batch_end],
            sync_each=self.sync_each_micro_batch,
            run_window=caps.run_window,
        )

    @property
    def clip(self) -> list[ClipPolicy]:
        """The clip policies, in the order they apply (assigning validates them)."""
        return self._clip

    @clip.setter
    def clip(self, value: Any) -> None:
        self._clip = as_policies(value)
        self._norm_type = norm_type_of(self._clip)

    @property
    def precision(self) -> str:
        return self._precision.precision

    @property
    def strategy(self) -> Strategy:
        return self._strategy

    @property
    def capabilities(self) -> Any:
        """The strategy's optional capabilities, as read when this Stepper was built
        (:func:`gradstep.parallel.capabilities`)."""
        return self._caps

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

    @property
    def oom_halvings(self) -> int:
        """How many times every micro-batch is halved before it runs (grows on OOM)."""
        return self._oom.halvings if self._oom is not None else 0

    def step(
        self,
        micro_batches: Iterable[Any],
        loss_fn: LossFn,
        count: Callable[[Any], int] | None = None,
    ) -> StepStats:
        """Run one window of micro-batches and take (or skip) one optimizer step.

        ``count(micro_batch) -> int``: its items, asked before the first forward (one
        collective). ``LossSum.aux`` terms need it (they are weighted by the window's item
        count); with it ``loss_fn`` may return ``count=None``.
        """
        check_micro_batches(micro_batches, count)
        if not self.model.training:
            self._warn_once(
                "eval",
                "Stepper.step: the model is in eval mode (dropout and other train-only layers "
                "are off; from_pretrained returns a model in eval mode): call model.train()",
            )
        try:
            if self._oom is None:
                stats = self._step(self._window(micro_batches, count), loss_fn, count)
            else:
                micro_batches = self._window(self._oom.prepare(micro_batches), count)
                attempt = lambda mbs: self._step(mbs, loss_fn, count)  # noqa: E731
                stats = self._oom.run(micro_batches, attempt, self._drop_window)
        except BaseException:
            self._drop_window()
            raise
        for call in self.hooks.on_step_end:
            call(self, stats)
        return stats

    def _window(self, micro_batches: Iterable[Any], count: Callable | None) -> Iterable[Any]:
        """The window's length agreed by every rank before its first forward, where needed."""
        if self._agree_first and (count is None or not self._plan_agrees):
            if not isinstance(micro_batches, list):
                micro_batches = list(micro_batches)
            self._caps.check_window(len(micro_batches))
        return micro_batches

    def _drop_window(self) -> None:
        """A failed step leaves nothing behind: no gradients (also none held inside the
        backend), no half-done fp16 unscale."""
        self._precision.skip(self.optimizer, overflow=False)
        self.optimizer.zero_grad(set_to_none=True)
        self._caps.discard_partial_grads()

    def _step(
        self, micro_batches: Iterable[Any], loss_fn: LossFn, count: Callable | None
    ) -> StepStats:
        self.optimizer.zero_grad(set_to_none=True)
        for call in self.hooks.on_step_start:
            call(self)
        plan = None
        if count is not None:
            micro_batches = list(micro_batches)
            plan = plan_counts(micro_batches, count, self._strategy, agree=self._plan_agrees)
        tally = Tally(self._strategy, plan)
        early = EarlyNorm.start(self._caps, self._params, self._norm_type) if self._early else None
        self._loop.run(micro_batches, loss_fn, tally, early.recording if early else NULL)
        precision = self._precision
        if precision.scaler is not None:
            precision.unscale(self.optimizer)
        if precision.accumulator is not None:
            named_grads = precision.named_grads(self._named)
        else:
            named_grads = [(n, p, p.grad) for n, p in self._named if p.grad is not None]
        grads = [g for _, _, g in named_grads]
        norm, summed = window_norm(self._strategy, self._caps, grads, early, self._norm_type)
        window = tally.finish(norm, self._norm_type, summed)  # one collective, one host read
        for key, message in window.traps:
            self._warn_once(key, message)
        if window.items == 0:
            return self._skip(window, "empty window: 0 items (every label ignored)", math.nan)
        if not grads and not self._strategy.distributed and self._named:
            # The loss does not depend on any trainable parameter: an update would only
            # apply weight decay. (Under DDP/FSDP2 the backend always leaves gradients.)
            return self._skip(window, "no gradient: the loss does not depend on the model", 0.0)
        # THE normalisation: sum of per-item gradients -> mean over the global item count,
        # with the backend's average over ranks and the fp16 pre-scale undone. Pending: it
        # is applied to the tensors in the same pass as a norm clip (view.materialize).
        scale = self._strategy.grad_divisor / (window.items * precision.prescale)
        view = GradientView(
            grads=grads, scale=scale, norm=window.raw_norm * scale, norm_type=self._norm_type,
            loss=window.loss, step=self.step_count, params=self._named,
            global_norm=partial(global_norm, self._strategy, self._caps),
            grad_owners=[(n, p) for n, p, _ in named_grads],
        )  # fmt: skip
        if not math.isfinite(view.norm):
            return self._skip(window, "non-finite gradient norm", view.norm, overflow=True)
        for call in self.hooks.on_norm:
            call(self, view)
        norm = view.norm
        decision = apply_policies(self._clip, view)  # the one multiply, unless a skip
        if decision.skip is not None:
            return self._skip(window, decision.skip, norm, decision)
        return self._update(window, norm, decision, post_clip_norm=view.norm)

    def _update(
        self, window: Window, norm: float, decision: Decision, post_clip_norm: float
    ) -> StepStats:
        """The optimizer step, the counters, the scheduler step."""
        lr = float(self.optimizer.param_groups[0]["lr"])
        if self._precision.scaler is None and self._precision.accumulator is None:
            self.optimizer.step()
        else:
            self._precision.step(self.optimizer)
        # Counted before the scheduler runs: if it raises, the parameters have moved and
        # the counters say so (the error says the step was taken, the LR did not advance).
        self.step_count += 1
        self.clipped_steps += int(decision.acted)
        if self._precision.scaler is not None:
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
        return self._stats(window, norm, decision, lr, post_clip_norm=post_clip_norm)

    def _skip(
        self,
        window: Window,
        reason: str,
        norm: float,
        decision: Decision | None = None,
        overflow: bool = False,
    ) -> StepStats:
        """No optimizer or scheduler step: parameters and optimizer state stay untouched."""
        self._precision.skip(self.optimizer, overflow)
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped_steps += 1
        self.skip_reasons[reason] += 1
        kept = Decision(detail=decision.detail if decision else [])
        lr = float(self.optimizer.param_groups[0]["lr"])
        return self._stats(window, norm, kept, lr, skip_reason=reason)

    def _stats(self, window: Window, norm: float, decision: Decision, lr: float, **kw: Any):
        scale = self.loss_scale if self._precision.scaler is not None else None
        return step_stats(
            window, norm, decision, lr=lr, step=self.step_count, loss_scale=scale, **kw
        )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, UserWarning, stacklevel=3)

    def state_dict(self) -> dict[str, Any]:
        """Counters, the fp16 scaler, every stateful clip policy and hook."""
        return {
            "step_count": self.step_count,
            "skipped_steps": self.skipped_steps,
            "clipped_steps": self.clipped_steps,
            "skip_reasons": dict(self.skip_reasons),
            "precision": self._precision.state_dict(),
            "clip": [_state_of(p) for p in self._clip],
            "clip_types": [type(p).__name__ for p in self._clip],
            "oom_halvings": self.oom_halvings,
            "hooks": [_state_of(h) for h in self.hooks],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        clip_states, hook_states = _validate.check_stepper_state(
            state, self._clip, self.hooks.items
        )
        self.step_count = int(state["step_count"])
        self.skipped_steps = int(state["skipped_steps"])
        self.clipped_steps = int(state["clipped_steps"])
        self.skip_reasons = Counter(state.get("skip_reasons", {}))
        if self._oom is not None:
            self._oom.halvings = int(state.get("oom_halvings", 0))
        self._precision.load_state_dict(state.get("precision", {}), state.get("loss_hint"))
        objects = [*self._clip, *self.hooks.items]
        for obj, sd in zip(objects, [*clip_states, *hook_states], strict=True):
            if hasattr(obj, "load_state_dict"):
                obj.load_state_dict(sd)


def _state_of(obj: Any) -> dict[str, Any]:
    return obj.state_dict() if hasattr(obj, "state_dict") else {}
