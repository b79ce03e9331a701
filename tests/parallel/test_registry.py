"""One strategy registry for both ends (gradstep/parallel/registry.py): ``strategy_for``
detects a wrapped model with it and ``prepare_model`` builds one by name from it; the
built-ins register like any other layout. ``prepare_model``'s ``layout=`` is checked before
anything is built.

The invariant every registered name must hold: what ``prepare_model(model, name)`` returns,
``strategy_for`` detects as the strategy called ``name``. Checked for the built-ins on a
real one-process gloo group, and for a strategy registered by a test.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradstep.parallel as gd
from gradstep.parallel import registry as reg
from gradstep.step.precision import PRECISIONS


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A private copy of the registry: what a test registers does not outlive it."""
    monkeypatch.setattr(reg, "_DETECTORS", list(reg._DETECTORS))
    monkeypatch.setattr(reg, "_PREPARERS", dict(reg._PREPARERS))
    monkeypatch.setattr(reg, "_FALLBACK", list(reg._FALLBACK))


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield
    finally:
        gd.shutdown()


class Marked(nn.Module):
    """A wrapper only the test's strategy recognises."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


class MarkedStrategy:
    name = "marked"

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    @staticmethod
    def detects(model: nn.Module) -> bool:
        return isinstance(model, Marked)


def prepare_marked(model: nn.Module, *, precision: str, blocks_attr: str | None) -> nn.Module:
    return Marked(model)


def test_the_builtins_are_the_registered_names() -> None:
    assert gd.STRATEGIES == ("none", "ddp", "fsdp") == tuple(reg._PREPARERS)
    # prepare_model takes exactly the precisions the Stepper takes (it keeps its own table
    # so that parallel imports nothing of the step).
    assert set(reg._FSDP_PARAM_DTYPES) == set(PRECISIONS)
    assert set(gd.STRATEGIES) <= {cls.name for cls in [*reg._DETECTORS, *reg._FALLBACK]}


def test_what_prepare_model_builds_strategy_for_detects(one_rank: None) -> None:
    for name in gd.STRATEGIES:
        for precision in PRECISIONS:
            torch.manual_seed(0)
            model = nn.Sequential(nn.ModuleList([nn.Linear(4, 4)]), nn.Linear(4, 2))
            wrapped = gd.prepare_model(model, name, precision=precision)
            assert gd.strategy_for(wrapped).name == name, (name, precision)
    assert gd.prepare_model(model, "none") is model


def test_a_registered_strategy_is_built_by_name_and_detected(registry: None) -> None:
    assert gd.register_strategy(MarkedStrategy, prepare=prepare_marked) is MarkedStrategy
    model = nn.Linear(2, 2)
    wrapped = gd.prepare_model(model, "marked", precision="bf16")
    assert isinstance(wrapped, Marked) and wrapped.module is model
    found = gd.strategy_for(wrapped)
    assert isinstance(found, MarkedStrategy) and found.model is wrapped
    assert type(gd.strategy_for(model)).__name__ == "LocalStrategy"  # the fallback
    with pytest.raises(ValueError, match="strategy must be one of none, ddp, fsdp, marked, got"):
        gd.prepare_model(model, "zero")
    detectors = list(reg._DETECTORS)
    with pytest.raises(ValueError, match="'marked' is already registered"):
        gd.register_strategy(type("Again", (MarkedStrategy,), {}), prepare=prepare_marked)
    assert detectors == reg._DETECTORS  # a refused registration leaves nothing behind


def test_register_strategy_keeps_its_detection_only_form(registry: None) -> None:
    """``register_strategy(cls)`` and ``(cls, first=True)`` as before: detection only, no
    new prepare_model name; a class without ``detects`` is refused by name."""

    class Second(MarkedStrategy):
        name = "second"

    gd.register_strategy(MarkedStrategy)
    gd.register_strategy(Second, True)
    assert isinstance(gd.strategy_for(Marked(nn.Linear(2, 2))), Second)  # first wins
    assert tuple(reg._PREPARERS) == gd.STRATEGIES
    with pytest.raises(TypeError, match="needs a detects\\(model\\) staticmethod"):
        gd.register_strategy(type("NoDetects", (), {}))
    with pytest.raises(TypeError, match="needs a name"):
        gd.register_strategy(type("Nameless", (MarkedStrategy,), {"name": ""}), prepare=print)


def test_a_registered_fallback_serves_every_undetected_model(registry: None) -> None:
    class Everything:
        name = "everything"

    gd.register_strategy(Everything, fallback=True)
    assert isinstance(gd.strategy_for(nn.Linear(2, 2)), Everything)


def _plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel

    return {"0": ColwiseParallel()}


@pytest.mark.parametrize(
    ("strategy", "kwargs", "message"),
    [
        ("ddp", {"layout": gd.Layout(tp=2), "tp_plan": _plan()}, "layout=Layout(tp=2) needs "
         "strategy='fsdp' (it shards with FSDP2 on a multi-dimensional mesh), got "
         "strategy='ddp'; pass strategy='fsdp' or no layout"),
        ("none", {"layout": gd.Layout(dp_replicate=2)}, "layout=Layout(dp_replicate=2) needs "
         "strategy='fsdp'"),
        ("fsdp", {"layout": gd.Layout(tp=2)}, "layout=Layout(tp=2) needs tp_plan=: a dict of "
         "module paths"),
        ("fsdp", {"tp_plan": _plan()}, "tp_plan= is used with a layout of tp > 1 only"),
        ("fsdp", {"layout": gd.Layout(tp=2), "tp_plan": ["attn"]}, "tp_plan must be a dict"),
        ("fsdp", {"layout": {"tp": 2}}, "prepare_model: layout must be a "
         "gradstep.parallel.Layout (e.g. Layout(tp=2), Layout(dp_replicate=2)) or None, got dict"),
    ],
)  # fmt: skip
def test_layouts_prepare_model_refuses_name_the_argument(
    strategy: str, kwargs: dict, message: str
) -> None:
    """Refused before anything is built, without a process group: the argument, what it
    needs, what was given."""
    model = nn.Sequential(nn.ModuleList([nn.Linear(4, 4)]), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=re.escape(message)):
        gd.prepare_model(model, strategy, **kwargs)


def test_the_fsdp_only_layout_keywords_are_gone() -> None:
    """``tp=`` and ``hsdp=`` were replaced by ``layout=`` (CHANGELOG, Unreleased)."""
    model = nn.Sequential(nn.ModuleList([nn.Linear(4, 4)]), nn.Linear(4, 2))
    for old in ({"tp": 2}, {"hsdp": 2}):
        with pytest.raises(TypeError, match="unexpected keyword argument"):
            gd.prepare_model(model, "fsdp", **old)


def test_a_layout_the_world_cannot_hold_is_refused_and_plain_fsdp_still_builds(
    one_rank: None,
) -> None:
    """On one rank ``Layout(tp=2)``/``Layout(dp_replicate=2)`` cannot fit: refused naming
    the sizes and the values that can; ``Layout()`` (the default, spelled out) is plain
    FSDP2, and the layout reads back from the model."""
    model = nn.Sequential(nn.ModuleList([nn.Linear(4, 4)]), nn.Linear(4, 2))
    with pytest.raises(
        ValueError, match=re.escape("Layout(tp=2) does not fit 1 ranks: tp=2 must divide")
    ):
        gd.prepare_model(model, "fsdp", layout=gd.Layout(tp=2), tp_plan=_plan())
    with pytest.raises(ValueError, match=re.escape("dp_replicate=2 must divide the number of")):
        gd.prepare_model(model, "fsdp", layout=gd.Layout(dp_replicate=2))
    wrapped = gd.prepare_model(model, "fsdp", layout=gd.Layout())
    assert type(gd.strategy_for(wrapped)).__name__ == "FSDP2Strategy"
    assert gd.Layout.of(wrapped) == gd.Layout(dp_shard=1)
