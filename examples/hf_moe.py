"""A tiny Mixtral (mixture of experts) with its router load-balancing loss, exactly weighted.

``causal_lm_loss`` returns the token cross-entropy as a sum and ``coef * aux_loss`` as an
aux term; the Stepper averages the aux term over the window's micro-batches (all ranks)
while the cross-entropy stays a mean over tokens. ``count=count_tokens`` gives the window's
token count before the first backward, which that weighting needs.
"""

import torch
from transformers import MixtralConfig, MixtralForCausalLM

import gradstep
from gradstep.hf import causal_lm_loss, count_tokens

CONFIG = MixtralConfig(
    vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
    num_local_experts=4, num_experts_per_tok=2,
    # Released MoE configs ship output_router_logits=False: then causal_lm_loss adds the
    # router term only when asked, causal_lm_loss(model, batch, aux_coef=0.02).
    output_router_logits=True, router_aux_loss_coef=0.02,
)  # fmt: skip


def batch(gen: torch.Generator) -> dict:
    lengths = torch.randint(2, 33, (4,), generator=gen).tolist()
    ids = torch.zeros(4, max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(0, 64, (n,), generator=gen)
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main() -> None:
    torch.manual_seed(0)
    model = MixtralForCausalLM(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    stepper = gradstep.Stepper(model, opt, clip=gradstep.ClipNorm(1.0))
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 9):
        window = [batch(gen) for _ in range(4)]
        stats = stepper.step(window, causal_lm_loss, count=count_tokens)
        # loss: the token-weighted CE alone; aux: the router term's window mean.
        print(f"step {step}  loss {stats.loss:.4f}  router aux {stats.aux['router']:.5f}")


if __name__ == "__main__":
    main()
