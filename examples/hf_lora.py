"""A Hugging Face Llama-style model with PEFT LoRA, AGC and an adapter-only checkpoint.

Random init from a tiny config (nothing is downloaded); HF-format batches (unshifted
labels, right padding). Trains 4 steps, saves only the adapters, rebuilds everything from
the same seed as a new process would, resumes and trains 4 more.
"""

import tempfile

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import gradstep
from gradstep.hf import causal_lm_loss, count_tokens

CONFIG = LlamaConfig(
    vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
)  # fmt: skip


def build(seed: int = 0):
    torch.manual_seed(seed)  # the frozen base is rebuilt, not saved: same seed, same weights
    model = get_peft_model(LlamaForCausalLM(CONFIG), LoraConfig(r=4, lora_alpha=8))
    model.train()  # from_pretrained would return eval mode: dropout off
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    # find_output_layer skips frozen parameters: [] here, the head is frozen. AGC leaves
    # the zero-initialised LoRA B matrices alone until they move (zero_weights="skip").
    clip = [gradstep.ClipNorm(1.0), gradstep.AGC(0.05, exclude=gradstep.find_output_layer(model))]
    return model, opt, gradstep.Stepper(model, opt, clip=clip)


def batch(gen: torch.Generator) -> dict:
    lengths = torch.randint(2, 33, (4,), generator=gen).tolist()
    ids = torch.zeros(4, max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(0, 64, (n,), generator=gen)  # a learnable sub-vocabulary
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main() -> None:
    gen = torch.Generator().manual_seed(1)
    windows = [[batch(gen) for _ in range(3)] for _ in range(8)]
    with tempfile.TemporaryDirectory() as folder:
        ckpt = gradstep.Checkpointer(folder, trainable_only=True)  # adapters + their Adam state
        model, opt, stepper = build()
        for step, window in enumerate(windows[:4], start=1):
            stats = stepper.step(window, causal_lm_loss, count=count_tokens)
            print(f"step {step}  loss {stats.loss:.4f}  grad norm {stats.grad_norm:.4f}")
        ckpt.save(4, model=model, optimizer=opt, stepper=stepper)
        model, opt, stepper = build()  # as a new process would
        start = ckpt.load_latest(model=model, optimizer=opt, stepper=stepper)
        for step, window in enumerate(windows[start:], start=start + 1):
            stats = stepper.step(window, causal_lm_loss, count=count_tokens)
            print(f"step {step}  loss {stats.loss:.4f}  grad norm {stats.grad_norm:.4f}")
        files = sorted(p.name for p in ckpt.latest().path.iterdir())
        print("checkpoint files:", ", ".join(files))


if __name__ == "__main__":
    main()
