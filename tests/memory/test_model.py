"""The analytic model against byte counts computed by hand for a tiny decoder.

TINY: 2 blocks, d=8, 2 heads, d_ff=16, vocab 16, seq_len 4, tied head, 2 LayerNorms per
block (weight + bias). Parameters per block: qkv 24*8=192, attn out 8*8=64, fc 16*8=128,
mlp out 8*16=128, norms 2*(8+8)=32 -> 544. Outside: embedding 16*8=128, final norm 16 ->
144. Total P = 2*544 + 144 = 1232.
"""

import pytest
import torch

from gradstep.memory import OptimizerMemory, TransformerShape, estimate_step_memory
from gradstep.memory.model import per_token_terms

TINY = TransformerShape(n_layer=2, d_model=8, n_head=2, vocab_size=16, seq_len=4, d_ff=16)
P = 1232
F32, BF16 = 4, 2


def est(mbs=2, **kw):
    return estimate_step_memory(TINY, mbs, **kw)


def test_parameter_count():
    assert TINY.block_params == 544
    assert TINY.params == P
    untied = TransformerShape(2, 8, 2, 16, 4, d_ff=16, tied_embeddings=False)
    assert untied.params == P + 128


def test_fp32_adamw_states():
    e = est()
    assert e.params == P * F32 == 4928
    assert e.grads == P * F32
    assert e.optimizer == 2 * P * F32 == 9856  # exp_avg + exp_avg_sq
    assert e.accum_buffers == 0
    assert e.unsharded_block == 0


def test_optimizer_kinds():
    assert est(optimizer="sgd_momentum").optimizer == P * F32
    assert est(optimizer="sgd").optimizer == 0
    assert est(optimizer="none").optimizer == 0
    with pytest.raises(ValueError, match="optimizer must be one of"):
        est(optimizer="lion")


def test_an_optimizer_described_by_its_numbers():
    """Any optimizer, by what it holds: states kept per parameter, and its step's
    temporaries in copies of all the parameters and of the largest tensor (qkv: 192)."""
    lion = OptimizerMemory(states_per_param=1)  # one momentum, no temporaries
    assert est(optimizer=lion).optimizer == P * F32 and est(optimizer=lion).step_temporaries == 0
    odd = OptimizerMemory(states_per_param=3, step_params=0.5, step_largest=1)
    e = est(optimizer=odd)
    assert e.optimizer == 3 * P * F32
    assert e.step_temporaries == (P // 2 + 192) * F32
    assert e.step_peak == e.params + e.grads + e.optimizer + e.step_temporaries
    for name in ("adamw", "lamb", "lars", "sgd_momentum", "sgd", "none"):
        assert est(optimizer=OptimizerMemory.named(name)) == est(optimizer=name), name
    for flag in (False, True):
        named = OptimizerMemory.named("adamw", foreach=flag)
        assert est(optimizer=named) == est(optimizer="adamw", foreach=flag)
    with pytest.raises(ValueError, match="foreach"):
        est(optimizer=lion, foreach=True)
    with pytest.raises(ValueError, match="states_per_param must be a number >= 0"):
        OptimizerMemory(states_per_param=-1)


def test_an_optimizer_object_is_read_by_its_class_and_settings():
    """torch's and gradstep's optimizers, as they are built: what each keeps is what its
    state holds after one step, in tensors of the parameters' sizes."""
    from gradstep.optim import LAMB, LARS

    def kept(opt: torch.optim.Optimizer, w: torch.nn.Parameter) -> int:
        w.grad = torch.ones_like(w)
        opt.step()
        return sum(
            t.numel() // w.numel()
            for t in opt.state[w].values()
            if torch.is_tensor(t) and t.shape == w.shape
        )

    builds = [
        lambda w: torch.optim.AdamW([w]),
        lambda w: torch.optim.Adam([w], amsgrad=True),
        lambda w: torch.optim.SGD([w], lr=0.1, momentum=0.9),
        lambda w: torch.optim.SGD([w], lr=0.1),
        lambda w: LARS([w], lr=0.1, momentum=0.9),
        lambda w: LAMB([w], lr=0.1),
    ]
    for build in builds:
        w = torch.nn.Parameter(torch.randn(4, 3))
        opt = build(w)
        memory = OptimizerMemory.of(opt)
        assert memory.states_per_param == kept(opt, w), type(opt).__name__
    assert OptimizerMemory.of(builds[0](torch.nn.Parameter(torch.ones(2)))) == (
        OptimizerMemory.named("adamw")
    )
    assert OptimizerMemory.of(builds[5](torch.nn.Parameter(torch.ones(2)))) == (
        OptimizerMemory.named("lamb")
    )
    with pytest.raises(ValueError, match="Adagrad is not known: describe it as"):
        OptimizerMemory.of(torch.optim.Adagrad([torch.nn.Parameter(torch.ones(2))]))


def test_bf16_params_get_fp32_accumulation_buffers():
    e = est(param_dtype=torch.bfloat16)
    assert e.params == P * BF16 == 2464
    assert e.grads == P * BF16
    assert e.accum_buffers == P * F32  # gradstep's float32 buffers
    assert e.optimizer == 2 * P * BF16  # torch keeps AdamW state in the param dtype
    # The buffers take each gradient as it appears: at most the largest one (qkv) is alive.
    assert e.grads_in_backward == 192 * BF16
    assert est(param_dtype=torch.bfloat16, accum_dtype=torch.bfloat16).accum_buffers == 0


def test_fsdp2_shards_per_tensor_with_padding_and_counts_the_unsharded_blocks():
    # W=3 pads dim 0: qkv ceil(24/3)*8=64, out ceil(8/3)*8=24, fc ceil(16/3)*8=48,
    # mlp out ceil(8/3)*16=48, norms 4 * ceil(8/3)=12 -> 196 per block; embedding
    # ceil(16/3)*8=48 + final norm 2*3=6 -> 446 per rank.
    e = est(world_size=3, sharded=True, accum_steps=1)
    assert e.params == 446 * F32
    assert e.optimizer == 2 * 446 * F32
    assert e.grads == 446 * F32
    assert e.accum_buffers == 0  # FSDP2 accumulates itself; the Stepper refuses buffers
    # Root group (144) + current and prefetched block (2 * 544) unsharded, plus one
    # block's unsharded gradient and its flat reduce-scatter copy (2 * 544 fp32).
    assert e.unsharded_block == (144 + 2 * 544) * F32 + 2 * 544 * F32
    # Without per-micro-batch sync FSDP2 holds the *unsharded* gradients across micro-batches.
    assert est(world_size=3, sharded=True, accum_steps=4).grads_in_backward == P * F32
    synced = est(world_size=3, sharded=True, accum_steps=4, sync_each_micro_batch=True)
    assert synced.grads_in_backward == 446 * F32
    assert est(world_size=2, sharded=True).params == P // 2 * F32  # no padding needed


def test_activation_formula_by_hand_fp32():
    t = per_token_terms(TINY, _bytes(4))
    # Per block and token: 2 norm inputs 2*8*4=64, stats 2*2*4=16, norm outputs 64,
    # qkv 3*8*4=96, rotated q,k 2*8*4=64, attention out 32, logsumexp 4*2=8,
    # fc + GELU outputs 2*16*4=128 -> 472.
    assert t["block"] == 64 + 16 + 64 + 96 + 64 + 32 + 8 + 128 == 472
    # Head: norm in 32 + stats 8 + norm out 32 + fp32 log-probs 16*4=64 + ids/targets 16.
    assert t["head"] == 32 + 8 + 32 + 64 + 16 == 152
    assert t["ce_temporaries"] == 2 * 16 * 4
    assert t["block_temporaries"] == 8 * 4 + 16 * 4
    # Without checkpointing, at the loss's backward: 2 blocks + head + CE temporaries
    # = 1224 B/token, 8 tokens (2 x 4), + cos/sin 2*4*4*4=128.
    assert est(mbs=2).activations == (2 * 472 + 152 + 128) * 8 + 128 == 9920
    assert est(mbs=2).activations_per_item == 1224 * 4


def test_checkpointing_keeps_block_inputs_and_one_recomputed_block():
    # Head phase: 2 inputs*32 + 152 + 128 = 344; recompute phase: 1 other input 32 + the
    # block's saved set 472 + its gradient temporaries 96 = 600 (the larger).
    on = est(mbs=2, activation_checkpointing=True)
    assert on.activations == 600 * 8 + 128 == 4928
    assert on.activations < est(mbs=2).activations
    deep = TransformerShape(n_layer=24, d_model=64, n_head=4, vocab_size=256, seq_len=128)
    off_b = estimate_step_memory(deep, 8).activations
    on_b = estimate_step_memory(deep, 8, activation_checkpointing=True).activations
    assert on_b < off_b / 5


def test_activations_scale_with_batch_and_sequence():
    a1, a4 = est(mbs=1).activations, est(mbs=4).activations
    assert a4 - a1 == 3 * 1224 * 4  # linear in items (no s^2 term with fused attention)
    longer = TransformerShape(2, 8, 2, 16, 8, d_ff=16)
    assert estimate_step_memory(longer, 1).activations == 1224 * 8 + 2 * 8 * 4 * 4


def test_bf16_activations_halve_the_compute_tensors():
    t = per_token_terms(TINY, _bytes(2))
    assert t["block"] == 2 * 8 * 2 + 2 * 2 * 2 + 2 * 8 * 2 + 6 * 8 * 2 + 8 + 2 * 16 * 2
    assert t["head"] == 16 + 4 + 16 + 64 + 16  # log-probs stay fp32 (token_loss upcasts)


def test_autocast_keeps_cast_weight_copies():
    e = est(compute_dtype=torch.bfloat16)
    matmul = 2 * (192 + 64 + 128 + 128) + 128  # block linears + the (tied) head
    assert e.weight_copies == matmul * BF16
    assert est().weight_copies == 0


def test_totals_by_hand():
    e = est(mbs=2, accum_steps=2, fixed_bytes=1000)
    backward = 4928 + 4928 + 9856 + 9920  # params, all grads (2nd micro-batch), AdamW, acts
    step = 4928 + 4928 + 9856 + 2 * 192 * 4  # + AdamW's sqrt(v) temporaries of qkv
    assert (e.backward_peak, e.step_peak) == (backward, step)
    assert e.total == 1000 + max(backward, step) == 30632
    # One micro-batch per step: the loss's backward runs before any gradient exists.
    assert est(mbs=2, accum_steps=1).grads_in_backward == 0
    assert set(e.as_dict()) >= {"params", "grads", "accum_buffers", "optimizer", "total"}


def test_bad_arguments():
    with pytest.raises(ValueError, match="micro_batch_size"):
        est(mbs=0)
    with pytest.raises(ValueError, match="divisible"):
        TransformerShape(2, 10, 3, 16, 4)


def _bytes(e):
    from gradstep.memory.model import _Bytes

    return _Bytes(param=e, compute=e, residual=e, unsharded=e)
