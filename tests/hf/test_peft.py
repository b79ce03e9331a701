"""PEFT LoRA: adapter-only checkpoints that resume bitwise, find_output_layer and AGC with
frozen parameters and zero-initialised LoRA B matrices."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors import safe_open

pytest.importorskip("transformers")
pytest.importorskip("peft")

import gradstep  # noqa: E402
from gradstep.hf import causal_lm_loss, count_tokens  # noqa: E402
from tests.hf.helpers import hf_batch, llama, lora, window_seqs  # noqa: E402


def _run(model, windows, start, stop, ckpt=None, save_at=None):  # noqa: ANN001, ANN202
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    clip = [gradstep.ClipNorm(1.0), gradstep.AGC(0.05, exclude=gradstep.find_output_layer(model))]
    stepper = gradstep.Stepper(model, opt, sched, clip=clip)
    objs = dict(model=model, optimizer=opt, scheduler=sched, stepper=stepper)
    if start:
        assert ckpt.load_latest(**objs) == start
    stats = []
    for step in range(start, stop):
        window = [hf_batch(s) for s in windows[step]]
        stats.append(stepper.step(window, causal_lm_loss, count=count_tokens))
        if step + 1 == save_at:
            ckpt.save(save_at, **objs)
    return stats, opt


def test_trainable_only_checkpoint_resumes_bitwise_and_holds_no_frozen_weight(tmp_path) -> None:
    gen = torch.Generator().manual_seed(8)
    windows = [window_seqs(gen, 3) for _ in range(6)]
    straight = lora(llama(seed=0))
    want, want_opt = _run(straight, windows, 0, 6)

    ckpt = gradstep.Checkpointer(tmp_path, trainable_only=True)
    _run(lora(llama(seed=0)), windows, 0, 3, ckpt, save_at=3)
    torch.manual_seed(123)  # a later process: other RNG state, objects built anew
    resumed = lora(llama(seed=0))  # the frozen base comes from elsewhere: the same seed
    got, got_opt = _run(resumed, windows, 3, 6, ckpt)

    for (name, p), q in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), name
    for a, b in zip(want[3:], got, strict=True):
        assert (a.loss, a.grad_norm, a.items, a.clipped) == (
            b.loss,
            b.grad_norm,
            b.items,
            b.clipped,
        )
    a, b = want_opt.state_dict(), got_opt.state_dict()
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    for i, state in a["state"].items():
        assert state.keys() == b["state"][i].keys()
        assert all(torch.equal(v, b["state"][i][k]) for k, v in state.items())

    folder = ckpt.latest().path
    trainable = {n for n, p in straight.named_parameters() if p.requires_grad}
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert keys == trainable and all("lora_" in k for k in keys)
    assert len(keys) < sum(1 for _ in straight.parameters()) / 2

    # Loading it as a full model would keep frozen weights from nowhere: refused.
    with pytest.raises(gradstep.CheckpointError, match="trainable_only=True"):
        gradstep.Checkpointer(tmp_path).load_latest(model=lora(llama(seed=0)), strict=False)


def test_find_output_layer_ignores_frozen_parameters() -> None:
    base = llama()
    assert gradstep.find_output_layer(base) == ["lm_head.weight"]
    peft_model = lora(llama())
    assert gradstep.find_output_layer(peft_model) == []  # the head is frozen, not a LoRA matrix
    gradstep.AGC(exclude=gradstep.find_output_layer(peft_model))  # the README's line works


@pytest.mark.parametrize("zero_weights", ["skip", "eps"])
def test_agc_and_zero_initialised_lora_b(zero_weights: str) -> None:
    model = lora(llama(dtype=torch.float64))
    b_rows = sum(p.shape[0] for n, p in model.named_parameters() if "lora_B" in n)
    window = [hf_batch(s) for s in window_seqs(torch.Generator().manual_seed(2), 2)]
    raw = copy.deepcopy(model)
    gradstep.Stepper(raw, torch.optim.SGD(raw.parameters(), lr=0.0), clip=None).step(
        window, causal_lm_loss
    )
    agc = gradstep.AGC(clipping=0.01, zero_weights=zero_weights)
    stepper = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.0), clip=agc)
    stepper.step(window, causal_lm_loss)
    named = dict(raw.named_parameters())
    b_grads = [(p.grad, named[n].grad) for n, p in model.named_parameters() if "lora_B" in n]
    # At init only B gets a gradient (B = 0 makes A's gradient 0): it is the whole step.
    assert all(float(g.norm()) > 0 for _, g in b_grads)
    if zero_weights == "skip":  # B = 0 has no scale to clip against: left alone
        assert agc.clipped_units == 0
        assert all(torch.equal(g, r) for g, r in b_grads)
    else:  # the paper's eps floor: every B row capped at clipping * eps
        assert agc.clipped_units == b_rows
        for g, _ in b_grads:
            assert g.norm(dim=1).max() <= 0.01 * 1e-3 * (1 + 1e-9)
    with pytest.raises(ValueError, match="zero_weights must be one of skip, eps"):
        gradstep.AGC(zero_weights="zero")
