"""LAMB (You et al. 2020), NVLAMB flavour, exact on sharded (FSDP2) parameters."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

from .._validate import check_flag, check_number, check_params
from ..parallel.dtensor import reduce_over_shards, shard_groups, to_local, whole_norms, wide_dtype

__all__ = ["LAMB"]

_OWNER = "LAMB"


@dataclass
class _Item:
    """One parameter's share of a step: its group, the tensor, the local gradient (after
    the optional clip) and the local update being built."""

    group: dict[str, Any]
    p: torch.Tensor
    grad: torch.Tensor
    update: torch.Tensor


def _lamb_ratios(w_norm: torch.Tensor, u_norm: torch.Tensor, clip: torch.Tensor) -> torch.Tensor:
    """||w|| / ||update||, 1 where either is 0; LAMBC (``trust_clip``) caps it at 1."""
    ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
    return torch.where(clip, torch.clamp(ratio, max=1.0), ratio)


class LAMB(Optimizer):
    """LAMB: Adam moments, then each parameter's update scaled by ``||w|| / ||update||``.

    ``update = m_hat / (sqrt(v_hat) + eps) + weight_decay * w`` (or decoupled decay,
    ``w -= lr * weight_decay * w``), ``w -= lr * trust_ratio * update``. Argument names
    and defaults are timm's ``Lamb`` (timm 1.0.x) with one exception: ``max_grad_norm``
    defaults to None (no clipping inside the optimizer), because gradstep's Stepper has
    already clipped on the global norm; clipping again here would clip twice.

    The layer adaptation applies to groups with ``weight_decay != 0`` or ``always_adapt``
    (the no-decay group of :func:`gradstep.optim.param_groups` is a plain Adam step).

    Exact under FSDP2: ``||w||`` and ``||update||`` are whole-parameter norms, reduced
    over the shards in one collective per step. ``max_grad_norm`` (a global norm) and
    ``caution`` (a whole-tensor mean) each need one more collective, taken only when they
    are set. ``p.grad`` is left unchanged. ``foreach`` is accepted for timm compatibility
    and does not change the result.
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        grad_averaging: bool = True,
        max_grad_norm: float | None = None,
        trust_clip: bool = False,
        always_adapt: bool = False,
        caution: bool = False,
        decoupled_decay: bool = False,
        corrected_weight_decay: bool = False,
        foreach: bool | None = None,
    ) -> None:
        check_number(
            "max_grad_norm", max_grad_norm, _OWNER, above=True, optional=True, error=ValueError
        )
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            grad_averaging=grad_averaging,
            max_grad_norm=max_grad_norm,
            trust_clip=trust_clip,
            always_adapt=always_adapt,
            caution=caution,
            decoupled_decay=decoupled_decay,
            corrected_weight_decay=corrected_weight_decay,
            # The peak lr for corrected decay (lr^2 / max_lr): the constructor's, before a
            # schedule changes group["lr"].
            max_lr_snapshot=float(lr) if isinstance(lr, (int, float)) else lr,
            foreach=check_flag("foreach", foreach, _OWNER, optional=True),
        )
        _check_group(defaults)
        super().__init__(check_params(params, _OWNER), defaults)
        for group in self.param_groups:
            _check_group(group)
            if group["max_grad_norm"] != max_grad_norm:
                raise ValueError(
                    f"{_OWNER}: max_grad_norm clips one global norm over every group: set it "
                    f"on {_OWNER}(...), not in a param group (got {group['max_grad_norm']!r} "
                    f"in a group, {max_grad_norm!r} for the optimizer)"
                )

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for key in ("caution", "decoupled_decay", "corrected_weight_decay"):
                group.setdefault(key, False)
            group.setdefault("max_lr_snapshot", self.defaults.get("max_lr_snapshot", group["lr"]))
            group.setdefault("foreach", None)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One LAMB step; ``closure`` (optional) re-evaluates the loss, as in torch.optim."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not params:
            return loss
        clip = self._clip_divisor(params)
        items = [
            self._moments(group, p, clip)
            for group in self.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        if any(it.group["caution"] for it in items):
            _apply_caution([it for it in items if it.group["caution"]])
        for it in items:
            _weight_decay(it)
        adapted = [it for it in items if it.group["weight_decay"] != 0 or it.group["always_adapt"]]
        if adapted:
            _adapt(adapted)
        for it in items:
            to_local(it.p).add_(it.update, alpha=-it.group["lr"])
        return loss

    def _clip_divisor(self, params: list[torch.Tensor]) -> torch.Tensor | None:
        """max(1, ||all grads|| / max_grad_norm), the global norm over every shard."""
        max_norm = self.defaults["max_grad_norm"]
        if max_norm is None:
            return None
        grads = [to_local(p.grad) for p in params]
        norms = whole_norms(grads, [shard_groups(p) for p in params])
        return (torch.linalg.vector_norm(norms) / max_norm).clamp_(min=1.0)

    def _moments(self, group: dict[str, Any], p: torch.Tensor, clip: torch.Tensor | None) -> _Item:
        """Update the moments of ``p`` (on its local shard) and return its raw update."""
        state = self.state[p]
        if not state:
            # Per-parameter step (as torch.optim.Adam): it checkpoints with the moments.
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p)  # a DTensor under FSDP2, like p
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        step = float(state["step"])
        beta1, beta2 = group["betas"]
        beta3 = 1 - beta1 if group["grad_averaging"] else 1.0
        grad = to_local(p.grad)
        if clip is not None:
            grad = grad / clip.to(grad.dtype)
        m, v = to_local(state["exp_avg"]), to_local(state["exp_avg_sq"])
        if beta3 == 1 - beta1:
            m.lerp_(grad, beta3)
        else:
            m.mul_(beta1).add_(grad, alpha=beta3)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if group["bias_correction"]:
            bc1, bc2 = 1 - beta1**step, 1 - beta2**step
        else:
            bc1, bc2 = 1.0, 1.0
        denom = (v.sqrt() / (bc2**0.5)).add_(group["eps"])
        return _Item(group, p, grad, (m / bc1).div_(denom))


def _apply_caution(items: list[_Item]) -> None:
    """Cautious optimizers (Liang et al. 2024): keep the components whose sign agrees with
    the gradient, rescaled by the kept fraction of the whole tensor (a reduced mean)."""
    masks = [(it.update * it.grad > 0).to(it.grad.dtype) for it in items]
    sums = torch.stack([m.sum(dtype=wide_dtype([m])) for m in masks])
    sums = reduce_over_shards(sums, [shard_groups(it.p) for it in items])
    numel = torch.tensor([it.p.numel() for it in items], dtype=sums.dtype, device=sums.device)
    scale = (sums / numel).clamp_(min=1e-3)
    for it, mask, s in zip(items, masks, scale.unbind(0), strict=True):
        it.update.mul_(mask.div_(s.to(mask.dtype)))


def _weight_decay(it: _Item) -> None:
    group, wd = it.group, it.group["weight_decay"]
    if wd == 0:
        return
    w = to_local(it.p)
    if group["decoupled_decay"]:
        lr = group["lr"]
        scale = lr**2 / group["max_lr_snapshot"] if group["corrected_weight_decay"] else lr
        w.add_(w, alpha=-scale * wd)
    else:
        it.update.add_(w, alpha=wd)


def _adapt(items: list[_Item]) -> None:
    """Scale each update by its trust ratio; [||w||..., ||update||...] in one reduction."""
    layouts = [shard_groups(it.p) for it in items]
    norms = whole_norms([to_local(it.p) for it in items] + [it.update for it in items], layouts * 2)
    w_norm, u_norm = norms.split(len(items))
    clip = torch.tensor([bool(it.group["trust_clip"]) for it in items], device=norms.device)
    for it, r in zip(items, _lamb_ratios(w_norm, u_norm, clip).unbind(0), strict=True):
        it.update.mul_(r.to(it.update.dtype))


def _check_group(group: dict[str, Any]) -> None:
    for name in ("lr", "eps", "weight_decay"):
        check_number(name, group[name], _OWNER)
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"{_OWNER}: betas must be a pair (beta1, beta2), got {betas!r}")
    for name, beta in zip(("betas[0]", "betas[1]"), betas, strict=True):
        check_number(name, beta, _OWNER, high=1.0)
    for name in ("bias_correction", "grad_averaging", "trust_clip", "always_adapt", "caution",
                 "decoupled_decay", "corrected_weight_decay"):  # fmt: skip
        check_flag(name, group[name], _OWNER)
    if group["corrected_weight_decay"] and not group["max_lr_snapshot"] > 0:
        raise ValueError(
            f"{_OWNER}: corrected_weight_decay needs a positive peak lr (lr^2 / max_lr), got "
            f"lr={group['lr']!r}; construct the optimizer with the peak lr"
        )
