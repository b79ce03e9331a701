"""The run in the memory model's terms (gradstep_cli.plan.estimate): the shape of the model the
run builds and the memory of its optimizer."""

from __future__ import annotations

import dataclasses

import pytest
import torch


def _fixed_cfg(budget: str | None, mbs: int = 4):
    from gradstep_cli.config.settings import TrainConfig

    return TrainConfig(
        n_layer=1, n_head=2, d_model=16, seq_len=16, micro_batch_size=mbs,
        global_batch=8, memory_budget=budget,
    )  # fmt: skip


def test_the_planners_shape_is_the_model_the_run_builds():
    """``estimate.shape_of`` (the one mapping of a run's flags to the analytic model's
    shape) counts exactly the parameters ``build_model`` makes, for any demo GPT shape."""
    from gradstep_cli.config.settings import TrainConfig
    from gradstep_cli.models.gpt import GPT, GPTConfig
    from gradstep_cli.models.hf import build_model
    from gradstep_cli.plan.estimate import gpt_shape, shape_of

    for layers, heads, width in [(4, 4, 160), (1, 2, 16), (3, 6, 96)]:
        cfg = TrainConfig(n_layer=layers, n_head=heads, d_model=width, seq_len=24)
        shape = shape_of(cfg)
        assert shape.params == build_model(cfg).num_parameters(), (layers, heads, width)
        assert (shape.n_layer, shape.d_model, shape.seq_len) == (layers, width, 24)
        assert shape_of(cfg, width=7).seq_len == 7
    assert gpt_shape(GPTConfig()).params == GPT(GPTConfig()).num_parameters()


@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "lars", "lamb"])
def test_the_planner_estimates_the_runs_optimizer(optimizer):
    """The analytic model counts the state the run's ``--optimizer`` really keeps: one real
    step of ``build_optimizer`` on the run's model, its state tensors counted."""
    from gradstep.memory import estimate_step_memory
    from gradstep_cli.models.hf import build_model
    from gradstep_cli.plan.estimate import estimate_kwargs, shape_of
    from gradstep_cli.train import build_optimizer

    cfg = dataclasses.replace(_fixed_cfg(None), optimizer=optimizer)
    model = build_model(cfg)
    opt = build_optimizer(model, cfg)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    state_bytes = sum(
        t.numel() * t.element_size()
        for p in model.parameters()
        for t in opt.state[p].values()
        if torch.is_tensor(t) and t.shape == p.shape
    )
    kwargs = estimate_kwargs(cfg, torch.device("cpu"), 1)
    est = estimate_step_memory(shape_of(cfg), 1, **kwargs)
    assert est.optimizer == state_bytes > 0


def test_packed_rows_are_estimated_with_their_mask():
    """``--packing``: the analytic model is told (each layer keeps the block-causal mask), so
    a packed run's estimate is above the same run's unpacked one."""
    from gradstep.memory import estimate_step_memory
    from gradstep_cli.plan.estimate import estimate_kwargs, shape_of

    cfg = _fixed_cfg("1GiB")
    totals = {}
    for packing in (False, True):
        kwargs = estimate_kwargs(dataclasses.replace(cfg, packing=packing), torch.device("cpu"), 1)
        assert kwargs["packed"] is packing
        totals[packing] = estimate_step_memory(shape_of(cfg), 4, **kwargs).total
    assert totals[True] > totals[False]
