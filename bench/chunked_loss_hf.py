"""The Hugging Face rows of bench/chunked_loss.py: a tiny-width Llama (built from a
``LlamaConfig``, random weights, nothing downloaded) whose logits dominate, and its loss
taken three ways:

* ``hf``: HF's own loss, ``model(input_ids=..., labels=...).loss`` (the whole logits; the
  model's output object is dropped at once, as ``Trainer.compute_loss`` does);
* ``whole``: ``gradstep.hf.causal_lm_loss(model, batch)`` (the whole logits);
* ``chunked N``: ``causal_lm_loss(model, batch, chunk_tokens=N)``.

Imported by the child process only after it pinned the mmap threshold (torch inside)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

HIDDEN, LAYERS, HEADS, FFN = 64, 2, 4, 256


def llama_config(vocab: int, max_positions: int, hidden: int = HIDDEN) -> Any:
    """The tiny-width Llama of both parts: ``hidden`` wide, 2 layers, untied head."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        max_position_embeddings=max_positions, use_cache=False,
    )  # fmt: skip


def label(loss: str, chunk: int) -> str:
    if loss == "hf":
        return "HF model(labels=).loss"
    return "causal_lm_loss whole" if not chunk else f"causal_lm_loss chunk {chunk}"


def build(args: argparse.Namespace) -> tuple[Any, Callable[[], float]]:
    """The model and one forward + backward of ``args.loss`` (returning the loss per
    token) on a random batch of ``args.micro_batch`` x ``args.seq_len``."""
    import torch
    from transformers import AutoModelForCausalLM

    from gradstep.hf import causal_lm_loss

    vocab, chunk = args.vocab[0], args.chunk or None
    config = llama_config(vocab, args.seq_len, args.d_model)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    ids = torch.randint(0, vocab, (args.micro_batch, args.seq_len))
    batch = {"input_ids": ids, "labels": torch.randint(0, vocab, ids.shape)}

    def hf_step() -> float:
        loss = model(**batch).loss  # mean over the shifted tokens
        loss.backward()
        return float(loss)

    def gradstep_step() -> float:
        loss = causal_lm_loss(model, batch, chunk_tokens=chunk)
        loss.total.backward()
        return float(loss.total) / int(loss.count)

    return model, hf_step if args.loss == "hf" else gradstep_step
