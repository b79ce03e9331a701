"""Adaptive clip policies and the loss-spike defence.

A fixed clip threshold is either too loose to stop a spike or too tight for healthy
training, and the gradient norm drifts over a run. These policies derive their threshold
from the run itself:

* :class:`AGC`: unit-wise ratio of gradient norm to weight norm (Brock et al. 2021);
* :class:`AutoClip`: a percentile of the earlier global norms (Seetharaman et al. 2020);
* :class:`ZClip`: z-score of the norm against its EMA mean and variance (Kumar et al. 2025);
* :class:`SpikeGuard`: skip the whole update on an outlier loss or norm (OLMo-core).

Each is a clip policy for ``Stepper(..., clip=...)`` and sees the GLOBAL pre-clip norm
(``ctx.norm``: every rank and shard, normalised, unscaled). Stateful ones keep plain Python
floats in ``state_dict()``, which travels in ``Stepper.state_dict()``, so a resumed run
clips exactly as an uninterrupted one. In a list, put :class:`SpikeGuard` first: a skipped
step then never reaches (and never updates) the statistics of the policies after it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ._validate import check_choice, check_int, check_interval, check_positive
from .clip import ClipContext, ClipPolicy, ClipResult, parse_clip

__all__ = ["AGC", "AutoClip", "SpikeGuard", "ZClip", "clip_policies", "find_output_layer"]

ZCLIP_MODES = ("zscore", "mean", "percentile")
SPIKE_SIGNALS = ("grad_norm", "loss", "both")


def _scale_to(norm: float, threshold: float | None) -> ClipResult:
    """Scale the gradient down to exactly ``threshold`` when ``norm`` exceeds it."""
    if threshold is None or not norm > threshold:
        return ClipResult(threshold=threshold)
    return ClipResult(coef=threshold / norm, threshold=threshold, acted=True)


# --------------------------------------------------------------------------------- AGC


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view: in-place edits reach the DTensor)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _shard_groups(tensors: Sequence[torch.Tensor]) -> list[Any]:
    """Process groups over which per-tensor sums must be reduced (FSDP2: the shard dims).

    Supported: DTensors sharded on dim 0 (FSDP2, HSDP) on one shared mesh. A unit (row) of a
    dim-0-sharded matrix lives on one rank, so only whole-tensor norms need a reduction.
    """
    dts = [t for t in tensors if hasattr(t, "device_mesh")]
    if not dts:
        return []
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = dts[0].device_mesh, tuple(dts[0].placements)
    for t in dts:
        if t.device_mesh != mesh or tuple(t.placements) != placements:
            raise NotImplementedError(
                "AGC supports DTensor parameters on one device mesh with identical "
                f"placements; got {placements} and {tuple(t.placements)}"
            )
    for pl in placements:
        if not (isinstance(pl, Replicate) or (isinstance(pl, Shard) and pl.dim == 0)):
            raise NotImplementedError(
                f"AGC supports Shard(0)/Replicate placements (FSDP2, HSDP), got {placements}"
            )
    return [mesh.get_group(i) for i, pl in enumerate(placements) if isinstance(pl, Shard)]


def _norm(t: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """2-norm computed in at least float32 (bf16 sums of squares lose too much)."""
    dtype = torch.promote_types(t.dtype, torch.float32)
    return torch.linalg.vector_norm(t, dim=dim, dtype=dtype)


def _unit_coefs(w: torch.Tensor, g: torch.Tensor, clipping: float, eps: float) -> torch.Tensor:
    """Per-row factor min(1, clipping * max(||W_i||, eps) / ||G_i||)."""
    return _coef_from_norms(_norm(w.flatten(1), 1), _norm(g.flatten(1), 1), clipping, eps)


def _coef_from_norms(
    w_norm: torch.Tensor, g_norm: torch.Tensor, clipping: float, eps: float
) -> torch.Tensor:
    max_norm = clipping * w_norm.clamp_min(eps)
    # g_norm > max_norm > 0 where it is used, so the division is safe.
    return torch.where(g_norm > max_norm, max_norm / g_norm, torch.ones_like(g_norm))


@torch.no_grad()
def _clip_unitwise(
    pairs: Sequence[tuple[nn.Parameter, torch.Tensor]], clipping: float, eps: float
) -> int:
    """Clip every unit in place; return how many units were clipped (on all ranks).

    One host sync at the end (the count), so on a GPU the loop only queues kernels.
    """
    groups = _shard_groups([p for p, _ in pairs])
    device = _local(pairs[0][1]).device if pairs else torch.device("cpu")
    count = torch.zeros((), dtype=torch.float64, device=device)
    whole: list[tuple[torch.Tensor, torch.Tensor]] = []
    for p, g in pairs:
        w, gl = _local(p.detach()), _local(g)
        if p.dim() > 1:
            coef = _unit_coefs(w, gl, clipping, eps)
            count += (coef < 1).sum()
            gl.mul_(coef.to(gl.dtype).view(-1, *([1] * (gl.dim() - 1))))
        else:
            whole.append((w, gl))
    # Whole-tensor norms (biases, norm gains, scalars) of sharded tensors need every shard:
    # one all-reduce of [sum w^2, sum g^2 for each tensor, units clipped so far].
    sums = [_norm(t).square().to(torch.float64) for wg in whole for t in wg]
    stacked = torch.stack([*sums, count])
    if groups:
        import torch.distributed as dist

        for group in groups:
            dist.all_reduce(stacked, group=group)
    count = stacked[-1]
    if whole:
        norms = stacked[:-1].sqrt().view(-1, 2)
        coefs = _coef_from_norms(norms[:, 0], norms[:, 1], clipping, eps)
        count = count + (coefs < 1).sum()
        for (_, gl), c in zip(whole, coefs, strict=True):
            gl.mul_(c.to(gl.dtype))  # c == 1 leaves it unchanged; no sync to test it
    return int(count)


class AGC:
    """Adaptive Gradient Clipping (Brock et al. 2021, NFNets), unit-wise.

    For each unit i (row of a Linear weight, output channel of a conv, row of an embedding):
    if ||G_i|| / max(||W_i||, eps) > clipping, G_i <- clipping * max(||W_i||, eps) / ||G_i|| * G_i.
    Tensors with <= 1 dimension (biases, norm gains) are one unit. The paper does not clip
    the final classifier: pass its parameter names in ``exclude``, e.g.
    ``AGC(exclude=gradstep.find_output_layer(model))``. Names are checked against the
    model on the first step, so a typo fails instead of silently clipping everything.

    Works on plain, DDP and FSDP2 (dim-0 sharded DTensor) models, and on low-precision
    parameters whose gradients accumulate in fp32 buffers (it clips the buffers, before the
    single rounding), through ``ClipContext.named_grads``.
    ``StepStats.policies`` reports ``threshold = clipping`` (a ratio, not a norm).
    """

    def __init__(self, clipping: float = 0.01, eps: float = 1e-3, exclude: Iterable[str] = ()):
        self.clipping = check_positive("clipping", clipping, "AGC")
        self.eps = check_positive("eps", eps, "AGC")
        exclude = exclude if isinstance(exclude, str) else list(exclude)  # a generator once
        if isinstance(exclude, str) or not all(isinstance(n, str) for n in exclude):
            raise TypeError(
                f"AGC: exclude must be a list of parameter names (str), got {exclude!r}"
            )
        self.exclude = frozenset(exclude)
        self.clipped_units = 0
        """Units clipped on the last step (over all ranks)."""

    def __repr__(self) -> str:
        return f"AGC(clipping={self.clipping}, eps={self.eps}, exclude={sorted(self.exclude)})"

    def clip(self, ctx: ClipContext) -> ClipResult:
        unknown = self.exclude - {name for name, _ in ctx.params}
        if unknown:
            raise ValueError(
                f"AGC: exclude names {sorted(unknown)} are not trainable parameters of the "
                "model; use the names of model.named_parameters() (see find_output_layer)"
            )
        pairs = [(p, g) for name, p, g in ctx.named_grads() if name not in self.exclude]
        self.clipped_units = _clip_unitwise(pairs, self.clipping, self.eps)
        acted = self.clipped_units > 0
        return ClipResult(threshold=self.clipping, acted=acted, inplace=acted)


def find_output_layer(model: nn.Module) -> list[str]:
    """Parameter names of the model's final classifier / output projection, for AGC.

    Looks for, in order: ``get_output_embeddings()`` (Hugging Face models),
    ``get_classifier()`` (timm models), else the last ``nn.Linear`` or conv layer in
    registration order (``lm_head``, ``fc``, ``classifier``). Names are those of
    ``model.named_parameters()`` as the Stepper sees them (a DDP wrapper's ``module.``
    prefix included); a weight tied to the input embedding is reported under its first
    name, e.g. ``embed.weight``, since it is one tensor with one gradient.
    """
    inner = model.module if isinstance(getattr(model, "module", None), nn.Module) else model
    layer = None
    for getter in ("get_output_embeddings", "get_classifier"):
        found = getattr(inner, getter, None)
        found = found() if callable(found) else None
        if isinstance(found, nn.Module) and any(True for _ in found.parameters()):
            layer = found
            break
    if layer is None:
        kinds = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
        layers = [m for m in inner.modules() if isinstance(m, kinds)]
        if not layers:
            raise ValueError(
                "find_output_layer: the model has no Linear or Conv layer; pass AGC's exclude "
                "names explicitly"
            )
        layer = layers[-1]
    wanted = {id(p) for p in layer.parameters()}
    return [name for name, p in model.named_parameters() if id(p) in wanted]


# ---------------------------------------------------------------------------- AutoClip


class AutoClip:
    """AutoClip (Seetharaman et al. 2020): clip to a percentile of the earlier norms.

    threshold_t = ``percentile``-th percentile (linear interpolation, as
    ``numpy.percentile``) of the pre-clip global norms of the previous ``history`` steps;
    the first step has no history and is not clipped. The current norm joins the history
    after the decision, pre-clip as in the paper.
    """

    def __init__(self, percentile: float = 10.0, history: int = 1000) -> None:
        self.percentile = check_interval("percentile", percentile, 100, True, "AutoClip")
        self.history = check_int("history", history, 1, "AutoClip")
        self._norms: deque[float] = deque(maxlen=self.history)

    def __repr__(self) -> str:
        return f"AutoClip(percentile={self.percentile}, history={self.history})"

    def clip(self, ctx: ClipContext) -> ClipResult:
        norm = ctx.total_norm(2.0)  # the papers use the L2 norm, whatever ClipNorm uses
        threshold = (
            float(np.percentile(np.fromiter(self._norms, np.float64), self.percentile))
            if self._norms
            else None
        )
        self._norms.append(norm)
        return _scale_to(norm, threshold)

    def state_dict(self) -> dict[str, Any]:
        return {"norms": list(self._norms)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._norms = deque((float(x) for x in state["norms"]), maxlen=self.history)


# ------------------------------------------------------------------------------- ZClip


class ZClip:
    """ZClip (Kumar et al. 2025, arXiv 2504.02507): z-score clipping on EMA statistics.

    The first ``warmup_steps`` norms only initialise the mean and (population) variance;
    no adaptive clip then. Afterwards, with z = (g - mean) / (std + 1e-6) and z_t =
    ``z_thresh``, a norm with z > z_t is scaled down to

    * ``mode="zscore"``: mean + z_t^2 / z * std (the paper's reciprocal threshold),
    * ``mode="mean"``: mean,
    * ``mode="percentile"``: mean + z_t * std,

    and the EMA is updated with the CLIPPED value g*: mean <- a*mean + (1-a)*g*,
    var <- a*var + (1-a)*(g* - mean)^2 with the new mean (a = ``alpha``), so a spike
    does not inflate the statistics. ``max_grad_norm``, when set, is an absolute cap on top
    (warm-up included); it does not enter the statistics. The reported threshold is the
    norm clipped to when acting, otherwise the level above which it would act.
    """

    EPS = 1e-6

    def __init__(
        self,
        alpha: float = 0.97,
        z_thresh: float = 2.5,
        warmup_steps: int = 25,
        mode: str = "zscore",
        max_grad_norm: float | None = None,
    ) -> None:
        self.alpha = check_interval("alpha", alpha, 1, False, "ZClip")
        self.z_thresh = check_positive("z_thresh", z_thresh, "ZClip")
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 1, "ZClip")
        self.mode = check_choice("mode", mode, ZCLIP_MODES, "ZClip")
        self.max_grad_norm = (
            None
            if max_grad_norm is None
            else check_positive("max_grad_norm", max_grad_norm, "ZClip")
        )
        self._warmup: list[float] = []
        self.mean: float | None = None
        self.var: float | None = None

    def __repr__(self) -> str:
        return (
            f"ZClip(alpha={self.alpha}, z_thresh={self.z_thresh}, "
            f"warmup_steps={self.warmup_steps}, mode={self.mode!r}, "
            f"max_grad_norm={self.max_grad_norm})"
        )

    def clip(self, ctx: ClipContext) -> ClipResult:
        g = ctx.total_norm(2.0)
        if self.mean is None or self.var is None:
            self._warmup.append(g)
            if len(self._warmup) >= self.warmup_steps:
                self.mean = sum(self._warmup) / len(self._warmup)
                self.var = sum((x - self.mean) ** 2 for x in self._warmup) / len(self._warmup)
                self._warmup = []
            return _scale_to(g, self.max_grad_norm)
        target, boundary = self._target(g, self.mean, self.var)
        g_star = g if target is None else min(g, target)
        self.mean = self.alpha * self.mean + (1 - self.alpha) * g_star
        self.var = self.alpha * self.var + (1 - self.alpha) * (g_star - self.mean) ** 2
        result = _scale_to(g, _min(target, self.max_grad_norm))
        if not result.acted:
            result.threshold = _min(boundary, self.max_grad_norm)
        return result

    def _target(self, g: float, mean: float, var: float) -> tuple[float | None, float]:
        """(norm to clip to or None, the norm above which z > z_thresh)."""
        std = math.sqrt(var)
        z = (g - mean) / (std + self.EPS)
        boundary = mean + self.z_thresh * (std + self.EPS)
        if not z > self.z_thresh:
            return None, boundary
        if self.mode == "zscore":
            return mean + self.z_thresh**2 / z * std, boundary
        if self.mode == "mean":
            return mean, boundary
        return mean + self.z_thresh * std, boundary

    def state_dict(self) -> dict[str, Any]:
        return {"warmup": list(self._warmup), "mean": self.mean, "var": self.var}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._warmup = [float(x) for x in state["warmup"]]
        self.mean = None if state["mean"] is None else float(state["mean"])
        self.var = None if state["var"] is None else float(state["var"])


def _min(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


# -------------------------------------------------------------------------- SpikeGuard


class SpikeGuard:
    """Skip the whole update when the loss or grad norm spikes (OLMo-core's skip step).

    A value x is a spike when x - mean > ``sigma`` * std, where mean and std (sample
    standard deviation) are taken over the previous ``window`` steps; the guard is active
    once it has seen ``min_steps`` of them. ``on`` picks the signal: ``"grad_norm"``
    (``ctx.norm``, global and pre-clip when the guard comes first), ``"loss"`` (the
    window's mean loss) or ``"both"`` (either spikes). Every finite value joins the
    window, skipped ones too, as in OLMo-core: a lasting shift in level therefore stops
    being skipped once the window has absorbed it, instead of skipping forever.

    A skip leaves parameters, optimizer and scheduler untouched; the Stepper counts it in
    ``skipped_steps`` / ``skip_reasons`` and reports the reason in ``StepStats.skip_reason``.
    The reported threshold is mean + sigma * std of the grad norm (of the loss when
    ``on="loss"``), None before the guard is active.
    """

    def __init__(
        self, sigma: float = 6.0, window: int = 128, min_steps: int = 64, on: str = "grad_norm"
    ) -> None:
        self.sigma = check_positive("sigma", sigma, "SpikeGuard")
        self.window = check_int("window", window, 2, "SpikeGuard")
        self.min_steps = check_int("min_steps", min_steps, 2, "SpikeGuard")
        if self.min_steps > self.window:
            raise ValueError(
                f"SpikeGuard: min_steps must be <= window ({self.window}), got {min_steps!r}"
            )
        self.on = check_choice("on", on, SPIKE_SIGNALS, "SpikeGuard")
        self._history: dict[str, deque[float]] = {
            key: deque(maxlen=self.window) for key in ("grad_norm", "loss")
        }
        self.skipped_steps = 0

    def __repr__(self) -> str:
        return (
            f"SpikeGuard(sigma={self.sigma}, window={self.window}, "
            f"min_steps={self.min_steps}, on={self.on!r})"
        )

    def clip(self, ctx: ClipContext) -> ClipResult:
        signals = ("grad_norm", "loss") if self.on == "both" else (self.on,)
        values = {"grad_norm": ctx.total_norm(2.0), "loss": float(ctx.loss)}
        spikes, threshold = [], None
        for key in signals:
            limit = self._limit(self._history[key])
            if limit is not None and values[key] > limit:
                spikes.append(key)
            if threshold is None:
                threshold = limit
        for key in signals:
            if math.isfinite(values[key]):
                self._history[key].append(values[key])
        if not spikes:
            return ClipResult(threshold=threshold)
        self.skipped_steps += 1
        reason = (
            f"SpikeGuard: {' and '.join(spikes)} spike (> mean + {self.sigma:g} sigma of the "
            f"last {self.window} steps)"
        )
        return ClipResult(threshold=threshold, acted=True, skip=reason)

    def _limit(self, history: deque[float]) -> float | None:
        if len(history) < self.min_steps:
            return None
        values = np.fromiter(history, np.float64)
        return float(values.mean() + self.sigma * values.std(ddof=1))

    def state_dict(self) -> dict[str, Any]:
        return {
            "grad_norm": list(self._history["grad_norm"]),
            "loss": list(self._history["loss"]),
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("grad_norm", "loss"):
            self._history[key] = deque((float(x) for x in state[key]), maxlen=self.window)
        self.skipped_steps = int(state.get("skipped_steps", 0))


# ------------------------------------------------------------------------- the CLI's


def clip_policies(
    spec: str, spike_guard: bool = False, model: nn.Module | None = None
) -> list[ClipPolicy]:
    """The policy list of ``--clip SPEC [--spike-guard]``, in the order they apply.

    ``--spike-guard`` puts a default :class:`SpikeGuard` first, so a skipped spike never
    reaches the statistics of the clip after it. With ``model`` given, ``agc`` excludes the
    model's output layer (:func:`find_output_layer`), as the paper does.
    """
    policy = parse_clip(spec)
    if isinstance(policy, AGC) and model is not None:
        policy = AGC(policy.clipping, policy.eps, exclude=find_output_layer(model))
    return [*([SpikeGuard()] if spike_guard else []), *([policy] if policy is not None else [])]
