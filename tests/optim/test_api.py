"""gradstep.optim's API: parameter groups, argument errors, single-process checkpoints,
and the demo's --optimizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import gradstep
from gradstep import Checkpointer
from gradstep.optim import LAMB, LARS, param_groups
from gradstep_cli.cli import main
from tests.optim import optimizer_ranks as ranks


def test_param_groups_split_weights_from_biases_and_gains() -> None:
    model = ranks.Net()
    groups = param_groups(model, weight_decay=0.05, no_decay=["b.weight"])
    decay, rest = groups
    assert decay == {"params": [model.a.weight], "weight_decay": 0.05}
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in rest["params"]) == sorted(
        ["gain", "a.bias", "norm.weight", "norm.bias", "b.weight", "b.bias"]
    )
    assert rest["weight_decay"] == 0.0 and rest["always_adapt"] is False
    assert gradstep.optim is not None and "optim" in gradstep.__all__


def test_param_groups_leave_out_frozen_and_empty_groups() -> None:
    model = nn.Linear(3, 2, bias=False)
    assert param_groups(model, weight_decay=0.1) == [
        {"params": [model.weight], "weight_decay": 0.1}
    ]
    model.weight.requires_grad_(False)
    assert param_groups(model, weight_decay=0.1) == []


def test_the_no_decay_group_is_not_adapted_even_with_always_adapt() -> None:
    """A bias in the no-decay group takes the plain SGD step, whatever always_adapt says."""
    model = nn.Linear(4, 3)
    opt = LARS(param_groups(model, weight_decay=0.1), lr=0.5, always_adapt=True)
    before = model.bias.detach().clone()
    model.weight.grad, model.bias.grad = torch.ones(3, 4), torch.ones(3)
    opt.step()
    torch.testing.assert_close(model.bias.detach(), before - 0.5)


@pytest.mark.parametrize(
    "make,name",
    [
        (lambda ps: LARS(ps, lr=-1.0), "LARS: lr"),
        (lambda ps: LARS(ps, momentum=-0.1), "LARS: momentum"),
        (lambda ps: LARS(ps, weight_decay=float("nan")), "LARS: weight_decay"),
        (lambda ps: LARS(ps, dampening=2.0), "LARS: dampening"),
        (lambda ps: LARS(ps, nesterov=True), "LARS: nesterov"),
        (lambda ps: LARS(ps, trust_coeff=-1.0), "LARS: trust_coeff"),
        (lambda ps: LARS([{"params": ps, "eps": -1.0}]), "LARS: eps"),
        (lambda ps: LAMB(ps, betas=(0.9, 1.0)), "LAMB: betas[1]"),
        (lambda ps: LAMB(ps, betas=0.9), "LAMB: betas"),
        (lambda ps: LAMB(ps, eps=-1e-6), "LAMB: eps"),
        (lambda ps: LAMB(ps, max_grad_norm=0.0), "LAMB: max_grad_norm"),
        (lambda ps: LAMB(ps, trust_clip="yes"), "LAMB: trust_clip"),
        (
            lambda ps: LAMB(ps, lr=0.0, decoupled_decay=True, corrected_weight_decay=True),
            "LAMB: corrected_weight_decay",
        ),  # fmt: skip
        (lambda ps: param_groups(nn.Linear(2, 2), weight_decay=-1), "param_groups: weight_decay"),
        (lambda ps: param_groups(nn.Linear(2, 2), weight_decay=0.1, no_decay=["bais"]), "bais"),
    ],
)
def test_argument_errors_name_the_parameter(make, name: str) -> None:
    params = [nn.Parameter(torch.ones(2))]
    with pytest.raises((ValueError, TypeError), match=name.replace("[", r"\[")):
        make(params)


def test_lamb_does_not_clip_inside_by_default() -> None:
    assert LAMB([nn.Parameter(torch.ones(2))]).defaults["max_grad_norm"] is None


@pytest.mark.parametrize("kind", ["lars", "lamb"])
def test_checkpoint_resume_is_bitwise_on_one_process(kind: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    base = ranks.Net()
    straight = ranks.stepper_for(_copy(base), kind)
    ranks.run(straight, range(6))
    first = ranks.stepper_for(_copy(base), kind)
    ranks.run(first, range(3))
    Checkpointer(tmp_path).save(3, model=first.model, optimizer=first.optimizer, stepper=first)
    second = ranks.stepper_for(ranks.Net(), kind)  # other initial weights
    Checkpointer(tmp_path).load_latest(model=second.model, optimizer=second.optimizer,
                                       stepper=second)  # fmt: skip
    assert (
        second.optimizer.state_dict()["state"].keys()
        == first.optimizer.state_dict()["state"].keys()
    )
    ranks.run(second, range(3, 6))
    for a, b in zip(straight.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(a, b)


def _copy(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)


def test_demo_rejects_an_unknown_optimizer(capsys: pytest.CaptureFixture[str]) -> None:
    from gradstep_cli.config.settings import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match="optimizer must be one of adamw, sgd, lars, lamb"):
        TrainConfig(optimizer="adam")
    with pytest.raises(SystemExit):
        main(["train", "--optimizer", "adam"])
    assert "--optimizer" in capsys.readouterr().err
