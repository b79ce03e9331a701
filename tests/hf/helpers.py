"""Tiny Hugging Face models (random init from config objects, never a download), HF-style
padded micro-batches, and the float64 full-window reference gradient."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

VOCAB = 256
IGNORE = -100


def _config_kwargs() -> dict:
    return dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


def llama(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**_config_kwargs())).to(dtype)


def gpt2(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config).to(dtype)


def mixtral(seed: int = 0, dtype: torch.dtype = torch.float32, coef: float = 0.02) -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(
        **_config_kwargs(),
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=coef,
    )
    # grouped_mm (the default experts kernel) has no float64 version.
    config._experts_implementation = "eager"
    return MixtralForCausalLM(config).to(dtype)


def lora(model: nn.Module, r: int = 4) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"])
    return get_peft_model(model, config)


def hf_batch(seqs: Sequence[torch.Tensor], pad: str = "right") -> dict[str, torch.Tensor]:
    """HF format: padded input_ids, attention_mask, UNSHIFTED labels (-100 on padding)."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, s in enumerate(seqs):
        cols = slice(width - len(s), width) if pad == "left" else slice(0, len(s))
        ids[row, cols], mask[row, cols] = s, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE)}


def window_seqs(gen: torch.Generator, k: int, rows: int = 2, max_len: int = 24) -> list[list]:
    """``k`` micro-batches of sequences of random lengths; micro-batch 1 holds two 1-token
    sequences (0 targets) and micro-batch 2 one 2-token sequence (1 target)."""
    out = []
    for j in range(k):
        if j == 1:
            lengths = [1, 1]
        elif j == 2:
            lengths = [2]
        else:
            lengths = torch.randint(3, max_len + 1, (rows,), generator=gen).tolist()
        out.append([torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths])
    return out


def reference_grads(
    model: nn.Module,
    micro_seqs: Sequence[Sequence[torch.Tensor]],
    aux: bool = False,
    sum_first: bool = False,
) -> tuple[dict[str, torch.Tensor], float, int]:
    """Gradient of sum(CE) / N over every sequence of the window, each run alone and
    unpadded (plus, with ``aux``, the mean over micro-batches of coef * aux_loss, each
    micro-batch run right-padded as the Stepper runs it). Returns (grads, loss, N).

    ``sum_first``: backpropagate N times the loss and divide the gradients by N afterwards
    (the same math). HF's RMSNorm casts activation gradients to float32 even in a float64
    model, and that rounding depends on the scale of what is backpropagated: the Stepper
    backpropagates sums, so against this reference float64 parity is float64 rounding."""
    model.zero_grad(set_to_none=True)
    ce, n = 0.0, 0
    seqs = [s for mb in micro_seqs for s in mb if len(s) > 1]
    for s in seqs:
        logits = model(input_ids=s[None], use_cache=False).logits[0, :-1]
        ce = ce + nn.functional.cross_entropy(logits.double(), s[1:], reduction="sum")
        n += len(s) - 1
    loss = ce / n
    if aux:
        coef = model.config.router_aux_loss_coef
        terms = []
        for mb in micro_seqs:
            b = hf_batch(mb)
            out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
            terms.append(coef * out.aux_loss)
        loss = loss + torch.stack(terms).mean()
    (loss * n if sum_first else loss).backward()
    scale = 1 / n if sum_first else 1.0
    grads = {
        name: p.grad.detach() * scale for name, p in model.named_parameters() if p.grad is not None
    }
    return grads, float(loss.detach()), n


def rel_err(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """||g - g_ref|| / ||g_ref|| over the whole gradient (same names in both)."""
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    diff = sum(float((got[k].double() - want[k].double()).square().sum()) for k in want)
    ref = sum(float(want[k].double().square().sum()) for k in want)
    return (diff / ref) ** 0.5


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
