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


def _hf_spec(lora_targets: str = "", **overrides):
    from gradstep_cli.config.settings import TrainConfig
    from gradstep_cli.models.spec import ModelSpec
    from tests.support.hf_assets import config_for

    lora = dict(lora=4, lora_targets=lora_targets) if lora_targets else {}
    cfg = TrainConfig(model="hf:/nowhere", seq_len=32, **lora)
    return cfg, ModelSpec.of(cfg, config_for("llama", **overrides))


def test_the_loss_is_planned_only_where_its_head_can_be_chunked():
    """Chunked or whole is planned unless a softcap or scale follows the projection or LoRA
    adapts it (the loss then always reads the whole logits: ``gradstep.hf.chunkable``)."""
    from gradstep_cli.plan.estimate import head_chunks, loss_chunks

    cfg, plain = _hf_spec()
    assert head_chunks(plain) and loss_chunks(cfg, plain, frozenset()) == [1024, 0]
    for what in ({"final_logit_softcapping": 30.0}, {"logit_scale": 0.5}):
        cfg, spec = _hf_spec(**what)
        assert not head_chunks(spec) and loss_chunks(cfg, spec, frozenset()) is None, what
    cfg, adapted = _hf_spec("q_proj,lm_head")
    assert not head_chunks(adapted) and loss_chunks(cfg, adapted, frozenset()) is None
    cfg, body = _hf_spec("q_proj,v_proj")
    assert head_chunks(body)


def test_a_given_loss_is_kept_and_a_resumed_plans_whole_logits_are_planned_again():
    """``--loss-chunk-tokens`` given (even the default) is kept as given; a resumed auto
    run's 0, not given again, may be an earlier plan's choice: both are weighed again,
    the default first."""
    import dataclasses

    from gradstep_cli.plan.estimate import loss_chunks

    cfg, spec = _hf_spec()
    given = frozenset({"loss_chunk_tokens"})
    assert loss_chunks(cfg, spec, given) is None  # 1024 on purpose
    resumed = dataclasses.replace(cfg, loss_chunk_tokens=0)
    assert loss_chunks(resumed, spec, frozenset()) == [1024, 0]
    assert loss_chunks(resumed, spec, given) is None
    assert loss_chunks(resumed, spec, None) is None  # a library caller's 0: on purpose
    other = dataclasses.replace(cfg, loss_chunk_tokens=256)
    assert loss_chunks(other, spec, frozenset()) == [256, 0]
