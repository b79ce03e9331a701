"""The activation formula against what autograd really keeps, for any small demo GPT.

Every tensor saved for backward is recorded (``saved_tensors_hooks``); the distinct
storages that are not parameters must add up to the formula's saved terms (blocks, head,
dropout masks, rotary tables, autocast's weight copies) to the byte, with dropout (masks,
and on CPU torch's math attention with its s^2 matrices) and without, in fp32 and under
bf16 autocast. The only byte the formula leaves out is the loss's own 0-dim float32.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradstep import token_loss
from gradstep.memory import TransformerShape, estimate_step_memory
from gradstep.memory.activations import _Bytes, per_token_terms
from gradstep_cli.models.gpt import GPT, GPTConfig
from gradstep_cli.plan.estimate import gpt_shape

LOSS_SCALAR = 4  # the fp32 loss the forward returns, saved by the sum's backward


def saved_bytes(cfg: GPTConfig, rows: int, amp: bool, seq_ids: torch.Tensor | None = None) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in one forward (of packed
    rows, each with ``seq_ids``, when given)."""
    torch.manual_seed(0)
    model = GPT(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (rows, cfg.max_seq_len))
    packed = {} if seq_ids is None else {"seq_ids": seq_ids.expand(rows, -1).clone()}
    targets = torch.randint(0, cfg.vocab_size, (rows, cfg.max_seq_len))
    storages: dict[int, int] = {}
    keep = []  # alive until counted: no address is reused by a later tensor

    def pack(t: torch.Tensor) -> torch.Tensor:
        keep.append(t)
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with hooks, torch.autocast("cpu", torch.bfloat16, enabled=amp):
        token_loss(model(ids, **packed), targets)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)


def formula_bytes(cfg: GPTConfig, rows: int, amp: bool) -> int:
    shape = gpt_shape(cfg)
    e_c = 2 if amp else 4
    attention = "math" if cfg.dropout > 0 else "fused"  # what torch runs on CPU
    t = per_token_terms(shape, _Bytes(4, e_c, 4, 4), cfg.dropout > 0, attention, rows)
    tokens = rows * cfg.max_seq_len
    rope = 2 * cfg.max_seq_len * cfg.head_dim * 4
    copies = shape.matmul_numel() * e_c if amp else 0
    return round((cfg.n_layer * t["block"] + t["head"] + t["stem"]) * tokens) + rope + copies


@settings(max_examples=24, deadline=None)
@given(
    layers=st.integers(1, 3),
    heads=st.integers(1, 4),
    head_dim=st.sampled_from([2, 4, 8, 16]),
    seq=st.integers(2, 24),
    rows=st.integers(1, 3),
    dropout=st.sampled_from([0.0, 0.1]),
    amp=st.booleans(),
)
def test_saved_activation_bytes_equal_the_formula(layers, heads, head_dim, seq, rows, dropout, amp):
    cfg = GPTConfig(
        n_layer=layers,
        n_head=heads,
        d_model=heads * head_dim,
        max_seq_len=seq,
        dropout=dropout,
    )
    assert saved_bytes(cfg, rows, amp) == formula_bytes(cfg, rows, amp) + LOSS_SCALAR


def test_dropout_costs_memory_and_the_math_attention_grows_with_the_square():
    shape = TransformerShape(n_layer=3, d_model=192, n_head=6, vocab_size=256, seq_len=320)
    plain = estimate_step_memory(shape, 4).activations
    dropped = estimate_step_memory(shape, 4, dropout=0.1, attention="math").activations
    assert dropped > 2 * plain  # three 320 x 320 fp32 matrices per head dwarf the rest
    fused = estimate_step_memory(shape, 4, dropout=0.1).activations
    assert plain < fused < dropped  # masks only (CUDA's flash kernels drop in place)
    long = TransformerShape(n_layer=3, d_model=192, n_head=6, vocab_size=256, seq_len=640)
    per_item = estimate_step_memory(shape, 1, dropout=0.1, attention="math").activations_per_item
    long_item = estimate_step_memory(long, 1, dropout=0.1, attention="math").activations_per_item
    assert long_item > 2.5 * per_item  # superlinear in the sequence length


def test_packed_rows_keep_each_layers_mask_and_each_rows_rotary_tables():
    """Packed rows (``seq_ids``): SDPA turns the boolean block-causal mask into an additive
    one in the query's dtype and every layer saves its own copy (T x T per row); the rotary
    tables are each row's (``position_ids`` restart per sequence) instead of one shared. On
    top of what is saved, the boolean mask and the int64 ``seq_ids``/``position_ids`` are
    alive the whole step: the formula has them too."""
    from gradstep.memory.activations import activations

    for amp in (False, True):
        cfg = GPTConfig(n_layer=2, n_head=2, d_model=16, max_seq_len=32)
        rows, seq = 3, cfg.max_seq_len
        ids = torch.arange(seq) >= seq // 2  # two sequences a row
        saved = {packed: saved_bytes(cfg, rows, amp, ids.long() if packed else None)
                 for packed in (False, True)}  # fmt: skip
        sizes = _Bytes(4, 2 if amp else 4, 4, 4)
        shape = gpt_shape(cfg)
        plain, packed = (activations(shape, sizes, rows, False, packed=p)[0] for p in (False, True))
        alive = rows * seq * (seq + 2 * 8)  # the boolean mask, seq_ids and position_ids
        assert saved[True] - saved[False] == packed - plain - alive, amp
