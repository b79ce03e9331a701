"""The analytic model on multi-dimensional meshes: HSDP (``layout=Layout(dp_replicate=R)``),
FSDP2 + tensor parallel (``Layout(tp=N)``) and both, by hand on the tiny decoder of
test_model.py (2 blocks, d=8, 2 heads, d_ff=16, vocab 16, seq_len 4, P = 1232; per block
qkv 24x8, attn out 8x8, fc 16x8, mlp out 8x16, four (8,) norm tensors).

With ``tp=2`` one rank holds qkv 12x8, attn out 8x4, fc 8x8, mlp out 8x8 (288 numbers per
block with the norms), FSDP2 halves that over the 2 data-parallel ranks of 4 (144 per
block), and the embedding (16x8) and final norm are sharded over those 2 only (72): 360
per rank, against 308 for plain FSDP2 over 4 ranks and 616 over 2. HSDP over 4 ranks in
2 replicas is FSDP2 over 2 ranks, byte for byte, and HSDP + tensor parallel over 8 ranks in 2
replicas is FSDP2 + tensor parallel over 4.

On 2 gloo ranks, the demo GPT given linear biases and laid out by
``prepare_model(layout=Layout(tp=2))`` with the demo's plan holds on each rank what the model
counts with ``linear_bias=True``:
the column-wise layers' biases split over the tp ranks, the row-wise layers' whole.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradstep.memory import HFShape, TransformerShape, estimate_step_memory
from gradstep.memory.activations import _Bytes
from gradstep.memory.model import per_token_terms
from gradstep.parallel import Layout
from gradstep_cli.models.gpt import GPTConfig
from gradstep_cli.plan.estimate import gpt_shape

TINY = TransformerShape(n_layer=2, d_model=8, n_head=2, vocab_size=16, seq_len=4, d_ff=16)
P, F32 = 1232, 4


def est(world: int, **kw: object) -> object:
    return estimate_step_memory(TINY, 2, world_size=world, sharded=True, **kw)


def test_tensor_parallel_splits_the_block_states_and_fsdp_shards_over_the_data_ranks() -> None:
    tp = est(4, layout=Layout(tp=2))
    assert tp.params == tp.grads == 360 * F32
    assert tp.optimizer == 2 * 360 * F32  # AdamW's two states of what this rank holds
    assert est(4).params == 308 * F32 and est(2).params == P // 2 * F32
    # One block all-gathered is the rank's tensor-parallel share: 288, not 544.
    assert TINY.block_params == 544 and dataclasses.replace(TINY, tp=2).block_params == 288
    assert tp.unsharded_block < est(2).unsharded_block


def test_tensor_parallel_splits_the_activations_inside_attention_and_the_mlp() -> None:
    """Per token and block (fp32, fused attention): 2 norm inputs 64 + their stats 16 +
    their outputs 64 (whole: they feed the matmuls on every rank), the attention core
    6d*4 + 4h = 200, the MLP's fc and GELU outputs 2f*4 = 128: 472. With tp=2 the core is
    2 heads' half (6*4*4 + 4 = 100) and the MLP half (64): 308."""
    b = _Bytes(param=F32, compute=F32, residual=F32, unsharded=F32)
    assert per_token_terms(TINY, b)["block"] == 472
    assert per_token_terms(dataclasses.replace(TINY, tp=2), b)["block"] == 308
    # The head (vocabulary log-softmax) and the residual stream stay whole.
    assert (
        per_token_terms(dataclasses.replace(TINY, tp=2), b)["head"]
        == (per_token_terms(TINY, b)["head"])
    )
    assert est(4, layout=Layout(tp=2)).activations < est(2).activations


@given(
    replicas=st.sampled_from([2, 4]),
    mbs=st.integers(1, 8),
    checkpointing=st.booleans(),
    accum=st.sampled_from([None, 1, 3]),
)
def test_hsdp_is_fsdp2_over_the_ranks_of_one_replica(
    replicas: int, mbs: int, checkpointing: bool, accum: int | None
) -> None:
    """HSDP over 8 ranks in R replicas holds what FSDP2 over 8 / R ranks holds, with tensor
    parallel too (a 3-D mesh)."""
    kw = {"activation_checkpointing": checkpointing, "accum_steps": accum, "sharded": True}
    hsdp = estimate_step_memory(TINY, mbs, world_size=8, layout=Layout(dp_replicate=replicas), **kw)
    assert hsdp == estimate_step_memory(TINY, mbs, world_size=8 // replicas, **kw)
    assert hsdp.total > estimate_step_memory(TINY, mbs, world_size=8, **kw).total
    both = Layout(dp_replicate=replicas, tp=2)
    one_replica = estimate_step_memory(
        TINY, mbs, world_size=8 // replicas, layout=Layout(tp=2), **kw
    )
    assert estimate_step_memory(TINY, mbs, world_size=8, layout=both, **kw) == one_replica


@given(mbs=st.integers(1, 8), checkpointing=st.booleans(), world=st.sampled_from([2, 4, 8]))
def test_more_tensor_parallel_ranks_never_need_more_memory_per_rank(
    mbs: int, checkpointing: bool, world: int
) -> None:
    """Same data-parallel ranks (world / tp), more tensor parallel: every component is at
    most what it was, and the total falls."""
    shape = TransformerShape(n_layer=2, d_model=16, n_head=4, vocab_size=16, seq_len=8)
    kw = {"activation_checkpointing": checkpointing, "sharded": True}
    one = estimate_step_memory(shape, mbs, world_size=world, **kw)
    two = estimate_step_memory(shape, mbs, world_size=2 * world, layout=Layout(tp=2), **kw)
    for part in ("params", "grads", "optimizer", "activations", "unsharded_block"):
        assert getattr(two, part) <= getattr(one, part), part
    assert two.total < one.total


BIASED = GPTConfig(vocab_size=32, n_layer=2, n_head=4, d_model=16, max_seq_len=16)
LINEARS = (("attn", "qkv"), ("attn", "proj"), ("mlp", "fc"), ("mlp", "proj"))


def _biased_tp_rank(rank: int, world: int) -> dict[str, object]:
    """The demo GPT with a bias on every linear of its blocks, under the demo's tensor
    parallel plan over every rank: the numbers this rank holds, and its bias shapes."""
    import torch

    from gradstep.parallel import prepare_model
    from gradstep_cli.models.gpt import GPT
    from gradstep_cli.models.parallel_plan import gpt_tp_plan

    torch.manual_seed(0)
    model = GPT(BIASED)
    for block in model.blocks:
        for part, name in LINEARS:
            owner = getattr(block, part)
            old = getattr(owner, name)
            setattr(owner, name, torch.nn.Linear(old.in_features, old.out_features, bias=True))
    model = prepare_model(model, "fsdp", layout=Layout(tp=world), tp_plan=gpt_tp_plan())
    local = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    biases = {f"{part}.{name}": local[f"blocks.0.{part}.{name}.bias"] for part, name in LINEARS}
    return {"numel": sum(p.to_local().numel() for p in model.parameters()), "biases": biases}


@pytest.mark.distributed
def test_a_tensor_parallel_rank_holds_what_the_model_counts_linear_biases_included() -> None:
    from tests.support.multiproc import run_ranks

    tp, d, f = 2, BIASED.d_model, BIASED.mlp_ratio * BIASED.d_model
    shape = dataclasses.replace(gpt_shape(BIASED), linear_bias=True)
    layout = Layout(tp=tp)
    modelled = estimate_step_memory(shape, 1, world_size=tp, sharded=True, layout=layout).params
    modelled //= F32
    want = {"attn.qkv": (3 * d // tp,), "attn.proj": (d,), "mlp.fc": (f // tp,), "mlp.proj": (d,)}
    for rank, got in enumerate(run_ranks(_biased_tp_rank, tp, timeout=120)):
        assert got == {"numel": modelled, "biases": want}, rank


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 4, "layout": Layout(tp=2)},
         "layout=Layout(tp=2) models FSDP2 on a multi-dimensional mesh: it needs sharded=True"),
        ({"world_size": 4, "layout": Layout(dp_replicate=2)}, "it needs sharded=True"),
        ({"world_size": 3, "layout": Layout(tp=2), "sharded": True},
         "Layout(tp=2) does not fit 3 ranks: tp=2 must divide the number of ranks (3)"),
        ({"world_size": 4, "layout": Layout(dp_replicate=2, tp=4), "sharded": True},
         "dp_replicate=2 x tp=4 = 8 must divide the number of ranks (4)"),
        ({"world_size": 4, "layout": {"tp": 2}, "sharded": True},
         "layout must be a gradstep.parallel.Layout or None, got dict"),
    ],
)  # fmt: skip
def test_mesh_arguments_are_checked(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        estimate_step_memory(TINY, 1, **kwargs)


def test_tp_needs_whole_heads_and_a_transformer_shape() -> None:
    with pytest.raises(ValueError, match=r"tp \(4\) must divide n_head \(2\) and d_ff \(16\)"):
        dataclasses.replace(TINY, tp=4)
    hf = HFShape.__new__(HFShape)  # any HFShape: refused before it is read
    with pytest.raises(ValueError, match="tp is modelled for a TransformerShape"):
        estimate_step_memory(hf, 1, world_size=4, sharded=True, layout=Layout(tp=2))
