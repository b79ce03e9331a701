"""Property: the pre-clip norm is the same with ``norm_in_backward`` on and off, and both
equal the plain float64 norm of the full-window gradient, for every model shape that makes
a gradient final more than once, or not in the last backward at all.

The model (:class:`Knotted`) has, at once: a segment under activation checkpointing
(none, reentrant, non-reentrant) holding a layer that is used again after it (under
reentrant checkpointing its post-accumulate-grad hook fires twice in one backward),
optionally an output layer tied to the embedding, a frozen layer in the middle, a 0-dim
gain, and two branches of which each micro-batch takes one (a branch that only earlier
micro-batches took holds a gradient but fires no hook in the last backward).
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradstep
from gradstep.step.norm import EarlyNorm

V, D = 7, 5
EXACT = 1e-12  # float64: only the order of the sums differs


class Knotted(nn.Module):
    def __init__(self, tie: bool, ckpt: str | None, seed: int = 0, scalar: bool = True) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.ckpt = ckpt
        self.emb = nn.Embedding(V, D)
        self.inner = nn.Linear(D, D)
        self.shared = nn.Linear(D, D)  # in the checkpointed segment, and after it
        self.frozen = nn.Linear(D, D).requires_grad_(False)
        self.branch = nn.ModuleList([nn.Linear(D, D), nn.Linear(D, D)])
        self.head = nn.Linear(D, V, bias=False)
        if tie:
            self.head.weight = self.emb.weight
        # FSDP2 refuses 0-dim parameters: (1,) there.
        self.gain = nn.Parameter(torch.tensor(1.5) if scalar else torch.tensor([1.5]))
        self.double()

    def segment(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.shared(torch.tanh(self.inner(h))))

    def forward(self, ids: torch.Tensor, branch: int, plain: bool = False) -> torch.Tensor:
        h = self.emb(ids)
        if self.ckpt is None or plain:
            h = self.segment(h)
        else:
            h = checkpoint(self.segment, h, use_reentrant=self.ckpt == "reentrant")
        h = torch.tanh(self.shared(h))
        h = self.branch[branch](self.frozen(h))
        return self.head(h) * self.gain


def loss_fn(model: nn.Module, mb: tuple) -> gradstep.LossSum:
    ids, labels, branch = mb
    logits = model(ids, branch)
    total = nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="sum")
    return gradstep.LossSum(total, labels.numel())


def reference_norm(model: Knotted, window: list, norm_type: float) -> float:
    """One backward of the window's mean loss, no checkpointing, torch's own norm."""
    ref = copy.deepcopy(model)
    total, items = 0.0, 0
    for ids, labels, branch in window:
        logits = ref(ids, branch, plain=True)
        total = total + nn.functional.cross_entropy(
            logits.reshape(-1, V), labels.reshape(-1), reduction="sum"
        )
        items += labels.numel()
    (total / items).backward()
    grads = [p.grad for p in ref.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads, norm_type))


def make_window(branches: list[int], rows: list[int], seed: int) -> list[tuple]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, V, (n, 3), generator=gen),
            torch.randint(0, V, (n, 3), generator=gen),
            b,
        )
        for b, n in zip(branches, rows, strict=True)
    ]


class Recorded:
    """Counts EarlyNorm.record calls per parameter and EarlyNorm.local calls."""

    def __init__(self) -> None:
        self.records: Counter[int] = Counter()
        self.local_calls = 0
        real_record, real_local = EarlyNorm.record, EarlyNorm.local

        def record(norm: EarlyNorm, param: nn.Parameter, grad: torch.Tensor) -> None:
            self.records[id(param)] += 1
            real_record(norm, param, grad)

        def local(norm: EarlyNorm, device: torch.device) -> torch.Tensor:
            self.local_calls += 1
            return real_local(norm, device)

        self.patches = [
            mock.patch.object(EarlyNorm, "record", record),
            mock.patch.object(EarlyNorm, "local", local),
        ]

    def __enter__(self) -> Recorded:
        for p in self.patches:
            p.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for p in reversed(self.patches):
            p.stop()


def _step(model: Knotted, window: list, norm_type: float, early: bool) -> gradstep.StepStats:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    clip = gradstep.ClipNorm(1e-3, norm_type=norm_type)  # acts: the multiply is checked too
    stepper = gradstep.Stepper(model, opt, clip=clip, norm_in_backward=early)
    return stepper.step(window, loss_fn)


def base_param(model: nn.Module, name: str) -> nn.Parameter:
    return dict(model.named_parameters())[name]


def _check(norm_type: float, ckpt: str | None, tie: bool, window: list, seed: int) -> None:
    base = Knotted(tie, ckpt, seed)
    want = reference_norm(base, window, norm_type)
    early, post = copy.deepcopy(base), copy.deepcopy(base)
    with Recorded() as seen:
        a = _step(early, window, norm_type, early=True)
    assert seen.local_calls == 1  # the norm really came from the backward hooks
    if ckpt == "reentrant":
        assert seen.records[id(base_param(early, "shared.weight"))] == 2  # fired twice
    b = _step(post, window, norm_type, early=False)
    assert math.isclose(a.grad_norm, want, rel_tol=EXACT), (a.grad_norm, want)
    assert math.isclose(b.grad_norm, want, rel_tol=EXACT), (b.grad_norm, want)
    assert a.clipped and b.clipped
    for (name, pa), pb in zip(early.named_parameters(), post.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=EXACT, atol=EXACT, msg=name)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("ckpt", [None, "reentrant", "non_reentrant"])
@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
def test_norm_in_backward_equals_the_pass_after_and_the_float64_reference(norm_type, ckpt, tie):
    """Every norm type, checkpointing kind and tying; branch 0 only before the last."""
    _check(norm_type, ckpt, tie, make_window([0, 0, 1], [1, 2, 3], seed=1), seed=1)


@given(
    norm_type=st.sampled_from([1.0, 2.0, math.inf]),
    branches=st.lists(st.integers(0, 1), min_size=1, max_size=4),
    rows=st.lists(st.integers(1, 3), min_size=4, max_size=4),
    seed=st.integers(0, 3),
)
def test_any_window_of_branches_under_reentrant_checkpointing(norm_type, branches, rows, seed):
    window = make_window(branches, rows[: len(branches)], seed)
    _check(norm_type, "reentrant", True, window, seed)


# ------------------------------------------------------------ 2 gloo ranks, one start

RANK_NORMS = (1.0, 2.0, math.inf)
RANK_CKPT = (None, "non_reentrant")  # DDP refuses a reentrant re-use of a parameter


def _rank_window(rank: int) -> list[tuple]:
    """Branch 0 in the first micro-batch only: never final in the last backward."""
    return make_window([0, 1], [2 + rank, 1], seed=30 + rank)


def _wrap(model: Knotted, strategy: str) -> nn.Module:
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # An unused branch per micro-batch: DDP must be told to look for unused parameters.
        return DistributedDataParallel(model, find_unused_parameters=True)
    from torch.distributed.fsdp import fully_shard

    return fully_shard(model)


def _rank_norms(rank: int, world: int) -> dict:
    out = {}
    for strategy in ("ddp", "fsdp"):
        for ckpt in RANK_CKPT:
            for norm_type in RANK_NORMS:
                norms = []
                for early in (True, False):
                    # FSDP2 refuses 0-dim parameters; its (1,) gain has an empty shard on rank 1.
                    knotted = Knotted(tie=True, ckpt=ckpt, scalar=strategy == "ddp")
                    model = _wrap(knotted, strategy)
                    norms.append(_step(model, _rank_window(rank), norm_type, early).grad_norm)
                out[(strategy, ckpt, norm_type)] = norms
    return out


@pytest.mark.distributed
def test_two_ranks_norm_in_backward_equals_the_float64_reference():
    """DDP (the norm from the reduced buckets) and FSDP2 (from the reduced shards) against
    one process holding both ranks' micro-batches."""
    from tests.support.multiproc import run_ranks

    results = run_ranks(_rank_norms, 2, timeout=180)
    window = _rank_window(0) + _rank_window(1)
    for key in results[0]:
        want = reference_norm(Knotted(tie=True, ckpt=None), window, key[2])
        for res in results:
            assert len(res[key]) == 2
            for got in res[key]:
                assert math.isclose(got, want, rel_tol=EXACT), (key, got, want)
