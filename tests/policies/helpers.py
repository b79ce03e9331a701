"""Helpers of the clip policies' tests: a one-parameter harness, plain references.

The scalar model's gradient IS a chosen number (loss = w * g, loss value = the offset), so
a step's global norm is g and, with SGD(lr=1), the clipped gradient is the parameter change.
The references compute the papers' formulas the plain way, in float64, with ``statistics``,
sorted lists and explicit per-row loops, independently of gradstep.policies.
"""

from __future__ import annotations

import copy
import math
import statistics

import numpy as np
import pytest
import torch
from torch import nn

import gradstep
from gradstep import LossSum, Stepper
from gradstep.policies import AGC, SpikeGuard, ZClip


class Scalar(nn.Module):
    """One float64 parameter; ``scalar_loss`` makes its gradient g and its loss the offset."""

    def __init__(self, w: float = 0.0) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([w], dtype=torch.float64))


def scalar_loss(model: nn.Module, mb: tuple[float, float]) -> LossSum:
    g, offset = mb
    w = model.w.sum()
    return LossSum((w - w.detach()) * g + offset, 1)  # gradient g, loss value = offset


class Run:
    """A Stepper on the scalar model with SGD(lr=1) (or Adam, to test optimizer state)."""

    def __init__(self, clip, w: float = 0.0, adam: bool = False) -> None:
        self.model = Scalar(w)
        params = self.model.parameters()
        self.opt = torch.optim.Adam(params, lr=0.1) if adam else torch.optim.SGD(params, lr=1.0)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=1, gamma=1.0)
        self.stepper = Stepper(self.model, self.opt, self.sched, clip=clip)

    def step(self, g: float, offset: float = 0.0) -> tuple[float, gradstep.StepStats]:
        before = self.model.w.item()
        stats = self.stepper.step([(g, offset)], scalar_loss)
        return before - self.model.w.item(), stats

    def run(self, norms, offsets=None) -> tuple[list[float], list[gradstep.StepStats]]:
        offsets = offsets if offsets is not None else [0.0] * len(norms)
        out = [self.step(g, c) for g, c in zip(norms, offsets, strict=True)]
        return [a for a, _ in out], [s for _, s in out]


def spiky_norms(n: int = 40, seed: int = 0) -> list[float]:
    """Norms around 1 with a slow drift and spikes of 5x-60x at fixed steps."""
    rng = np.random.default_rng(seed)
    norms = (1.0 + 0.01 * np.arange(n)) * np.exp(0.15 * rng.standard_normal(n))
    for i, factor in {7: 20.0, 12: 5.0, 19: 60.0, 23: 3.0, 31: 8.0}.items():
        if i < n:
            norms[i] *= factor
    return [float(x) for x in norms]


def zclip_reference(norms, alpha, z_t, warmup, mode, cap):
    """ZClip from the paper: population stats over the warm-up, then EMA of clipped norms."""
    out, buf, mean, var = [], [], None, None
    for g in norms:
        if mean is None:
            buf.append(g)
            if len(buf) == warmup:
                mean, var = statistics.fmean(buf), statistics.pvariance(buf)
            out.append(g if cap is None else min(g, cap))
            continue
        std = math.sqrt(var)
        z = (g - mean) / (std + 1e-6)
        eff = g
        if z > z_t:
            eff = {"zscore": mean + z_t**2 / z * std, "mean": mean, "percentile": mean + z_t * std}[
                mode
            ]
        mean = alpha * mean + (1 - alpha) * eff
        var = alpha * var + (1 - alpha) * (eff - mean) ** 2
        out.append(eff if cap is None else min(eff, cap))
    return out


def linear_percentile(values, p):
    """The p-th percentile by linear interpolation between closest ranks."""
    s = sorted(values)
    rank = p / 100 * (len(s) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (rank - lo) * (s[hi] - s[lo])


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.fc = nn.Linear(36, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc(torch.tanh(self.conv(x)).flatten(1))))


def mse_sum(model: nn.Module, mb: tuple[torch.Tensor, torch.Tensor]) -> LossSum:
    x, y = mb
    return LossSum((model(x) - y).square().sum(), x.shape[0])


def agc_reference(model: nn.Module, grads: dict, clipping: float, eps: float, exclude) -> dict:
    """Unit-wise clip with explicit per-row loops in float64."""
    out = {}
    for name, p in model.named_parameters():
        p, g = p.detach(), grads[name].clone()
        if name not in exclude:
            rows = range(p.shape[0]) if p.dim() > 1 else [None]
            for r in rows:
                w_r, g_r = (p, g) if r is None else (p[r], g[r])
                w_norm = max(math.sqrt(float((w_r.double() ** 2).sum())), eps)
                g_norm = math.sqrt(float((g_r.double() ** 2).sum()))
                if g_norm > clipping * w_norm:
                    g_r.mul_(clipping * w_norm / g_norm)
        out[name] = g
    return out


def spike_reference(values, sigma, window, min_steps):
    """Skip decisions: value - mean > sigma * sample std over the previous window."""
    skips, seen = [], []
    for v in values:
        prev = seen[-window:]
        skips.append(
            len(prev) >= min_steps and v - statistics.fmean(prev) > sigma * statistics.stdev(prev)
        )
        seen.append(v)
    return skips


class Wide(nn.Module):
    """Odd row counts (5, 3) so the dim-0 shards are uneven; LayerNorm gains are 1-D."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.norm = nn.LayerNorm(5)
        self.out = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(torch.tanh(self.fc(x))))


def fsdp_policies(model: nn.Module) -> list:
    return [
        SpikeGuard(sigma=3.0, window=4, min_steps=2),
        ZClip(warmup_steps=2, z_thresh=1.0),
        AGC(clipping=0.7, exclude=["out.bias"]),
    ]


def fsdp_worker(rank: int, world: int) -> None:
    """On each of ``world`` ranks (``run_ranks``): the policies under FSDP2 on this rank's
    share of every window match one process stepping the whole window."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    ref = Wide().double()
    sharded = copy.deepcopy(ref)
    fully_shard(sharded.fc)
    fully_shard(sharded)
    make = lambda m: Stepper(m, torch.optim.SGD(m.parameters(), lr=0.5), clip=fsdp_policies(m))
    local, dist_stepper = make(ref), make(sharded)
    gen = torch.Generator().manual_seed(1)
    units, zclip_acted = [], 0
    for step in range(7):
        scale = {3: 8.0, 5: 30.0}.get(step, 1.0)  # 3: clipped by ZClip; 5: skipped
        mbs = [
            (torch.randn(3, 4, generator=gen, dtype=torch.float64),
             scale * torch.randn(3, 3, generator=gen, dtype=torch.float64))
            for _ in range(4)
        ]  # fmt: skip
        want = local.step(mbs, lambda m, mb: LossSum((m(mb[0]) - mb[1]).square().sum(), 3))
        got = dist_stepper.step(
            mbs[rank::world], lambda m, mb: LossSum((m(mb[0]) - mb[1]).square().sum(), 3)
        )
        assert got.skipped == want.skipped and got.skip_reason == want.skip_reason
        assert dist_stepper.clip[2].clipped_units == local.clip[2].clipped_units
        units.append(local.clip[2].clipped_units)
        zclip_acted += got.policies[1]["acted"] if len(got.policies) > 1 else 0
        for a, b in zip(got.policies, want.policies, strict=True):
            assert (a["name"], a["acted"]) == (b["name"], b["acted"])
            assert a["threshold"] == (
                None if b["threshold"] is None else pytest.approx(b["threshold"], rel=1e-10)
            )
        assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-10)
        assert got.post_clip_norm == pytest.approx(want.post_clip_norm, rel=1e-10, nan_ok=True)
    # The case is what we think: one skip, ZClip acted, AGC clipped some units, not all.
    assert local.skipped_steps == 1 == dist_stepper.skipped_steps and zclip_acted == 1
    assert any(0 < u < 11 for u in units), units
    for (_name, p), q in zip(sharded.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-10, atol=1e-12)
