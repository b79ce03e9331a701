"""The activation model of the chunked loss (``--loss-chunk-tokens N``,
``estimate_step_memory(loss_chunk_tokens=N)``; issue 31 §2): one chunk's logits instead of
the micro-batch's. What the chunked demo GPT's forward saves equals the formula to the byte
(as tests/memory/test_activations.py checks the whole-logits head), and at a large
vocabulary the estimate is lower than the whole-logits one by the logits' bytes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradstep.memory import TransformerShape, estimate_step_memory, from_hf_config
from gradstep.memory.activations import _Bytes, chunk_bytes, chunked_head_terms, per_token_terms
from gradstep_cli.models.gpt import GPT, GPTConfig
from gradstep_cli.plan.estimate import gpt_shape

MiB = 2**20


def saved_bytes(cfg: GPTConfig, rows: int, amp: bool) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in one chunked forward."""
    torch.manual_seed(0)
    model = GPT(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (rows, cfg.max_seq_len))
    targets = torch.randint(0, cfg.vocab_size, (rows, cfg.max_seq_len))
    storages: dict[int, int] = {}
    keep = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        keep.append(t)
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with hooks, torch.autocast("cpu", torch.bfloat16, enabled=amp):
        model(ids, targets)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)


def formula_bytes(cfg: GPTConfig, rows: int, amp: bool) -> int:
    shape, e_c, d = gpt_shape(cfg), 2 if amp else 4, cfg.d_model
    t = per_token_terms(shape, _Bytes(4, e_c, 4, 4), False, "fused", rows)
    t = chunked_head_terms(t, d, 4, 4, d * e_c + cfg.vocab_size * 4)
    tokens = rows * cfg.max_seq_len
    rope = 2 * cfg.max_seq_len * cfg.head_dim * 4
    # autocast's saved weight copies: the blocks' only (the chunked head casts per chunk)
    copies = (shape.matmul_numel() - cfg.vocab_size * d) * e_c if amp else 0
    return round((cfg.n_layer * t["block"] + t["head"]) * tokens) + rope + copies


@settings(max_examples=12, deadline=None)
@given(
    layers=st.integers(1, 2),
    heads=st.integers(1, 4),
    head_dim=st.sampled_from([2, 4, 8]),
    seq=st.integers(2, 24),
    rows=st.integers(1, 3),
    chunk=st.integers(1, 40),
    amp=st.booleans(),
)
def test_saved_bytes_of_the_chunked_loss_equal_the_formula(
    layers, heads, head_dim, seq, rows, chunk, amp
):
    cfg = GPTConfig(
        n_layer=layers,
        n_head=heads,
        d_model=heads * head_dim,
        max_seq_len=seq,
        loss_chunk_tokens=chunk,
    )
    assert saved_bytes(cfg, rows, amp) == formula_bytes(cfg, rows, amp)


BIG_VOCAB = TransformerShape(n_layer=2, d_model=64, n_head=4, vocab_size=128_000, seq_len=1024)


@pytest.mark.parametrize("ckpt", [False, True])
def test_at_a_large_vocabulary_chunking_saves_the_logits_bytes(ckpt: bool) -> None:
    mbs, chunk, v, d = 4, 1024, BIG_VOCAB.vocab_size, BIG_VOCAB.d_model
    whole = estimate_step_memory(BIG_VOCAB, mbs, activation_checkpointing=ckpt)
    chunked = estimate_step_memory(
        BIG_VOCAB, mbs, activation_checkpointing=ckpt, loss_chunk_tokens=chunk
    )
    tokens = mbs * BIG_VOCAB.seq_len
    logits = tokens * v * 4  # the float32 logits of the micro-batch: 2000 MiB
    saved = whole.total - chunked.total
    # The whole logits' log-softmax (kept) and its two backward gradients, less one chunk.
    assert saved >= logits
    per_token = 3 * v * 4 + d * 4 - d * 4 - 8 - d * 4  # head + ce terms, whole - chunked
    expected = per_token * tokens - chunk_bytes(v, d, chunk, tokens, 4, 4, True)
    assert saved == expected, (saved / MiB, expected / MiB)
    assert chunked.activations < whole.activations / 4  # the logits dominated
    # 0 is the whole logits, bitwise the estimate without the argument
    zero = estimate_step_memory(BIG_VOCAB, mbs, activation_checkpointing=ckpt, loss_chunk_tokens=0)
    assert zero == whole


def test_chunking_lets_a_larger_micro_batch_fit_a_budget() -> None:
    budget = 2 * 2**30

    def largest(chunk: int) -> int:
        fits = [
            b
            for b in range(1, 65)
            if estimate_step_memory(BIG_VOCAB, b, loss_chunk_tokens=chunk).total <= budget
        ]
        return max(fits, default=0)

    assert largest(0) <= 1 and largest(1024) >= 8 * max(largest(0), 1)


def test_hf_llama_estimate_drops_the_logits_unless_lora_adapts_the_head() -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=128_000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    shape = from_hf_config(config, 1024)
    whole = estimate_step_memory(shape, 4)
    chunked = estimate_step_memory(shape, 4, loss_chunk_tokens=1024)
    assert whole.total - chunked.total >= 4 * 1024 * 128_000 * 4
    head = from_hf_config(config, 1024, lora_rank=4, lora_targets=("q_proj", "lm_head"))
    assert estimate_step_memory(head, 4, loss_chunk_tokens=1024) == estimate_step_memory(head, 4)
    body = from_hf_config(config, 1024, lora_rank=4, lora_targets=("q_proj",))
    assert (
        estimate_step_memory(body, 4, loss_chunk_tokens=1024).total
        < estimate_step_memory(body, 4).total
    )


def test_a_bad_chunk_is_refused() -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="loss_chunk_tokens"):
            estimate_step_memory(BIG_VOCAB, 1, loss_chunk_tokens=bad)
