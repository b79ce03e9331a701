"""Padding-free packing: several whole sequences in one row, attention never crossing them.

A micro-batch of padded rows spends its compute on padding (a third of the positions of a
typical SFT set, more with long-tailed lengths). Packing puts whole sequences one after
another into rows of up to ``row_tokens`` positions, and keeps each sequence alone:

- positions restart at 0 for each sequence (``position_ids``);
- attention is **block-causal**: a position attends to the earlier positions of its own
  sequence only (:func:`block_causal_mask`, a 4-D mask);
- targets stay inside their sequence: labels are given aligned with the inputs
  (``labels[t]`` is what position ``t`` predicts, -100 for nothing), so the last position
  of a sequence never predicts the first of the next.

The pitfall: ``position_ids`` alone do **not** separate sequences. Under ``sdpa`` or
``eager`` attention a row ``[a | b]`` whose positions restart at ``b`` still lets ``b``
attend to ``a`` (its logits moved by 0.2 in a float64 test): the mask must say it. Which
mask an implementation reads exactly differs (a boolean 4-D mask under ``sdpa``, an
additive one under ``eager``): :func:`mask_for` knows the two, and :func:`max_leak`
measures, on the model itself, that a packed row gives what each sequence alone gives,
so that anything not shown exact can be refused. The item counts of a packed row are the
sum of its sequences' (nothing changes in the step's normalisation).

``gradstep.hf.causal_lm_loss`` trains on :func:`pack`'s batches as they are.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "EXACT_ATTENTION",
    "EXACT_FAMILIES",
    "SEGMENTS",
    "block_causal_mask",
    "check_exact",
    "mask_for",
    "max_leak",
    "pack",
    "plan_rows",
    "segment_attention",
    "use_segments",
]

SEGMENTS = "gradstep_segments"
"""The attention implementation :func:`use_segments` registers: :func:`segment_attention`."""

EXACT_ATTENTION = ("sdpa", "eager", SEGMENTS)
"""Attention implementations :func:`mask_for` makes packed rows exact under: a 4-D mask for
``sdpa`` and ``eager``, none for :data:`SEGMENTS` (it reads the sequences from the
positions). ``flash_attention_*`` reads boundaries from ``cu_seqlens`` on CUDA only: not
built here."""


EXACT_FAMILIES = (
    "llama", "qwen2", "phi3", "phi", "gpt_neox", "opt", "qwen2_moe", "qwen3_moe", "olmoe",
    "granitemoe",
)  # fmt: skip
"""Hugging Face model types (``config.model_type``) whose packed rows the test suite shows
equal to each sequence run alone, under each implementation of :data:`EXACT_ATTENTION`
(loss, count and gradient, float64, 1e-12 relative: ``tests/test_packing.py``)."""

LEAK_TOLERANCE = 1e-3
""":func:`check_exact`'s bound on :func:`max_leak` in float32/float64 (a leak is ~0.2)."""


def plan_rows(lengths: Sequence[int], row_tokens: int, order: str = "stream") -> list[list[int]]:
    """Which sequences go in each row (indices into ``lengths``), no row over ``row_tokens``.

    ``order="stream"``: greedy in the given order, a new row when the next sequence does
    not fit (the data order is kept, so a stream of rows resumes where it stopped);
    ``"bfd"``: best-fit decreasing (fewer rows, the order is lost). Every sequence is in
    exactly one row; one longer than ``row_tokens`` is an error (cut it first).
    """
    if isinstance(row_tokens, bool) or not isinstance(row_tokens, int) or row_tokens < 1:
        raise ValueError(f"plan_rows: row_tokens must be an int >= 1, got {row_tokens!r}")
    if order not in ("stream", "bfd"):
        raise ValueError(f"plan_rows: order must be 'stream' or 'bfd', got {order!r}")
    too_long = [i for i, n in enumerate(lengths) if n > row_tokens or n < 1]
    if too_long:
        i = too_long[0]
        raise ValueError(
            f"plan_rows: sequence {i} has {lengths[i]} tokens, outside 1..row_tokens "
            f"({row_tokens}); cut sequences to the row length first"
        )
    if order == "stream":
        rows: list[list[int]] = []
        used = row_tokens  # no open row yet
        for i, n in enumerate(lengths):
            if used + n > row_tokens:
                rows.append([])
                used = 0
            rows[-1].append(i)
            used += n
        return rows
    return _best_fit_decreasing(lengths, row_tokens)


def _best_fit_decreasing(lengths: Sequence[int], row_tokens: int) -> list[list[int]]:
    """Longest first, each into the row it fills most (the fullest that still holds it;
    ties: the row opened first). ``free`` is kept sorted by (room, row): a binary search
    finds that row, so packing costs O(n log rows), not a scan of every row."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        at = bisect.bisect_left(free, (n, -1))
        if at < len(free):
            room, r = free.pop(at)
            rows[r].append(i)
            if room > n:
                bisect.insort(free, (room - n, r))
        else:
            rows.append([i])
            if row_tokens > n:
                bisect.insort(free, (row_tokens - n, len(rows) - 1))
    return rows


def pack(
    sequences: Sequence[tuple[torch.Tensor, torch.Tensor]],
    rows: Sequence[Sequence[int]],
    row_tokens: int | None = None,
    pad_id: int = 0,
) -> dict[str, torch.Tensor]:
    """Rows of whole sequences: ``input_ids``, ``shift_labels`` (the aligned labels; -100 on
    padding), ``position_ids`` (restarting per sequence) and ``seq_ids`` (the row's sequence
    of each position, 0, 1, ...; padding is a sequence of its own, so no attention row is
    empty). ``sequences``: ``(input_ids, labels)`` pairs of equal length, labels aligned.
    Every row is ``row_tokens`` long (default: the longest row), padded on the right."""
    lengths = [len(ids) for ids, _ in sequences]
    width = max(sum(lengths[i] for i in row) for row in rows) if row_tokens is None else row_tokens
    shape = (len(rows), width)
    ids = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, -100, dtype=torch.long)
    positions = torch.zeros(shape, dtype=torch.long)
    seq_ids = torch.zeros(shape, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for k, i in enumerate(row):
            seq, lab = sequences[i]
            if len(lab) != len(seq):
                raise ValueError(f"pack: sequence {i} has {len(seq)} ids and {len(lab)} labels")
            n = len(seq)
            if at + n > width:
                raise ValueError(f"pack: row {r} holds more than {width} tokens")
            ids[r, at : at + n], labels[r, at : at + n] = seq, lab
            positions[r, at : at + n] = torch.arange(n)
            seq_ids[r, at : at + n] = k
            at += n
        seq_ids[r, at:] = len(row)  # the padding: its own sequence
        positions[r, at:] = torch.arange(width - at)
    return {"input_ids": ids, "shift_labels": labels, "position_ids": positions, "seq_ids": seq_ids}


def block_causal_mask(seq_ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``(rows, 1, T, T)``: position ``i`` may attend to ``j`` iff ``j <= i`` and both are in
    the same sequence. ``dtype=None``: boolean (True = may attend, what ``sdpa`` reads);
    a float dtype: additive (0, or -inf where not allowed, what ``eager`` adds to scores)."""
    t = seq_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=seq_ids.device).tril()
    allowed = (seq_ids[:, :, None] == seq_ids[:, None, :]) & causal
    allowed = allowed[:, None]
    if dtype is None:
        return allowed
    zeros = torch.zeros(allowed.shape, dtype=dtype, device=seq_ids.device)
    return zeros.masked_fill(~allowed, float("-inf"))


def _implementation(model: nn.Module) -> str:
    from .parallel import unwrap

    inner = unwrap(model)
    get = getattr(inner, "get_base_model", None)
    config = getattr(get() if callable(get) else inner, "config", None)
    return str(getattr(config, "_attn_implementation", None) or "eager")


def mask_for(model: nn.Module, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict:
    """``batch`` with the 4-D mask ``model``'s attention implementation reads exactly
    (``attention_mask``; ``seq_ids`` dropped); ``dtype``: the attention's compute dtype.
    An implementation outside :data:`EXACT_ATTENTION` is refused, naming it."""
    impl = _implementation(model)
    if impl not in EXACT_ATTENTION:
        raise ValueError(
            f"packing: attention implementation {impl!r} of {type(model).__name__} takes no "
            f"4-D mask here; packing runs under one of {EXACT_ATTENTION} (set "
            "attn_implementation='sdpa'), else train without packing"
        )
    out = {k: v for k, v in batch.items() if k != "seq_ids"}
    if impl != SEGMENTS:
        mask = block_causal_mask(batch["seq_ids"], None if impl == "sdpa" else dtype)
        out["attention_mask"] = mask
    return out


@torch.no_grad()
def max_leak(model: nn.Module, lengths: Sequence[int] = (5, 9, 3), seed: int = 0) -> float:
    """The largest difference between the logits of a packed row of sequences of
    ``lengths`` and those of each sequence run alone (random ids, the model's dtype):
    0 (to rounding) when the model's attention keeps packed sequences apart."""
    from .parallel import unwrap

    inner = unwrap(model)
    embeddings = inner.get_input_embeddings()
    vocab, dtype = embeddings.num_embeddings, embeddings.weight.dtype
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    device = embeddings.weight.device
    batch = pack([(s, torch.full_like(s, -100)) for s in seqs], [list(range(len(seqs)))])
    batch = mask_for(model, batch, dtype)
    was = inner.training
    inner.eval()
    try:
        packed = _logits(model, batch, device)[0]
        alone = [_logits(model, {"input_ids": s[None]}, device)[0] for s in seqs]
    finally:
        inner.train(was)
    return max(float((packed[o : o + len(s)] - a).abs().max()) for o, s, a in _offsets(seqs, alone))


def _logits(model: nn.Module, batch: dict[str, Any], device: torch.device) -> torch.Tensor:
    kwargs = {k: v.to(device) for k, v in batch.items() if k != "shift_labels"}
    return model(**kwargs, use_cache=False).logits


def _offsets(seqs: list[torch.Tensor], alone: list[torch.Tensor]) -> list[tuple]:
    out, at = [], 0
    for s, a in zip(seqs, alone, strict=True):
        out.append((at, s, a))
        at += len(s)
    return out


def check_exact(model: nn.Module) -> None:
    """Raise ``ValueError`` unless packed rows are exact for ``model`` (an HF causal LM):
    its family is in :data:`EXACT_FAMILIES` and its attention implementation in
    :data:`EXACT_ATTENTION` (the message names both), and, in float32/float64, the model
    itself shows no leak (:func:`max_leak` below :data:`LEAK_TOLERANCE`)."""
    from .parallel import unwrap

    inner = unwrap(model)
    get = getattr(inner, "get_base_model", None)
    config = getattr(get() if callable(get) else inner, "config", None)
    family, impl = getattr(config, "model_type", None), _implementation(model)
    if family not in EXACT_FAMILIES or impl not in EXACT_ATTENTION:
        raise ValueError(
            f"packing: not shown exact for the family {family!r} under the attention "
            f"implementation {impl!r} (exact: families {', '.join(EXACT_FAMILIES)} under "
            f"{' or '.join(EXACT_ATTENTION)}); train without packing, or with "
            "attn_implementation='sdpa' on one of those families"
        )
    dtype = inner.get_input_embeddings().weight.dtype
    if dtype in (torch.float32, torch.float64):
        leak = max_leak(model)
        if leak > LEAK_TOLERANCE:
            raise ValueError(
                f"packing: the {family!r} model under {impl!r} lets packed sequences attend "
                f"to each other (logits {leak:.3g} away from each sequence alone); train "
                "without packing"
            )


def segment_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each sequence of a packed row, one ``sdpa`` call per sequence
    (a Hugging Face attention function: ``query`` ``(B, H, T, D)``, ``key``/``value``
    ``(B, H_kv, T, D)``, the output ``(B, T, H, D)``). A sequence starts where
    ``position_ids`` is 0 (and at each row's start). No ``T x T`` mask is made and no score
    across sequences computed: on long-tailed lengths the attention costs a fraction of the
    masked one. An unpacked right-padded row is one sequence (plain causal attention)."""
    positions = kwargs.get("position_ids")
    if attention_mask is not None or positions is None:
        raise ValueError(
            f"{SEGMENTS} attention needs position_ids (restarting per sequence) and no "
            "attention_mask: train right-padded or packed rows, or use 'sdpa'"
        )
    t, gqa = query.shape[2], key.shape[1] != query.shape[1]
    rows = []
    for r in range(query.shape[0]):
        starts = torch.nonzero(positions[min(r, len(positions) - 1)] == 0).flatten().tolist()
        bounds = sorted({0, *starts}) + [t]
        parts = [
            F.scaled_dot_product_attention(
                query[r : r + 1, :, a:b],
                key[r : r + 1, :, a:b],
                value[r : r + 1, :, a:b],
                dropout_p=dropout,
                is_causal=True,
                scale=scaling,
                enable_gqa=gqa,
            )  # fmt: skip
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        ]
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows).transpose(1, 2).contiguous(), None


def use_segments(model: nn.Module) -> bool:
    """Switch an ``sdpa`` Hugging Face model to :func:`segment_attention` (registered as
    :data:`SEGMENTS`) when it is shown exact on the model itself (:func:`max_leak`, float32
    or float64; no sliding window, which only a mask would apply). Returns whether it did;
    a model left on ``sdpa`` trains packed rows through :func:`mask_for`'s 4-D mask."""
    from transformers import AttentionInterface

    from .parallel import unwrap

    inner = unwrap(model)
    get = getattr(inner, "get_base_model", None)
    hf = get() if callable(get) else inner
    config = hf.config
    window = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    dtype = hf.get_input_embeddings().weight.dtype
    if _implementation(model) != "sdpa" or window or dtype not in (torch.float32, torch.float64):
        return False
    AttentionInterface.register(SEGMENTS, segment_attention)
    hf.set_attn_implementation(SEGMENTS)
    try:
        exact = max_leak(model) <= LEAK_TOLERANCE
    except Exception:  # a family whose attention is not given the positions
        exact = False
    if not exact:
        hf.set_attn_implementation("sdpa")
    return exact
