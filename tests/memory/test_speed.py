"""gradstep.memory.speed: the count of a step's work the planner ranks candidates by."""

import numpy as np
import pytest

from gradstep.memory import TransformerShape
from gradstep.memory.speed import RECOMPUTE, expected_longest, row_time, step_time_model

SHAPE = TransformerShape(n_layer=3, d_model=192, n_head=4, vocab_size=256, seq_len=512)
WIDE_VOCAB = TransformerShape(n_layer=2, d_model=256, n_head=4, vocab_size=8192, seq_len=512)


def per_row(step_time, mbs, *key):
    return step_time(mbs, *key) / mbs


def test_the_longest_of_several_rows_is_exact_from_the_distribution():
    lengths, counts = np.array([1.0, 2.0]), np.array([1.0, 1.0])
    assert expected_longest(lengths, counts, 1) == pytest.approx(1.5)
    assert expected_longest(lengths, counts, 2) == pytest.approx(1.75)  # 1 only if both are
    rng = np.random.default_rng(0)
    draws = rng.choice([3, 10, 50], p=[0.5, 0.3, 0.2], size=(200_000, 4)).max(axis=1)
    exact = expected_longest(np.array([3.0, 10.0, 50.0]), np.array([5.0, 3.0, 2.0]), 4)
    assert exact == pytest.approx(draws.mean(), rel=0.01)


def test_padding_makes_small_micro_batches_faster_on_variable_lengths():
    """Unpacked, a micro-batch is padded to its longest row: one long row in ten makes the
    micro-batch of eight pay for it on (nearly) every row."""
    ragged = step_time_model(SHAPE, 512, lengths=[64, 512], counts=[9, 1])
    assert per_row(ragged, 1, False, 0) < 0.5 * per_row(ragged, 8, False, 0)


def test_packed_rows_make_larger_micro_batches_faster():
    """Packed, every row is --seq-len long: only the fixed cost per micro-batch differs."""
    packed = step_time_model(SHAPE, 512)
    times = [per_row(packed, m, False, 0) for m in (1, 2, 4, 8)]
    assert times == sorted(times, reverse=True) and times[0] > times[-1]


def test_checkpointing_costs_the_recomputed_forward():
    packed = step_time_model(SHAPE, 512)
    ratio = packed(4, True, 0) / packed(4, False, 0)
    assert 1.2 < ratio < 1 + RECOMPUTE / 2  # the blocks' forward is a third of their work


def test_the_chunked_loss_costs_a_second_projection_of_the_trained_tokens_only():
    """Whole logits project every position (padding too); chunked, only targets, twice. A
    large vocabulary on text (every token trains): whole is faster; on prompt/completion
    records (half the tokens train) with padding: chunked is."""
    text = step_time_model(WIDE_VOCAB, 512, trained=1.0)
    assert text(1, False, 0) < text(1, False, 1024)
    sft = step_time_model(WIDE_VOCAB, 256, lengths=[40, 120, 250], counts=[5, 3, 2], trained=0.5)
    assert sft(4, False, 1024) < sft(4, False, 0)


def test_a_narrow_heads_softmax_outweighs_its_projection():
    """Per logit element the softmax and its gradient cost ~1000 flops' worth on CPU (11.0 ns
    whole, 9.4 chunked, at ~95 Gflop/s): at width 64 the chunked loss's second projection
    is paid for by its cheaper passes (measured 0.94-0.99 of the whole loss's time), at
    width 256 not (1.13-1.22)."""

    def ratio(width):
        shape = TransformerShape(n_layer=1, d_model=width, n_head=2, vocab_size=128_256,
                                 seq_len=256)  # fmt: skip
        step = step_time_model(shape, 256, trained=1.0)
        return step(16, False, 1024) / step(16, False, 0)

    assert 0.9 < ratio(64) < 1.0
    assert 1.1 < ratio(256) < 1.25


def test_frozen_weights_compute_no_weight_gradient():
    from gradstep.memory import HFShape

    base = dict(family="llama", n_layer=2, d_model=64, n_head=4, n_kv_head=4, head_dim=16)
    full = HFShape(**base, d_ff=128, vocab_size=100, seq_len=32)
    lora = HFShape(**base, d_ff=128, vocab_size=100, seq_len=32, lora_rank=2,
                   lora_targets=("q_proj",))  # fmt: skip
    assert row_time(lora)(1, 32.0, 32.0, False, False) < row_time(full)(1, 32.0, 32.0, False, False)


def test_the_chunked_loss_projects_each_chunk_once_more_through_any_head():
    """Backward recomputes each chunk's logits: one more forward projection (2 v d a
    trained position) whether the head trains (8 v d in all) or is frozen (6, not 4 x 4/3)."""
    from gradstep.memory import HFShape
    from gradstep.memory.speed import LOGIT_FLOPS

    base = dict(family="llama", n_layer=2, d_model=64, n_head=4, n_kv_head=4, head_dim=16)
    full = HFShape(**base, d_ff=128, vocab_size=1000, seq_len=32)
    lora = HFShape(**base, d_ff=128, vocab_size=1000, seq_len=32, lora_rank=2,
                   lora_targets=("q_proj",))  # fmt: skip
    whole, chunk = LOGIT_FLOPS["cpu"]
    for shape in (full, lora):
        t = row_time(shape)
        extra = t(1, 32.0, 32.0, False, True) - t(1, 32.0, 32.0, False, False)
        assert extra == pytest.approx(32 * (2 * 1000 * 64 + 1000 * (chunk - whole)), rel=1e-12)
