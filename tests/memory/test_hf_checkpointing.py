"""Activation checkpointing of HF decoders is exact: the step it takes is the plain step.

``checkpoint_blocks`` wraps every decoder layer (the outermost ``nn.ModuleList``, also
inside PEFT's wrapper) in non-reentrant ``torch.utils.checkpoint``, as HF's
``gradient_checkpointing_enable(use_reentrant=False)`` does, but around the layer's
``forward`` so FSDP2's hooks stay outside. The recompute replays the RNG, so dropout (OPT's,
LoRA's) draws the same masks: after one ``Stepper.step`` of two micro-batches of different
lengths (AdamW, clipping) every parameter is bitwise the plain step's, in float32 and under
bf16 autocast, with and without LoRA, for every family, MoE router loss included.
"""

from __future__ import annotations

import pytest
import torch

from gradstep import Stepper
from gradstep.hf import causal_lm_loss, count_tokens
from gradstep.memory import checkpoint_blocks
from tests.memory.hf_saved import build, config
from tests.support.hf_assets import FAMILIES

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

LORA = {"r": 4, "target_modules": "all-linear", "lora_dropout": 0.1}


def window() -> list[dict]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for rows, length in ((3, 11), (2, 6)):
        ids = torch.randint(0, 512, (rows, length), generator=gen)
        labels = ids.roll(-1, 1)
        labels[0, length // 2 :] = -100  # a partly masked row: the counts differ
        out.append({"input_ids": ids, "labels": labels})
    return out


def stepped(family: str, checkpointing: bool, lora: dict | None, precision: str) -> dict:
    cfg = config(family, layers=2, output_router_logits=family in ("qwen2_moe", "olmoe"))
    model = build(cfg, lora=lora)
    if checkpointing:
        assert checkpoint_blocks(model) == 2
    params = [p for p in model.parameters() if p.requires_grad]
    stepper = Stepper(model, torch.optim.AdamW(params, lr=1e-2), precision=precision)
    torch.manual_seed(11)  # the dropout masks: the same draws in both runs

    def loss_fn(m: torch.nn.Module, batch: dict) -> object:
        return causal_lm_loss(m, batch, shifted=True)

    stats = stepper.step(window(), loss_fn, count=lambda b: count_tokens(b, shifted=True))
    assert stats.loss == stats.loss  # finite: a real step was taken
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_checkpointed_step_is_bitwise_the_plain_step(family, lora, precision):
    if lora and family == "olmoe":  # PEFT's adapters on its expert tensors take no dropout
        lora = {**lora, "lora_dropout": 0.0}
    plain = stepped(family, False, lora, precision)
    ckpt = stepped(family, True, lora, precision)
    assert plain.keys() == ckpt.keys()
    for name, value in plain.items():
        assert torch.equal(value, ckpt[name]), name


def test_checkpointing_twice_is_a_no_op_and_names_do_not_change():
    model = build(config("llama", layers=3))
    names = [n for n, _ in model.named_parameters()]
    assert checkpoint_blocks(model) == 3
    assert checkpoint_blocks(model) == 3  # already wrapped: nothing added
    assert [n for n, _ in model.named_parameters()] == names
