"""What a clip policy sees and returns: the contract between the step and every policy.

The Stepper computes the global pre-clip norm of the *normalised* gradient once, then asks
each policy in order what to do. A policy either returns a coefficient (the Stepper folds
it into the single multiply that also normalises the gradient, so a plain ``ClipNorm``
costs no extra pass over the gradients), edits the gradients in place (``ClipValue``,
AGC, through ``view.grads()``: the view then measures its norm again itself), or asks to
skip the whole update (a spike guard). Policies decide; hooks
(:mod:`gradstep.step.hooks`) only observe.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import nn

__all__ = [
    "ClipPolicy",
    "ClipResult",
    "Decision",
    "GradientView",
    "apply_policies",
    "check_norm_type",
    "norm_type_of",
    "scale_to",
]


@dataclass
class ClipResult:
    """What one policy decided for this step."""

    coef: float = 1.0
    """Multiply every gradient by this (<= 1)."""
    threshold: float | None = None
    """The threshold the policy used (a norm, or a value for ClipValue)."""
    acted: bool = False
    """True when the policy changed the gradient (or asked to skip)."""
    skip: str | None = None
    """A reason to skip the whole update, or None."""


class GradientView:
    """The gradient as the policies (and hooks) see it: normalised, unscaled, globally reduced.

    ``norm`` is the global norm (``norm_type``) of the gradient as it stands. Scaling is
    kept pending and applied to the tensors only when a policy needs them, or once at the
    end, so normalisation and a coefficient clip share one pass over memory. Handing the
    tensors out (:meth:`grads`, :meth:`named_grads`) marks them as possibly edited, and the
    next read of ``norm`` through :meth:`settle` measures it again.
    """

    def __init__(
        self,
        *,
        grads: list[torch.Tensor],
        scale: float,
        norm: float,
        norm_type: float,
        loss: float,
        step: int,
        params: Sequence[tuple[str, nn.Parameter]],
        global_norm: Callable[[Sequence[torch.Tensor], float], torch.Tensor],
        grad_owners: Sequence[tuple[str, nn.Parameter]],
    ) -> None:
        if len(grad_owners) != len(grads):
            raise ValueError(
                f"GradientView: grad_owners has {len(grad_owners)} entries for {len(grads)} "
                "gradients"
            )
        self._grads = grads
        self._scale = scale
        self.norm = norm
        self.norm_type = norm_type
        self.loss = loss
        self.step = step
        self.params = params
        self._global_norm = global_norm
        # (name, param) of each entry of ``grads``: some gradients live outside
        # ``param.grad`` (fp32 accumulation buffers of low-precision parameters).
        self._owners = list(grad_owners)
        self._lent = False

    def scale_by(self, coef: float) -> None:
        """Multiply the gradient by ``coef``: pending (no pass over memory) until needed."""
        self._scale *= coef
        self.norm *= coef

    @property
    def pending_scale(self) -> float:
        """The factor not yet applied: the true gradient is ``raw_grads() * pending_scale``."""
        return self._scale

    def raw_grads(self) -> list[torch.Tensor]:
        """The gradient tensors WITHOUT the pending scale; read-only (observers use this to
        measure without forcing the multiply early)."""
        return self._grads

    def grads(self) -> list[torch.Tensor]:
        """The normalised gradients, safe to edit in place (the norm is then re-measured)."""
        self.materialize()
        self._lent = True
        return self._grads

    def named_grads(self) -> list[tuple[str, nn.Parameter, torch.Tensor]]:
        """(name, parameter, normalised gradient) triples, for unit-wise policies (AGC);
        the gradient may be an fp32 accumulation buffer rather than ``param.grad``."""
        grads = self.grads()
        return [(n, p, g) for (n, p), g in zip(self._owners, grads, strict=True)]

    def settle(self) -> bool:
        """Re-measure ``norm`` if the tensors were handed out since the last measure (a
        policy may have edited them); True when it did."""
        if not self._lent:
            return False
        self._lent = False
        self.refresh()
        return True

    def materialize(self) -> None:
        """Apply the pending scale to the tensors: the step's one multiply."""
        if self._scale != 1.0 and self._grads:
            torch._foreach_mul_(self._grads, self._scale)
        self._scale = 1.0

    def total_norm(self, norm_type: float | None = None) -> float:
        """Global norm of the gradient as it stands (all ranks and shards)."""
        p = self.norm_type if norm_type is None else norm_type
        if p == self.norm_type:
            return self.norm
        return self._measure(p)

    def refresh(self) -> None:
        """Re-measure ``norm`` after a policy edited the gradients in place."""
        self.norm = self._measure(self.norm_type)

    def _measure(self, norm_type: float) -> float:
        return float(self._global_norm(self._grads, norm_type)) * abs(self._scale)


@runtime_checkable
class ClipPolicy(Protocol):
    """Anything with ``clip(view) -> ClipResult``; stateful ones add ``state_dict()`` and
    ``load_state_dict()``, which travel in ``Stepper.state_dict()``."""

    def clip(self, ctx: GradientView) -> ClipResult: ...


def check_norm_type(norm_type: float, owner: str) -> float:
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
        raise TypeError(f"{owner}: norm_type must be a number >= 1 or inf, got {norm_type!r}")
    if not (norm_type == math.inf or (math.isfinite(norm_type) and norm_type >= 1)):
        raise ValueError(f"{owner}: norm_type must be >= 1 or float('inf'), got {norm_type!r}")
    return float(norm_type)


def scale_to(norm: float, threshold: float | None) -> ClipResult:
    """Scale the gradient down to exactly ``threshold`` when ``norm`` exceeds it."""
    if threshold is None or not norm > threshold:
        return ClipResult(threshold=threshold)
    return ClipResult(coef=threshold / norm, threshold=threshold, acted=True)


def norm_type_of(policies: Sequence[ClipPolicy]) -> float:
    """The norm every policy is handed is measured in the first norm_type any policy names
    (``ClipNorm(norm_type=inf)`` makes ``grad_norm`` the inf-norm), else L2."""
    return next((float(p.norm_type) for p in policies if hasattr(p, "norm_type")), 2.0)


@dataclass
class Decision:
    """What the clip policies decided, together, for one step."""

    coef: float = 1.0
    threshold: float | None = None
    acted: bool = False
    skip: str | None = None
    detail: list[dict] = field(default_factory=list)
    """Per policy: name, threshold used, whether it acted (``StepStats.policies``)."""


def apply_policies(policies: Sequence[ClipPolicy], view: GradientView) -> Decision:
    """Ask each policy in order; a coefficient joins the view's pending multiply, an edit
    in place is measured again, a skip ends the round. Unless the step is skipped, the
    pending multiply (normalisation and every coefficient) is then applied, in one pass."""
    decision = Decision()
    for policy in policies:
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
    view.materialize()
    return decision
