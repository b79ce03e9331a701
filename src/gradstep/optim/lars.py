"""LARS / LARC (You, Gitman, Ginsburg 2017), exact on sharded (FSDP2) parameters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from .._validate import check_flag, check_number, check_params
from ..parallel.dtensor import shard_groups, to_local, whole_norms

__all__ = ["LARS"]

_OWNER = "LARS"


def _trust_ratios(
    w_norm: torch.Tensor, g_norm: torch.Tensor, groups: list[dict[str, Any]]
) -> torch.Tensor:
    """trust_coeff * ||w|| / (||g|| + weight_decay * ||w|| + eps) for every adapted
    parameter at once; 1 where either norm is 0; LARC clips it to ``<= 1`` after / lr."""

    def column(key: str) -> torch.Tensor:
        return torch.tensor([float(g[key]) for g in groups], dtype=w_norm.dtype)

    keys = ("trust_coeff", "weight_decay", "eps", "lr")
    coeff, wd, eps, lr = (column(k).to(w_norm.device) for k in keys)
    ratio = coeff * w_norm / (g_norm + w_norm * wd + eps)
    ratio = torch.where((w_norm > 0) & (g_norm > 0), ratio, torch.ones_like(ratio))
    clip = torch.tensor([bool(g["trust_clip"]) for g in groups], device=w_norm.device)
    # lr == 0 (e.g. torch.distributed.checkpoint initialising state): inf, clamped to 1.
    return torch.where(clip, torch.clamp(ratio / lr, max=1.0), ratio)


class LARS(Optimizer):
    """LARS: SGD whose step on each parameter is scaled by a layer-wise trust ratio.

    ``trust_ratio = trust_coeff * ||w|| / (||g|| + weight_decay * ||w|| + eps)`` (1 if a
    norm is 0); the gradient plus weight decay is multiplied by it, then the (Nesterov)
    momentum SGD step follows. Argument names and defaults are timm's ``Lars``
    (timm 1.0.x); ``trust_clip=True`` is LARC (``min(trust_ratio / lr, 1)``).

    The adaptation applies to groups with ``weight_decay != 0`` or ``always_adapt``, so
    the no-decay group of :func:`gradstep.optim.param_groups` (biases, norm gains) is a
    plain SGD step, as in the paper.

    Exact under FSDP2: ``||w||`` and ``||g||`` are the norms of whole parameters, their
    squares summed over the shards in one collective per step. Under DDP (every rank holds
    whole tensors) nothing is reduced. ``p.grad`` is left unchanged.

    ``foreach`` is accepted for timm compatibility; the update runs on each (local)
    tensor, the norms are batched whatever it says.
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1.0,
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float = 0,
        nesterov: bool = False,
        trust_coeff: float = 0.001,
        eps: float = 1e-8,
        trust_clip: bool = False,
        always_adapt: bool = False,
        foreach: bool | None = None,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            trust_coeff=trust_coeff,
            eps=eps,
            trust_clip=trust_clip,
            always_adapt=always_adapt,
            foreach=check_flag("foreach", foreach, _OWNER, optional=True),
        )
        _check_group(defaults)
        super().__init__(check_params(params, _OWNER), defaults)
        for group in self.param_groups:  # a group may override any of the defaults
            _check_group(group)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nesterov", False)
            group.setdefault("foreach", None)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One LARS step; ``closure`` (optional) re-evaluates the loss, as in torch.optim."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [
            (group, p) for group in self.param_groups for p in group["params"] if p.grad is not None
        ]
        adapted = [(g, p) for g, p in work if g["weight_decay"] != 0 or g["always_adapt"]]
        ratios: dict[int, torch.Tensor] = {}
        if adapted:
            ws = [to_local(p) for _, p in adapted]
            gs = [to_local(p.grad) for _, p in adapted]
            layouts = [shard_groups(p) for _, p in adapted]
            # [||w|| for each, ||g|| for each]: both halves in one reduction.
            norms = whole_norms(ws + gs, layouts + layouts)
            w_norm, g_norm = norms.split(len(adapted))
            found = _trust_ratios(w_norm, g_norm, [g for g, _ in adapted])
            ratios = {id(p): r for (_, p), r in zip(adapted, found.unbind(0), strict=True)}
        for group, p in work:
            self._update(group, p, ratios.get(id(p)))
        return loss

    def _update(self, group: dict[str, Any], p: torch.Tensor, ratio: torch.Tensor | None) -> None:
        w, grad = to_local(p), to_local(p.grad)
        if ratio is not None:
            grad = grad.add(w, alpha=group["weight_decay"]).mul_(ratio.to(grad.dtype))
        momentum = group["momentum"]
        if momentum != 0:
            state = self.state[p]
            buf = state.get("momentum_buffer")
            if buf is None:
                # Like p (a DTensor under FSDP2) so that the state checkpoints as p does.
                buf = state["momentum_buffer"] = torch.zeros_like(p)
                to_local(buf).copy_(grad)
            else:
                to_local(buf).mul_(momentum).add_(grad, alpha=1.0 - group["dampening"])
            grad = grad.add(to_local(buf), alpha=momentum) if group["nesterov"] else to_local(buf)
        w.add_(grad, alpha=-group["lr"])


def _check_group(group: dict[str, Any]) -> None:
    for name in ("lr", "momentum", "weight_decay", "trust_coeff", "eps"):
        check_number(name, group[name], _OWNER)
    check_number("dampening", group["dampening"], _OWNER, high=1.0, closed=True)
    for name in ("nesterov", "trust_clip", "always_adapt"):
        check_flag(name, group[name], _OWNER)
    if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
        raise ValueError(
            f"{_OWNER}: nesterov=True needs momentum > 0 and dampening = 0, got momentum="
            f"{group['momentum']!r}, dampening={group['dampening']!r}"
        )
