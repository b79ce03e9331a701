"""The shapes the memory model reads: the demo-style :class:`TransformerShape`, and
:data:`Shape`, either it or a Hugging Face decoder's :class:`~gradstep.memory.hf_shape.HFShape`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .hf_shape import HFShape

__all__ = ["Shape", "TransformerShape"]


def _numel(shapes: Sequence[tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes)


@dataclass(frozen=True)
class TransformerShape:
    """Dimensions of a pre-norm decoder transformer (by default the layout of the demo's GPT:
    tied head, no linear biases, LayerNorms with bias, an MLP four times as wide).

    Parameter tensors per block: ``qkv (3d, d)``, ``attn out (d, d)``, ``fc (d_ff, d)``,
    ``mlp out (d, d_ff)`` (no biases, ``linear_bias=False``), and ``norms_per_block``
    LayerNorms of ``(d,)`` weight and bias. Outside the blocks: the embedding ``(V, d)``, the
    final norm and, unless ``tied_embeddings``, a separate head ``(V, d)``.

    ``tp``: the blocks' four matmuls split over ``tp`` tensor-parallel ranks (qkv and fc by
    output rows, whole heads per rank; attn out and mlp out by input columns): the block
    tensors, the matmul weights and the activations inside attention and the MLP are then
    one rank's share; norms, embedding and head stay whole
    (``estimate_step_memory(layout=Layout(tp=N))`` sets it).
    """

    n_layer: int
    d_model: int
    n_head: int
    vocab_size: int
    seq_len: int
    d_ff: int | None = None
    tied_embeddings: bool = True
    norms_per_block: int = 2
    linear_bias: bool = False
    norm_bias: bool = True
    tp: int = 1

    def __post_init__(self) -> None:
        for name in ("n_layer", "d_model", "n_head", "vocab_size", "seq_len", "tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"TransformerShape.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})"
            )
        if self.n_head % self.tp or self.ffn % self.tp:
            raise ValueError(
                f"tp ({self.tp}) must divide n_head ({self.n_head}) and d_ff ({self.ffn}): "
                "each tensor-parallel rank holds whole heads and an equal part of the MLP"
            )

    @property
    def ffn(self) -> int:
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def all_tensors(self) -> list[tuple[int, ...]]:
        """Every parameter tensor's shape (a tied head once)."""
        return self.block_tensors() * self.n_layer + self.other_tensors()

    def trainable_tensors(self) -> list[tuple[int, ...]]:
        """Every parameter trains (the demo GPT has no frozen part)."""
        return self.all_tensors()

    def head_and_block_trainable(self) -> list[tuple[int, ...]]:
        return self.other_tensors() + self.block_tensors()

    @property
    def trainable_params(self) -> int:
        return self.params

    def block_tensors(self) -> list[tuple[int, ...]]:
        """Parameter shapes of one block, one tensor-parallel rank's share (FSDP2 shards
        each along dim 0)."""
        d, f, t = self.d_model, self.ffn, self.tp
        linears = [(3 * d // t, d), (d, d // t), (f // t, d), (d, f // t)]
        out: list[tuple[int, ...]] = list(linears)
        if self.linear_bias:  # column-wise biases are split, row-wise ones whole
            out += [(3 * d // t,), (d,), (f // t,), (d,)]
        out += [(d,)] * (self.norms_per_block * (2 if self.norm_bias else 1))
        return out

    def other_tensors(self) -> list[tuple[int, ...]]:
        """Parameter shapes outside the blocks: embedding, final norm, untied head."""
        v, d = self.vocab_size, self.d_model
        out: list[tuple[int, ...]] = [(v, d)] + [(d,)] * (2 if self.norm_bias else 1)
        return out if self.tied_embeddings else [*out, (v, d)]

    def matmul_numel(self, blocks: int | None = None) -> int:
        """Weights that go through a matmul (what autocast casts): ``blocks`` blocks + head."""
        d, f, v = self.d_model, self.ffn, self.vocab_size
        per_block = (3 * d * d + d * d + 2 * f * d) // self.tp
        return per_block * (self.n_layer if blocks is None else blocks) + v * d

    @property
    def block_params(self) -> int:
        return _numel(self.block_tensors())

    @property
    def params(self) -> int:
        """Unique parameters (a tied head counted once)."""
        return self.n_layer * self.block_params + _numel(self.other_tensors())


Shape = TransformerShape | HFShape
"""What :func:`estimate_step_memory` models: the demo GPT, or a Hugging Face decoder."""
