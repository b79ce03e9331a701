"""Properties of the window's accounting (:mod:`gradstep.step.loop`): item counts and
auxiliary terms, for every way a user can give them.

- A count mismatch (``step(..., count=fn)`` says one thing, ``LossSum.count`` another) is
  an error, whatever the two are: ints, or 0-dim integer tensors of any integer dtype,
  on the lean path (one process, no hook inside the window) and on the full one; the
  error says on how many micro-batches, and the step leaves no trace. Without a
  mismatch the step's item count and loss are those of the float64 reference.
- Auxiliary terms present on some micro-batches only are an error, never a silent mean
  over fewer micro-batches.
- The window's aux mean is the float64 mean over its micro-batches (empty ones
  included), and the update is the float64 gradient of ``sum(total)/sum(count) +
  mean(aux)``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from gradstep import LossSum, Stepper

D = 3
INT_DTYPES = [torch.int64, torch.int32, torch.int16, torch.uint8]
EXACT = 1e-12


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(D, 1).double()


def _window(rows: list[int], kept: list[int], seed: int) -> list[dict[str, torch.Tensor]]:
    """Micro-batches of ``rows[i]`` rows, of which the first ``kept[i]`` carry a loss."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n, k in zip(rows, kept, strict=True):
        mask = torch.arange(n) < k
        x = torch.randn(n, D, generator=gen, dtype=torch.float64)
        out.append({"x": x, "y": torch.randn(n, 1, generator=gen, dtype=torch.float64), "m": mask})
    return out


def _items(mb: dict[str, torch.Tensor]) -> int:
    return int(mb["m"].sum())


def _as(value: int, kind: Any) -> Any:
    """``value`` as an int, or as a 0-dim tensor of the integer dtype ``kind``."""
    return value if kind is int else torch.tensor(value, dtype=kind)


def _total(model: nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    err = (model(mb["x"]) - mb["y"]).squeeze(1)
    return 0.5 * (err.square() * mb["m"]).sum()


def _untouched(model: nn.Module, stepper: Stepper) -> None:
    fresh = _model()
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b) and a.grad is None
    assert stepper.step_count == 0 and stepper.skipped_steps == 0


class _Observer:
    """A hook inside the window: forces the Stepper's full (not lean) path."""

    def on_micro_batch_end(self, stepper: Any, index: int, is_last: bool, loss: Any) -> None:
        pass


COUNT_KINDS = st.sampled_from([int, *INT_DTYPES])


@given(
    kept=st.lists(st.integers(0, 4), min_size=1, max_size=4),
    fn_kind=COUNT_KINDS,
    loss_kinds=st.lists(st.sampled_from([int, *INT_DTYPES, None]), min_size=4, max_size=4),
    wrong=st.lists(st.integers(-3, 3), min_size=4, max_size=4),
    lean=st.booleans(),
)
def test_a_count_mismatch_is_an_error_for_every_kind_of_count(
    kept, fn_kind, loss_kinds, wrong, lean
):
    """``wrong[i]`` is added to what ``count`` says of micro-batch i (kept >= 0): any
    non-zero entry is a mismatch, unless that micro-batch's ``LossSum.count`` is None
    (then count= is the only count there is). ``loss_kinds[i]``: how micro-batch i's
    ``LossSum.count`` is given (all ints: the host path; tensors, mixed, None)."""
    rows = [k + 1 for k in kept]
    window = _window(rows, kept, seed=len(kept))
    said = [max(0, _items(mb) + w) for mb, w in zip(window, wrong, strict=False)]
    told = dict(zip(map(id, window), said, strict=True))

    def count(mb: dict) -> Any:
        return _as(told[id(mb)], fn_kind)

    kinds = dict(zip(map(id, window), loss_kinds, strict=False))

    def loss_fn(model: nn.Module, mb: dict) -> LossSum:
        kind = kinds[id(mb)]
        return LossSum(_total(model, mb), None if kind is None else _as(_items(mb), kind))

    model = _model()
    hooks = None if lean else [_Observer()]
    stepper = Stepper(model, torch.optim.SGD(model.parameters(), lr=0.1), clip=None, hooks=hooks)
    mismatched = sum(
        s != _items(mb) and kinds[id(mb)] is not None for s, mb in zip(said, window, strict=True)
    )
    if mismatched:
        match = rf"differs from count\(micro_batch\) on {mismatched} "
        with pytest.raises(ValueError, match=match):
            stepper.step(window, loss_fn, count=count)
        _untouched(model, stepper)
        return
    stats = stepper.step(window, loss_fn, count=count)
    # No mismatch: where LossSum.count is given it equals count=; where None, count= rules.
    items = sum(said)
    assert stats.items == items
    if items == 0:
        assert stats.skipped and math.isnan(stats.loss)
    else:
        with torch.no_grad():
            total = sum(float(_total(_model(), mb)) for mb in window)
        assert stats.loss == pytest.approx(total / items, rel=EXACT)


@pytest.mark.parametrize("kind", [int, *INT_DTYPES], ids=str)
@pytest.mark.parametrize("lean", [True, False], ids=["lean", "full"])
def test_a_single_wrong_count_is_found_on_either_path(kind, lean):
    """The smallest mismatch (one item, on the last micro-batch) with each count type."""
    window = _window([3, 2, 4], [3, 1, 4], seed=1)

    def loss_fn(model: nn.Module, mb: dict) -> LossSum:
        return LossSum(_total(model, mb), _as(_items(mb), kind))

    model = _model()
    hooks = None if lean else [_Observer()]
    stepper = Stepper(model, torch.optim.SGD(model.parameters(), lr=0.1), clip=None, hooks=hooks)
    last = id(window[-1])
    with pytest.raises(ValueError, match=r"differs from count\(micro_batch\) on 1 micro-batch"):
        stepper.step(window, loss_fn, count=lambda mb: _items(mb) - (id(mb) == last))
    _untouched(model, stepper)


def test_count_must_return_an_integer_not_a_bool_or_a_float():
    window = _window([2], [2], seed=0)
    model = _model()
    stepper = Stepper(model, torch.optim.SGD(model.parameters(), lr=0.1), clip=None)

    def loss_fn(model: nn.Module, mb: dict) -> LossSum:
        return LossSum(_total(model, mb), _items(mb))

    for bad in (True, torch.tensor(True), 2.0, torch.tensor(2.0), torch.tensor([2]), "2"):
        with pytest.raises(ValueError, match=r"count: fn\(micro_batch\) must return an int >= 0"):
            stepper.step(window, loss_fn, count=lambda mb, bad=bad: bad)
    _untouched(model, stepper)


# ------------------------------------------------------------ auxiliary terms


def _aux_loss(present: list[bool], names: tuple[str, ...] = ("router",)):
    """A loss whose micro-batch i carries the aux terms ``names`` when ``present[i]``."""
    calls = []

    def loss_fn(model: nn.Module, mb: dict) -> LossSum:
        i = len(calls)
        calls.append(i)
        total = _total(model, mb)
        aux = {n: 0.1 * model.weight.square().sum() * (j + 1) for j, n in enumerate(names)}
        return LossSum(total, _items(mb), aux=aux if present[i] else {})

    return loss_fn


@given(
    present=st.lists(st.booleans(), min_size=2, max_size=4).filter(lambda p: any(p) and not all(p)),
    lean=st.booleans(),
)
def test_aux_terms_on_some_micro_batches_only_are_an_error(present, lean):
    window = _window([2] * len(present), [2] * len(present), seed=3)
    model = _model()
    hooks = None if lean else [_Observer()]
    stepper = Stepper(model, torch.optim.SGD(model.parameters(), lr=0.1), clip=None, hooks=hooks)
    with pytest.raises(ValueError, match="LossSum.aux names must be the same in every micro-batch"):
        stepper.step(window, _aux_loss(present), count=_items)
    _untouched(model, stepper)


def test_aux_terms_with_other_names_on_one_micro_batch_are_an_error():
    window = _window([2, 2, 2], [2, 2, 2], seed=3)
    calls = []

    def loss_fn(model: nn.Module, mb: dict) -> LossSum:
        calls.append(1)
        names = ("router", "z") if len(calls) == 2 else ("router",)
        return _aux_loss([True], names)(model, mb)

    model = _model()
    stepper = Stepper(model, torch.optim.SGD(model.parameters(), lr=0.1), clip=None)
    match = r"\['router'\] before, \['router', 'z'\] in micro-batch 1"
    with pytest.raises(ValueError, match=match):
        stepper.step(window, loss_fn, count=_items)
    _untouched(model, stepper)


def _aux_value(model: nn.Module, mb: dict, coef: float) -> torch.Tensor:
    """A per-micro-batch term that depends on the micro-batch (not on its item count)."""
    return coef * torch.tanh(model(mb["x"])).mean()


@given(
    kept=st.lists(st.integers(0, 3), min_size=1, max_size=5).filter(any),
    coef=st.floats(0.01, 10.0),
    lean=st.booleans(),
)
def test_the_aux_mean_and_its_gradient_are_the_float64_ones(kept, coef, lean):
    """Micro-batches with 0 items included: mean(aux) is over micro-batches, the loss over
    items; SGD(lr=1), so the update is the gradient itself."""
    window = _window([k + 1 for k in kept], kept, seed=sum(kept))

    def loss_fn(model: nn.Module, mb: dict) -> LossSum:
        aux = {"a": _aux_value(model, mb, coef), "b": _aux_value(model, mb, -coef / 3)}
        return LossSum(_total(model, mb), _items(mb), aux=aux)

    ref = _model()
    items = sum(_items(mb) for mb in window)
    aux_a = torch.stack([_aux_value(ref, mb, coef) for mb in window]).mean()
    aux_b = torch.stack([_aux_value(ref, mb, -coef / 3) for mb in window]).mean()
    objective = sum(_total(ref, mb) for mb in window) / items + aux_a + aux_b
    objective.backward()

    model = _model()
    hooks = None if lean else [_Observer()]
    stepper = Stepper(model, torch.optim.SGD(model.parameters(), lr=1.0), clip=None, hooks=hooks)
    stats = stepper.step(window, loss_fn, count=_items)
    assert stats.aux["a"] == pytest.approx(aux_a.item(), rel=EXACT)
    assert stats.aux["b"] == pytest.approx(aux_b.item(), rel=EXACT)
    assert stats.items == items and stats.micro_batches == len(window)
    init = _model().state_dict()
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(init[name] - p.detach(), r.grad, rtol=EXACT, atol=EXACT)


# ------------------------------------------------------------ 2 gloo ranks, one start

RANK_CASES = ("names", "missing", "mixed", "count_rank1")


def _rank_loss(rank: int, case: str, coef: float = 0.5):
    calls = []

    def loss_fn(model: nn.Module, mb: dict) -> LossSum:
        calls.append(1)
        names = ["balance"] if case == "names" and rank == 1 else ["router"]
        if (case, rank) == ("missing", 1) or (case, rank, len(calls)) == ("mixed", 0, 2):
            names = []
        aux = {n: _aux_value(model, mb, coef) for n in names}
        return LossSum(_total(model, mb), torch.tensor(_items(mb)), aux=aux)

    return loss_fn


def _rank_windows() -> list[list[dict]]:
    """Rank r's window: 2 micro-batches; rank 1's hold more items (one holds none)."""
    return [_window([2, 3], [2, 1], seed=20), _window([4, 1], [4, 0], seed=21)]


def _ranks(rank: int, world: int) -> dict[str, Any]:
    """Each bad case on a DDP Stepper, then a good window on the same Stepper: every rank
    raises together (no rank is left waiting in a collective) and nothing is left behind."""
    import gradstep.parallel as gd

    model = gd.prepare_model(_model(), "ddp")
    stepper = Stepper(model, torch.optim.SGD(model.parameters(), lr=1.0), clip=None)
    window = _rank_windows()[rank]
    out: dict[str, Any] = {}
    for case in RANK_CASES:
        count = _items
        if case == "count_rank1":
            count = lambda mb: _items(mb) + rank  # noqa: E731
        try:
            stepper.step(window, _rank_loss(rank, case), count=count)
            out[case] = "no error"
        except ValueError as exc:
            out[case] = str(exc)
    before = [p.detach().clone() for p in model.parameters()]
    out["untouched"] = all(
        torch.equal(a, b) for a, b in zip(before, _model().parameters(), strict=True)
    )
    stats = stepper.step(window, _rank_loss(rank, "good"), count=_items)
    out["aux"] = stats.aux["router"]
    out["update"] = [b - p.detach() for b, p in zip(before, model.parameters(), strict=True)]
    return out


@pytest.mark.distributed
def test_two_ranks_agree_on_aux_names_and_take_the_mean_over_every_micro_batch():
    from tests.support.multiproc import run_ranks

    results = run_ranks(_ranks, 2, timeout=120, collective_timeout_s=30)
    for rank, res in enumerate(results):
        assert "must be the same on every rank" in res["names"], res["names"]
        assert "must be the same on every rank" in res["missing"], res["missing"]
        if rank == 0:
            assert "['router'] before, [] in micro-batch 1" in res["mixed"], res["mixed"]
        else:
            assert "differ between the micro-batches of another rank" in res["mixed"]
        assert "differs from count(micro_batch) on 2 micro-batch" in res["count_rank1"]
        assert res["untouched"]
    # The good window: the float64 objective over both ranks' micro-batches.
    ref = _model()
    mbs = [mb for w in _rank_windows() for mb in w]
    aux = torch.stack([_aux_value(ref, mb, 0.5) for mb in mbs]).mean()
    items = sum(_items(mb) for mb in mbs)
    (sum(_total(ref, mb) for mb in mbs) / items + aux).backward()
    for res in results:
        assert res["aux"] == pytest.approx(aux.item(), rel=EXACT)
        for got, p in zip(res["update"], ref.parameters(), strict=True):
            torch.testing.assert_close(got, p.grad, rtol=EXACT, atol=EXACT)


@given(sizes=st.lists(st.integers(1, 4), min_size=1, max_size=6))
def test_named_slots_read_back_what_each_part_put_in(sizes: list[int]) -> None:
    """The window's reduced vector is read by name: each slot returns exactly its part
    (a number for a one-entry part, a list otherwise), whatever the parts' sizes."""
    from gradstep.step.tally import Slots

    parts = {f"p{i}": torch.arange(n, dtype=torch.float64) + 10 * i for i, n in enumerate(sizes)}
    got = Slots.of(parts).read(torch.cat(list(parts.values())).tolist())
    assert list(got) == list(parts)
    for name, part in parts.items():
        want = part.tolist()
        assert got[name] == (want[0] if len(want) == 1 else want)
