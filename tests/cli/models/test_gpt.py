"""The toy GPT (gradstep_cli.models.gpt): shapes, causality, rotary embeddings, size, sampling,
and the head-major attention tensor parallel splits."""

from __future__ import annotations

import torch
from torch import nn

from gradstep_cli.models.gpt import GPT, GPTConfig, apply_rotary, generate, rotary_tables
from gradstep_cli.models.parallel_plan import gpt_tp_plan

TINY = GPTConfig(n_layer=2, n_head=2, d_model=32, max_seq_len=64)


def tiny_model(seed: int = 0, **overrides: object) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(**{**TINY.__dict__, **overrides})
    return GPT(cfg).eval()


def test_forward_shape_and_dtype() -> None:
    model = tiny_model()
    ids = torch.randint(0, 256, (3, 17))
    logits = model(ids)
    assert logits.shape == (3, 17, 256)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_causal_future_tokens_do_not_change_earlier_logits() -> None:
    model = tiny_model()
    ids = torch.randint(0, 256, (2, 20))
    changed = ids.clone()
    changed[:, 12:] = (changed[:, 12:] + 7) % 256
    before, after = model(ids), model(changed)
    torch.testing.assert_close(before[:, :12], after[:, :12])
    assert not torch.allclose(before[:, 12:], after[:, 12:])


def test_right_padding_does_not_change_real_positions() -> None:
    # The data pipeline pads on the right with 0 and relies on the causal mask alone.
    model = tiny_model()
    ids = torch.randint(1, 256, (1, 10))
    padded = torch.cat([ids, torch.zeros(1, 6, dtype=torch.long)], dim=1)
    torch.testing.assert_close(model(ids), model(padded)[:, :10])


def test_default_size_and_layout() -> None:
    model = GPT(GPTConfig())
    assert 1_000_000 <= model.num_parameters() <= 3_000_000
    assert isinstance(model.blocks, nn.ModuleList) and len(model.blocks) == 4
    assert isinstance(model.lm_head, nn.Linear)
    assert model.lm_head.weight is model.embed.weight  # tied by default


def test_untied_head_has_its_own_weight() -> None:
    model = tiny_model(tie_weights=False)
    assert model.lm_head.weight is not model.embed.weight
    assert model.num_parameters() == tiny_model().num_parameters() + 256 * 32


def test_rotary_preserves_norm_and_encodes_relative_position() -> None:
    head_dim = 16
    cos, sin = rotary_tables(32, head_dim)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(head_dim, generator=gen), torch.randn(head_dim, generator=gen)
    rq = apply_rotary(q.expand(32, head_dim), cos, sin)
    rk = apply_rotary(k.expand(32, head_dim), cos, sin)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm().expand(32))
    # <R_m q, R_n k> depends only on m - n.
    torch.testing.assert_close(rq[7] @ rk[3], rq[25] @ rk[21])
    torch.testing.assert_close(rq[0] @ rk[0], q @ k)
    assert not torch.allclose(rq[7] @ rk[3], rq[7] @ rk[5])


def test_sequence_longer_than_max_is_rejected() -> None:
    model = tiny_model()
    try:
        model(torch.zeros(1, 65, dtype=torch.long))
    except ValueError as exc:
        assert "max_seq_len" in str(exc)
    else:
        raise AssertionError("expected ValueError")


def test_generate_is_seeded_and_restores_mode() -> None:
    model = tiny_model(max_seq_len=8).train()
    out1 = generate(model, b"def ", 12, 1.0, 20, torch.Generator().manual_seed(1))
    out2 = generate(model, b"def ", 12, 1.0, 20, torch.Generator().manual_seed(1))
    assert isinstance(out1, bytes) and len(out1) == 12  # context outgrows max_seq_len
    assert out1 == out2
    assert model.training
    greedy = generate(model, b"", 5, temperature=0.0)
    assert len(greedy) == 5
    assert generate(model, b"x", 0) == b""


def test_the_attention_is_head_major_so_a_row_shard_is_whole_heads() -> None:
    """The forward of the demo attention on one contiguous half of ``qkv``'s rows (and the
    matching half of ``proj``'s columns) is that half of the heads: the two halves sum to
    the whole attention, as a column-wise qkv and row-wise proj compute it."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=16, n_layer=1, n_head=4, d_model=16, max_seq_len=8)
    attn = GPT(cfg).double().blocks[0].attn
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    cos, sin = rotary_tables(8, cfg.head_dim, dtype=torch.float64)
    whole = attn(x, cos, sin)
    halves = []
    for part in range(2):
        half = type(attn)(cfg).double()
        rows, cols = slice(24 * part, 24 * (part + 1)), slice(8 * part, 8 * (part + 1))
        half.qkv.weight = torch.nn.Parameter(attn.qkv.weight[rows].clone())
        half.proj.weight = torch.nn.Parameter(attn.proj.weight[:, cols].clone())
        halves.append(half(x, cos, sin))
    torch.testing.assert_close(halves[0] + halves[1], whole, rtol=1e-12, atol=1e-12)
    assert set(gpt_tp_plan()) == {"attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"}
