"""Properties of :mod:`gradstep.optim` that hold for every input, not for a few examples.

- ``param_groups``: every trainable parameter is in exactly one group (0-dim, 1-dim and
  n-dim parameters, embeddings, tied weights), frozen ones in none; the decay group holds
  exactly the weights with >= 2 dimensions not named in ``no_decay`` (under any of their
  names); torch's optimizers and LAMB/LARS accept the groups.
- LAMB's ``max_grad_norm``: at or above the global gradient norm it changes nothing
  (bitwise the same as ``None``); below it, the step equals LAMB without it on the
  gradient clipped first (float64).
- Argument errors name the optimizer and the rule (L24: a finite number; L26: no
  parameter at all).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from gradstep.optim import LAMB, LARS, param_groups

# ------------------------------------------------------------ param_groups

LEAVES = ("linear", "linear_nobias", "embedding", "layernorm", "conv", "scalar", "vector",
          "matrix", "cube")  # fmt: skip
SHAPES = {"scalar": (), "vector": (3,), "matrix": (2, 3), "cube": (2, 2, 2)}


def _leaf(kind: str) -> nn.Module | nn.Parameter:
    if kind in SHAPES:
        return nn.Parameter(torch.randn(SHAPES[kind]))
    return {
        "linear": lambda: nn.Linear(3, 2),
        "linear_nobias": lambda: nn.Linear(3, 2, bias=False),
        "embedding": lambda: nn.Embedding(4, 3),
        "layernorm": lambda: nn.LayerNorm(3),
        "conv": lambda: nn.Conv1d(2, 3, 2),
    }[kind]()


@st.composite
def module_trees(draw: Any, depth: int = 0) -> nn.Module:
    """A module of up to 3 children, each a leaf layer, a raw parameter or a subtree."""
    module = nn.Module()
    kinds = LEAVES + (("node",) if depth < 2 else ())
    for i in range(draw(st.integers(1 if depth == 0 else 0, 3))):
        kind = draw(st.sampled_from(kinds))
        child = draw(module_trees(depth + 1)) if kind == "node" else _leaf(kind)
        if isinstance(child, nn.Parameter):
            module.register_parameter(f"p{i}", child)
        else:
            module.add_module(f"m{i}", child)
    return module


def _slots(model: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """(owner module, attribute, full name) of every parameter slot, tied ones included."""
    out = []
    for prefix, mod in model.named_modules(remove_duplicate=False):
        for attr, _ in mod.named_parameters(recurse=False, remove_duplicate=False):
            out.append((mod, attr, f"{prefix}.{attr}" if prefix else attr))
    return out


@st.composite
def models(draw: Any) -> tuple[nn.Module, list[str]]:
    """A random tree with some slots tied to another slot of the same shape, some
    parameters frozen, and some names (any alias) in no_decay."""
    model = draw(module_trees())
    slots = _slots(model)
    for i, j in draw(st.lists(st.tuples(st.integers(0, 99), st.integers(0, 99)), max_size=3)):
        (mi, ai, _), (mj, aj, _) = slots[i % len(slots)], slots[j % len(slots)]
        src = getattr(mi, ai)
        if getattr(mj, aj).shape == src.shape:
            setattr(mj, aj, src)  # tie slot j to slot i's parameter
    for p, frozen in zip(model.parameters(), draw(st.lists(st.booleans(), min_size=40)),
                         strict=False):  # fmt: skip
        p.requires_grad_(not frozen)
    names = [n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]
    no_decay = draw(st.lists(st.sampled_from(names), unique=True)) if names else []
    return model, no_decay


def _zoo() -> nn.Module:
    """One of every leaf, a tied pair and a frozen layer: the cases a small random draw
    can miss."""
    model = nn.Module()
    for kind in LEAVES:
        leaf = _leaf(kind)
        if isinstance(leaf, nn.Parameter):
            model.register_parameter(kind, leaf)
        else:
            model.add_module(kind, leaf)
    model.add_module("tied", nn.Linear(3, 4, bias=False))
    model.tied.weight = model.embedding.weight
    model.add_module("frozen", nn.Linear(3, 3).requires_grad_(False))
    return model


@pytest.mark.parametrize(
    "no_decay", [[], ["vector", "matrix", "tied.weight"], ["scalar", "linear.weight"]]
)
def test_every_trainable_parameter_of_the_zoo_is_in_exactly_one_group(no_decay):
    _check_groups(_zoo(), no_decay, 0.1)


@settings(max_examples=60)  # cheap examples: a wider draw of trees
@given(case=models(), wd=st.floats(0.0, 1.0))
def test_every_trainable_parameter_is_in_exactly_one_group(case, wd):
    _check_groups(*case, wd)


def _check_groups(model: nn.Module, no_decay: list[str], wd: float) -> None:
    groups = param_groups(model, weight_decay=wd, no_decay=no_decay)
    trainable = {id(p): p for p in model.parameters() if p.requires_grad}
    listed = [id(p) for g in groups for p in g["params"]]
    assert sorted(listed) == sorted(trainable)  # each once: no duplicate, none missing
    excluded = {id(p) for n, p in model.named_parameters(remove_duplicate=False)
                if n in no_decay}  # fmt: skip
    want_decay = {i for i, p in trainable.items() if p.ndim >= 2 and i not in excluded}
    by_decay = {g["weight_decay"] == 0.0 and "always_adapt" in g: g for g in groups}
    assert all(g["params"] for g in groups)  # an empty group is dropped
    if want_decay:
        decay = by_decay[False]
        assert {id(p) for p in decay["params"]} == want_decay
        assert decay.keys() == {"params", "weight_decay"} and decay["weight_decay"] == wd
    if len(want_decay) < len(trainable):
        rest = by_decay[True]
        assert {id(p) for p in rest["params"]} == set(trainable) - want_decay
        assert rest["weight_decay"] == 0.0 and rest["always_adapt"] is False
    if trainable:
        for make in (LAMB, LARS, torch.optim.AdamW):
            make(groups)  # torch refuses a parameter in two groups
    else:
        assert groups == []


def test_a_no_decay_name_of_a_tied_weight_reaches_it():
    """named_parameters() lists a tied output layer once, under the embedding's name; its
    own name is still a name of the model's parameter."""
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    groups = param_groups(model, weight_decay=0.1, no_decay=["1.weight"])
    assert groups == [{"params": [model[0].weight], "weight_decay": 0.0, "always_adapt": False}]
    with pytest.raises(ValueError, match=r"no_decay names \['2.weight'\] are not trainable"):
        param_groups(model, weight_decay=0.1, no_decay=["2.weight"])


# ------------------------------------------------------------ LAMB's max_grad_norm

SHAPES_LAMB = [(4, 3), (3,), (2, 4), ()]
CONFIGS = st.fixed_dictionaries(
    {
        "weight_decay": st.sampled_from([0.0, 0.01]),
        "trust_clip": st.booleans(),
        "always_adapt": st.booleans(),
        "decoupled_decay": st.booleans(),
        "caution": st.booleans(),
        "bias_correction": st.booleans(),
        "grad_averaging": st.booleans(),
    }
)


def _lamb_params(dtype: torch.dtype) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(4)
    return [nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64).to(dtype))
            for s in SHAPES_LAMB]  # fmt: skip


def _grads(steps: int, scale: float, dtype: torch.dtype) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(int(scale * 1000) % 97)
    return [
        [
            (scale * (1 + t)) * torch.randn(s, generator=gen, dtype=torch.float64).to(dtype)
            for s in SHAPES_LAMB
        ]  # fmt: skip
        for t in range(steps)
    ]


def _global_norm(grads: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(g.double().square().sum()) for g in grads))


def _run_lamb(grads: list[list[torch.Tensor]], dtype: torch.dtype, **kw: Any) -> list:
    params = _lamb_params(dtype)
    # Matrices decay, vectors and the scalar not: param_groups' layout.
    opt = LAMB([{"params": params[::2]}, {"params": params[1::2], "weight_decay": 0.0}],
               lr=0.05, **kw)  # fmt: skip
    for step in grads:
        for p, g in zip(params, step, strict=True):
            p.grad = None if g is None else g.clone()
        opt.step()
    return [p.detach().clone() for p in params]


@given(
    config=CONFIGS,
    scale=st.floats(1e-3, 1e3),
    margin=st.floats(1e-4, 10.0),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_max_grad_norm_above_the_norm_changes_nothing(config, scale, margin, dtype):
    grads = _grads(3, scale, dtype)
    above = max(_global_norm(step) for step in grads) * (1 + margin)
    want = _run_lamb(grads, dtype, **config)
    got = _run_lamb(grads, dtype, max_grad_norm=above, **config)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@given(config=CONFIGS, scale=st.floats(1e-2, 1e2), fraction=st.floats(0.01, 0.99))
def test_max_grad_norm_below_the_norm_is_the_gradient_clipped_first(config, scale, fraction):
    grads = _grads(3, scale, torch.float64)
    below = min(_global_norm(step) for step in grads) * fraction
    clipped = [[g * (below / _global_norm(step)) for g in step] for step in grads]
    want = _run_lamb(clipped, torch.float64, **config)
    got = _run_lamb(grads, torch.float64, max_grad_norm=below, **config)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_max_grad_norm_counts_only_parameters_with_a_gradient():
    """A parameter without a gradient (unused this step) is not in the global norm."""
    grads = _grads(1, 1.0, torch.float64)
    grads[0][1] = None
    below = 0.5 * _global_norm([g for g in grads[0] if g is not None])
    clipped = [[None if g is None else g * 0.5 for g in grads[0]]]
    want = _run_lamb(clipped, torch.float64)
    got = _run_lamb(grads, torch.float64, max_grad_norm=below)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_max_grad_norm_is_the_optimizers_not_a_groups():
    p, q = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="LAMB: max_grad_norm clips one global norm"):
        LAMB([{"params": [p]}, {"params": [q], "max_grad_norm": 1.0}])
    LAMB([{"params": [p]}, {"params": [q], "max_grad_norm": 1.0}], max_grad_norm=1.0)


# ------------------------------------------------------------ argument messages


@pytest.mark.parametrize("owner", [LAMB, LARS], ids=["LAMB", "LARS"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, -1.0, True, "0.1", None])
def test_lr_must_be_a_finite_number(owner, value):
    name = owner.__name__
    with pytest.raises((TypeError, ValueError), match=rf"{name}: lr must be a finite number >= 0"):
        owner([nn.Parameter(torch.ones(1))], lr=value)


@pytest.mark.parametrize("owner", [LAMB, LARS], ids=["LAMB", "LARS"])
@pytest.mark.parametrize(
    "params",
    [[], (), iter([]), [{"params": []}], [{"params": []}, {"params": ()}]],
    ids=["list", "tuple", "iterator", "empty_group", "empty_groups"],
)
def test_no_parameter_at_all_is_a_gradstep_message(owner, params):
    name = owner.__name__
    with pytest.raises(ValueError, match=rf"{name}: params holds no parameter"):
        owner(params)


def test_frozen_models_groups_are_refused_by_name():
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="LAMB: params holds no parameter.*all frozen"):
        LAMB(param_groups(frozen, weight_decay=0.1))
    with pytest.raises(TypeError, match="LARS: params must be an iterable"):
        LARS(torch.ones(2, requires_grad=True))


def test_max_grad_norm_must_be_a_finite_positive_number_or_none():
    for bad in (0.0, -1.0, math.inf, math.nan, "1"):
        with pytest.raises(ValueError, match="LAMB: max_grad_norm must be a finite number > 0"):
            LAMB([nn.Parameter(torch.ones(1))], max_grad_norm=bad)
