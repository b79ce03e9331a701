"""The LARS and LAMB updates re-derived from the published formulas, in float64, and a
loader for timm's ``Lars``/``Lamb`` where timm (or its source) is available.

The reference follows timm 1.0.x's semantics (written from the formulas, not its code):
LARS (You et al. 2017, LARC clip from apex), LAMB (You et al. 2020, NVLAMB flavour).
Each function takes one step from the given state and returns the new parameters and
state, all float64, so a test can compare any implementation step by step without the
errors of earlier steps adding up.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

Tensor = torch.Tensor


def _norm(t: Tensor) -> float:
    return math.sqrt(float((t.double() ** 2).sum()))


def lars_step(
    w: Tensor, g: Tensor, buf: Tensor | None, hp: dict[str, Any]
) -> tuple[Tensor, Tensor | None]:
    """One LARS step of one tensor: (new w, new momentum buffer)."""
    w, g = w.double(), g.double()
    wd, lr = hp["weight_decay"], hp["lr"]
    if wd != 0 or hp["always_adapt"]:
        wn, gn = _norm(w), _norm(g)
        ratio = hp["trust_coeff"] * wn / (gn + wd * wn + hp["eps"]) if wn > 0 and gn > 0 else 1.0
        if hp["trust_clip"]:
            ratio = min(ratio / lr, 1.0)
        g = (g + wd * w) * ratio
    if hp["momentum"] != 0:
        m = hp["momentum"]
        buf = g.clone() if buf is None else m * buf.double() + (1 - hp["dampening"]) * g
        g = g + m * buf if hp["nesterov"] else buf
    return w - lr * g, buf


def lamb_step(
    w: Tensor, g: Tensor, state: dict[str, Any], hp: dict[str, Any], clip: float = 1.0
) -> tuple[Tensor, dict[str, Any]]:
    """One LAMB step of one tensor; ``clip`` is the global-norm divisor (>= 1)."""
    w, g = w.double(), g.double() / clip
    step = state.get("step", 0) + 1
    m = state.get("exp_avg", torch.zeros_like(w)).double()
    v = state.get("exp_avg_sq", torch.zeros_like(w)).double()
    b1, b2 = hp["betas"]
    b3 = 1 - b1 if hp["grad_averaging"] else 1.0
    m = b1 * m + b3 * g
    v = b2 * v + (1 - b2) * g * g
    bc1, bc2 = (1 - b1**step, 1 - b2**step) if hp["bias_correction"] else (1.0, 1.0)
    u = (m / bc1) / (v.sqrt() / math.sqrt(bc2) + hp["eps"])
    if hp["caution"]:
        mask = (u * g > 0).double()
        u = u * mask / max(float(mask.mean()), 1e-3)
    wd, lr = hp["weight_decay"], hp["lr"]
    if wd != 0:
        if hp["decoupled_decay"]:
            scale = lr**2 / hp["max_lr"] if hp["corrected_weight_decay"] else lr
            w = w - scale * wd * w
        else:
            u = u + wd * w
    if wd != 0 or hp["always_adapt"]:
        wn, un = _norm(w), _norm(u)
        ratio = wn / un if wn > 0 and un > 0 else 1.0
        u = u * (min(ratio, 1.0) if hp["trust_clip"] else ratio)
    return w - lr * u, {"step": step, "exp_avg": m, "exp_avg_sq": v}


def load_timm() -> tuple[Any, Any] | None:
    """timm's ``(Lars, Lamb)``: from an installed timm, else from the source tree in
    ``$GRADSTEP_TIMM_SRC`` (a folder holding ``timm/optim``; ``import timm`` itself needs
    torchvision, the two optimizer modules need only torch). None when neither is there."""
    try:
        from timm.optim.lamb import Lamb
        from timm.optim.lars import Lars

        return Lars, Lamb
    except ImportError:
        pass
    root = os.environ.get("GRADSTEP_TIMM_SRC")
    folder = Path(root or "/nonexistent", "timm", "optim")
    if not (folder / "lars.py").exists():
        return None
    name = "_timm_optim_src"
    if name not in sys.modules:
        # A package object for the folder without running its __init__ (which imports
        # every timm optimizer), so that ``from ._helpers import ...`` resolves.
        spec = importlib.util.spec_from_loader(name, loader=None, is_package=True)
        package = importlib.util.module_from_spec(spec)
        package.__path__ = [str(folder)]
        sys.modules[name] = package
    lars = importlib.import_module(f"{name}.lars")
    lamb = importlib.import_module(f"{name}.lamb")
    return lars.Lars, lamb.Lamb
