"""Checkpoints of ``torch.compile``d modules (README: the model may be "plain, DDP, FSDP2 or
compiled"; optimizer state survives re-wrapping): the compiled wrapper's ``_orig_mod.``
prefix never reaches the checkpoint, so a compiled run resumes into a plain model and
back, with the optimizer built on either module's parameters. Compiled with the ``eager``
backend: dynamo traces the module, nothing is code-generated (fast, no compiler needed).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

from gradstep.checkpoint import Checkpointer
from tests.support.asserts import assert_bitwise_equal


def _compile(module: nn.Module) -> nn.Module:
    dynamo = pytest.importorskip("torch._dynamo", reason="this torch build has no dynamo")
    if not hasattr(torch, "compile") or not dynamo.is_dynamo_supported():
        pytest.skip("torch.compile is not supported on this Python / torch build")
    return torch.compile(module, backend="eager")


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _optimizer(model: nn.Module) -> torch.optim.AdamW:
    """Two groups like ``gradstep train``'s; built on ``model.parameters()`` as given."""
    params = list(model.parameters())
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=1e-2,
    )


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(6, 4, generator=gen)
        optimizer.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        optimizer.step()


def _state(plain: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Parameters by their plain names, and the optimizer's whole state, cloned."""
    return {
        "params": {k: v.detach().clone() for k, v in plain.state_dict().items()},
        "optim": {
            "state": {
                i: {k: v.clone() for k, v in s.items()}
                for i, s in optimizer.state_dict()["state"].items()
            },
            "param_groups": optimizer.state_dict()["param_groups"],
        },
    }


@pytest.mark.parametrize("direction", ["compiled to plain", "plain to compiled"])
def test_compiled_and_plain_models_load_each_others_checkpoints(
    tmp_path: Path, direction: str
) -> None:
    """3 steps, save; load into the other kind (fresh weights, fresh optimizer): parameters
    and optimizer state bitwise equal; then 2 more steps on both stay bitwise equal (the
    loaded optimizer state is attached to the right parameters)."""
    src_plain = _model(0)
    src = _compile(src_plain) if direction == "compiled to plain" else src_plain
    src_optim = _optimizer(src)  # on the compiled module's parameters when compiled
    _train(src, src_optim, 3, seed=1)
    path = Checkpointer(tmp_path).save(3, model=src, optimizer=src_optim)
    saved_keys = set(safetensors.torch.load_file(path / "model.safetensors"))
    assert saved_keys == set(src_plain.state_dict()), saved_keys  # no "_orig_mod." prefix

    dst_plain = _model(5)
    dst = dst_plain if direction == "compiled to plain" else _compile(dst_plain)
    dst_optim = _optimizer(dst)
    assert Checkpointer(tmp_path).load_latest(model=dst, optimizer=dst_optim) == 3
    assert_bitwise_equal(_state(dst_plain, dst_optim), _state(src_plain, src_optim))

    _train(src, src_optim, 2, seed=2)
    _train(dst, dst_optim, 2, seed=2)
    assert_bitwise_equal(_state(dst_plain, dst_optim), _state(src_plain, src_optim))


def test_optimizer_state_follows_parameter_names_not_positions(tmp_path: Path) -> None:
    """An optimizer that lists its parameters in another order gets each parameter's own
    state (the checkpoint keys optimizer state by parameter name)."""
    model = _model(0)
    optimizer = _optimizer(model)
    _train(model, optimizer, 3, seed=1)
    Checkpointer(tmp_path).save(3, model=model, optimizer=optimizer)

    other = _model(5)
    groups = _optimizer(other).param_groups
    reordered = torch.optim.AdamW(
        [{**g, "params": list(reversed(g["params"]))} for g in groups], lr=1e-2
    )
    assert Checkpointer(tmp_path).load_latest(model=other, optimizer=reordered) == 3
    names = {id(p): n for n, p in other.named_parameters()}
    saved_names = {id(p): n for n, p in model.named_parameters()}
    got = {names[id(p)]: s for p, s in reordered.state.items()}
    want = {saved_names[id(p)]: s for p, s in optimizer.state.items()}
    assert_bitwise_equal(got, want)
