"""LARS and LAMB step for step against the float64 re-derivation of the published updates
(tests/optim/reference.py), and against timm's Lars/Lamb when timm can be imported.

Each step starts the reference from the optimizer's own state, so an error cannot hide
in (or be blamed on) earlier steps. The error of a step is the largest, over tensors, of
||w_ours - w_ref|| / ||w_ref||; the learning rates move the weights by a few percent per
step so the check sees the update, not only the weights.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from gradstep.optim import LAMB, LARS
from tests.optim import reference

STEPS = 22
SHAPES = [(12, 6), (6,), (5, 12), (5,)]  # a zero bias (index 3) tests the "norm 0" branch

LARS_CASES = [
    dict(weight_decay=wd, momentum=m, nesterov=n, trust_clip=tc, always_adapt=aa)
    for wd, (m, n), tc, aa in itertools.product(
        (0.0, 1e-2), ((0.0, False), (0.9, False), (0.9, True)), (False, True), (False, True)
    )
]
LAMB_CASES = [
    dict(weight_decay=wd, trust_clip=tc, always_adapt=aa, decoupled_decay=dd)
    for wd, tc, aa, dd in itertools.product(
        (0.0, 0.01), (False, True), (False, True), (False, True)
    )
] + [
    dict(bias_correction=False),
    dict(grad_averaging=False, betas=(0.8, 0.99)),
    dict(caution=True),
    dict(max_grad_norm=1.0),
    dict(decoupled_decay=True, corrected_weight_decay=True),
]


def _hp(kind: str, case: dict[str, Any]) -> dict[str, Any]:
    if kind == "lars":
        base = dict(lr=4.0, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                    trust_coeff=0.001, eps=1e-8, trust_clip=False, always_adapt=False)  # fmt: skip
    else:
        base = dict(lr=0.02, bias_correction=True, betas=(0.9, 0.999), eps=1e-6,
                    weight_decay=0.01, grad_averaging=True, max_grad_norm=None,
                    trust_clip=False, always_adapt=False, caution=False,
                    decoupled_decay=False, corrected_weight_decay=False)  # fmt: skip
    return {**base, **case}


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(3)
    ps = [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]
    ps[3].zero_()
    return [torch.nn.Parameter(p.to(dtype)) for p in ps]


def _groups(params: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
    # Matrices with the case's decay, vectors in a wd=0 group (param_groups' layout).
    return [{"params": [params[0], params[2]]}, {"params": [params[1], params[3]],
            "weight_decay": 0.0}]  # fmt: skip


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [(1 + step % 3) * torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]


def _ref_step(kind, opt, params, groups, hp, grads) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The reference's new weights, from the optimizer's state before its step."""
    out = []
    clip = 1.0
    if kind == "lamb" and hp["max_grad_norm"] is not None:
        total = sum(float((g.double() ** 2).sum()) for g in grads) ** 0.5
        clip = max(total / hp["max_grad_norm"], 1.0)
    for group in groups:
        ghp = {**hp, "weight_decay": group.get("weight_decay", hp["weight_decay"]),
               "max_lr": hp["lr"]}  # fmt: skip
        for p in group["params"]:
            g = grads[next(i for i, q in enumerate(params) if q is p)]
            state = opt.state.get(p, {})
            if kind == "lars":
                w, _ = reference.lars_step(p.detach(), g, state.get("momentum_buffer"), ghp)
            else:
                st = {k: (int(v) if k == "step" else v) for k, v in state.items()}
                w, _ = reference.lamb_step(p.detach(), g, st, ghp, clip)
            out.append((p, w))
    return out


def _worst_error(kind: str, case: dict[str, Any], dtype: torch.dtype) -> float:
    hp = _hp(kind, case)
    params = _params(dtype)
    groups = _groups(params)
    opt = (LARS if kind == "lars" else LAMB)(groups, **hp)
    worst = 0.0
    for step in range(STEPS):
        grads = _grads(step)
        want = _ref_step(kind, opt, params, groups, hp, grads)
        for p, g in zip(params, grads, strict=True):
            p.grad = g.to(dtype)
        opt.step()
        for p, w in want:
            worst = max(worst, float((p.detach().double() - w).norm() / w.norm()))
    return worst


@pytest.mark.parametrize("case", LARS_CASES, ids=str)
def test_lars_matches_the_reference(case: dict[str, Any]) -> None:
    assert _worst_error("lars", case, torch.float32) <= 1e-6
    assert _worst_error("lars", case, torch.float64) <= 1e-13


@pytest.mark.parametrize("case", LAMB_CASES, ids=str)
def test_lamb_matches_the_reference(case: dict[str, Any]) -> None:
    assert _worst_error("lamb", case, torch.float32) <= 1e-6
    assert _worst_error("lamb", case, torch.float64) <= 1e-13


TIMM = reference.load_timm()


@pytest.mark.skipif(
    TIMM is None,
    reason="timm is not importable (it needs torchvision); set GRADSTEP_TIMM_SRC to a folder "
    "holding timm/optim (an unpacked timm wheel) to compare against it",
)
@pytest.mark.parametrize(
    "kind,case", [("lars", c) for c in LARS_CASES] + [("lamb", c) for c in LAMB_CASES], ids=str
)
def test_matches_timm(kind: str, case: dict[str, Any]) -> None:
    hp = _hp(kind, case)
    ours, theirs = _params(torch.float32), _params(torch.float32)
    cls, timm_cls = (LARS, TIMM[0]) if kind == "lars" else (LAMB, TIMM[1])
    a, b = cls(_groups(ours), **hp), timm_cls(_groups(theirs), **hp)
    for step in range(STEPS):
        for p, q, g in zip(ours, theirs, _grads(step), strict=True):
            p.grad, q.grad = g.float(), g.float()
        a.step()
        b.step()
        for p, q in zip(ours, theirs, strict=True):
            assert float((p - q).detach().norm() / q.detach().norm()) <= 1e-6
