"""Clip policies and the context the Stepper hands them.

The Stepper computes the global pre-clip norm of the *normalised* gradient once, then
asks each policy in order what to do. A policy either returns a coefficient (the Stepper
folds it into the single multiply that also normalises the gradient, so a plain
``ClipNorm`` costs no extra pass over the gradients), edits the gradients in place
(``ClipValue``, AGC), or asks to skip the whole update (a spike guard).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from ._validate import check_positive


@dataclass
class ClipResult:
    """What one policy decided for this step."""

    coef: float = 1.0
    """Multiply every gradient by this (<= 1)."""
    threshold: float | None = None
    """The threshold the policy used (a norm, or a value for ClipValue)."""
    acted: bool = False
    """True when the policy changed the gradient (or asked to skip)."""
    inplace: bool = False
    """True when the policy edited the gradients itself (the norm must be re-measured)."""
    skip: str | None = None
    """A reason to skip the whole update, or None."""


class ClipContext:
    """The gradient as the policies see it: normalised, unscaled, globally reduced.

    ``norm`` is the global norm (``norm_type``) of the gradient as it stands. Scaling is
    kept pending and applied to the tensors only when a policy needs them, or once at the
    end, so normalisation and a coefficient clip share one pass over memory.
    """

    def __init__(
        self,
        grads: list[torch.Tensor],
        scale: float,
        norm: float,
        norm_type: float,
        loss: float,
        step: int,
        params: Sequence[tuple[str, nn.Parameter]],
        global_norm: Callable[[Sequence[torch.Tensor], float], torch.Tensor],
        grad_owners: Sequence[tuple[str, nn.Parameter]] | None = None,
    ) -> None:
        self._grads = grads
        self._scale = scale
        self.norm = norm
        self.norm_type = norm_type
        self.loss = loss
        self.step = step
        self.params = params
        self._global_norm = global_norm
        # (name, param) of each entry of ``grads``, when the caller knows it; needed when
        # some gradients live outside ``param.grad`` (fp32 accumulation buffers).
        self._owners = grad_owners

    def scale_by(self, coef: float) -> None:
        self._scale *= coef
        self.norm *= coef

    def grads(self) -> list[torch.Tensor]:
        """The normalised gradients, safe to edit in place."""
        self.apply()
        return self._grads

    def named_grads(self) -> list[tuple[str, nn.Parameter, torch.Tensor]]:
        """(name, parameter, normalised gradient) triples, for unit-wise policies (AGC).

        The Stepper passes ``grad_owners`` (fp32 accumulation buffers of low-precision
        parameters included). Without it each gradient must be its parameter's ``.grad``;
        a gradient held elsewhere cannot be attributed: raise instead of guessing.
        """
        grads = self.grads()
        if self._owners is not None:
            if len(self._owners) != len(grads):
                raise RuntimeError(
                    f"ClipContext: grad_owners has {len(self._owners)} entries for "
                    f"{len(grads)} gradients"
                )
            return [(n, p, g) for (n, p), g in zip(self._owners, grads, strict=True)]
        triples = [(n, p, p.grad) for n, p in self.params if p.grad is not None]
        if len(triples) != len(grads) or any(
            t[2] is not g for t, g in zip(triples, grads, strict=False)
        ):
            raise RuntimeError(
                "this clip policy needs each gradient's parameter, but some gradients are "
                "held in accumulation buffers (low-precision parameters with accum_dtype); "
                "keep the parameters in float32 and use precision='bf16'/'fp16' (autocast), "
                "or pass accum_dtype equal to the parameter dtype"
            )
        return triples

    def apply(self) -> None:
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
    def clip(self, ctx: ClipContext) -> ClipResult: ...


def _check_norm_type(norm_type: float, owner: str) -> float:
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
        raise TypeError(f"{owner}: norm_type must be a number >= 1 or inf, got {norm_type!r}")
    if not (norm_type == math.inf or (math.isfinite(norm_type) and norm_type >= 1)):
        raise ValueError(f"{owner}: norm_type must be >= 1 or float('inf'), got {norm_type!r}")
    return float(norm_type)


class ClipNorm:
    """Scale the whole gradient so that its global norm is at most ``max_norm``.

    coef = min(1, max_norm / (norm + 1e-6)), the formula of ``torch.nn.utils.clip_grad_norm_``,
    applied to the global norm over every rank and shard.
    """

    def __init__(self, max_norm: float = 1.0, norm_type: float = 2.0) -> None:
        self.max_norm = check_positive("max_norm", max_norm, "ClipNorm")
        self.norm_type = _check_norm_type(norm_type, "ClipNorm")

    def __repr__(self) -> str:
        return f"ClipNorm(max_norm={self.max_norm}, norm_type={self.norm_type})"

    def clip(self, ctx: ClipContext) -> ClipResult:
        norm = ctx.total_norm(self.norm_type)
        coef = min(1.0, self.max_norm / (norm + 1e-6))
        return ClipResult(coef=coef, threshold=self.max_norm, acted=coef < 1.0)


class ClipValue:
    """Clamp every gradient element to [-value, value] (after normalisation and unscale)."""

    def __init__(self, value: float) -> None:
        self.value = check_positive("value", value, "ClipValue")

    def __repr__(self) -> str:
        return f"ClipValue(value={self.value})"

    def clip(self, ctx: ClipContext) -> ClipResult:
        grads = ctx.grads()
        # The global max |g| (every rank and shard must agree whether to act), so an
        # untouched gradient is reported as not clipped.
        peak = ctx.total_norm(math.inf)
        if peak <= self.value:
            return ClipResult(threshold=self.value)
        torch._foreach_clamp_min_(grads, -self.value)
        torch._foreach_clamp_max_(grads, self.value)
        return ClipResult(threshold=self.value, acted=True, inplace=True)


def as_policies(clip: Any) -> list[ClipPolicy]:
    """Normalise the ``clip=`` argument: None, one policy, or a list applied in order."""
    if clip is None:
        return []
    items = list(clip) if isinstance(clip, (list, tuple)) else [clip]
    for item in items:
        if not isinstance(item, ClipPolicy):
            raise TypeError(
                "clip must be None, a clip policy (gradstep.ClipNorm, ClipValue, AGC, AutoClip, "
                f"ZClip, SpikeGuard) or a list of them; got {type(item).__name__}"
            )
    return items


CLIP_SPECS = "none, norm[:MAX], value:V, zclip[:Z], autoclip[:P], agc[:LAMBDA]"


def parse_clip(spec: str) -> ClipPolicy | None:
    """Parse a command-line clip spec into one policy (or None).

    ``none``; ``norm[:MAX]`` (ClipNorm, default 1.0); ``value:V`` (ClipValue);
    ``zclip[:Z]`` (ZClip with z_thresh Z, default 2.5); ``autoclip[:P]`` (AutoClip at
    percentile P, default 10); ``agc[:LAMBDA]`` (AGC with clipping LAMBDA, default 0.01,
    excluding nothing: use :func:`gradstep.adaptive.clip_policies` to exclude the output
    layer of a model).
    """
    from . import adaptive  # adaptive imports this module: import it lazily

    if not isinstance(spec, str):
        raise TypeError(f"--clip must be a string ({CLIP_SPECS}); got {spec!r}")
    name, sep, arg = spec.strip().partition(":")
    name = name.lower()
    makers: dict[str, Callable[[float | None], ClipPolicy]] = {
        "norm": lambda v: ClipNorm(1.0 if v is None else v),
        "value": lambda v: ClipValue(v),  # type: ignore[arg-type]  # None is rejected below
        "zclip": lambda v: adaptive.ZClip() if v is None else adaptive.ZClip(z_thresh=v),
        "autoclip": lambda v: adaptive.AutoClip() if v is None else adaptive.AutoClip(v),
        "agc": lambda v: adaptive.AGC() if v is None else adaptive.AGC(clipping=v),
    }
    if name == "none" and not sep:
        return None
    if name not in makers:
        raise ValueError(f"--clip must be one of {CLIP_SPECS}; got {spec!r}")
    if name == "value" and not arg:
        raise ValueError(f"--clip {spec!r}: value needs a number, e.g. value:0.5")
    try:
        return makers[name](float(arg) if arg else None)
    except ValueError as exc:
        raise ValueError(f"--clip {spec!r}: {exc}") from exc
