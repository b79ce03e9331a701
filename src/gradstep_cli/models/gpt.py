"""A small byte-level decoder-only transformer for the ``gradstep train`` demo.

The model is deliberately plain (pre-norm blocks, rotary positions, fused causal attention,
GELU MLP) so that the demo exercises the optimizer step rather than the architecture. Two
layout choices are load-bearing for later features:

* the transformer blocks live in ``model.blocks`` (an ``nn.ModuleList``) so an FSDP2 wrapper
  can ``fully_shard`` each block separately;
* the output projection is called ``lm_head`` so code that treats the head specially
  (weight tying, precision overrides) can find it by name.

Rotary tables are computed in ``forward`` instead of being stored as buffers: they are cheap
for short sequences, and not having buffers means meta-device construction, sharding and
dtype casts never need to re-create them.

Two optional paths leave the plain ``model(input_ids)`` untouched (bitwise):

* **packed rows** (``seq_ids=``, :func:`gradstep.packing.pack`'s rows): several whole
  sequences per row, attention block-causal within each and rotary positions restarting
  at each, so a packed row computes exactly what each sequence alone computes;
* **the loss in the forward** (``labels=``): a :class:`~gradstep.LossSum`; with
  ``loss_chunk_tokens`` set it is :func:`~gradstep.step.loss.chunked_token_loss` of the
  last hidden states and the head's weight, so the ``(B, T, vocab)`` logits are never held.
  It runs inside ``forward`` because that is where FSDP2 has gathered the head's weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gradstep.packing import block_causal_mask
from gradstep.step import LossSum, chunked_token_loss, token_loss

__all__ = [
    "GPT",
    "GPTConfig",
    "apply_rotary",
    "generate",
    "generate_ids",
    "positions_from",
    "rotary_tables",
]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model. The defaults give ~1.3M parameters, trainable on 2 CPU cores."""

    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 160
    max_seq_len: int = 256
    dropout: float = 0.0
    tie_weights: bool = True
    mlp_ratio: int = 4
    rope_base: float = 10000.0
    loss_chunk_tokens: int | None = None
    """``forward(..., labels=)`` computes the loss this many positions at a time without the
    whole logits (None: from the whole logits, as ``token_loss(model(ids), labels)``)."""

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})"
            )
        if (self.d_model // self.n_head) % 2:
            raise ValueError("head dimension d_model // n_head must be even for rotary embeddings")
        chunk = self.loss_chunk_tokens
        if chunk is not None and (
            isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1
        ):
            raise ValueError(f"loss_chunk_tokens must be None or an int >= 1, got {chunk!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


def rotary_tables(
    seq_len: int,
    head_dim: int,
    base: float = 10000.0,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(cos, sin)`` of shape ``(seq_len, head_dim)`` for rotate-half RoPE.

    Frequencies are computed in float32 and only cast at the end, so low-precision runs
    do not lose position resolution.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    positions = torch.arange(seq_len, device=device).float()
    angles = torch.outer(positions, inv_freq)  # (T, head_dim / 2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, head_dim)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(..., T, head_dim)`` by position-dependent angles.

    Pairs ``(x_i, x_{i + d/2})`` are rotated by ``theta_i * t``. The dot product of two rotated
    vectors then depends only on their position difference, which is what makes attention
    relative-position aware without a learned position table.
    """
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention using the fused SDPA kernel.

    The fused ``qkv`` projection is laid out head-major: its output rows are, per head,
    that head's q, k and v (``3 * head_dim`` rows each). A contiguous slice of its rows is
    then a set of whole heads, which is what tensor parallelism's ``ColwiseParallel`` gives
    each rank; the forward reads the number of heads it holds from the projection's output
    width, so the same code runs on all heads or on a rank's share of them.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``cos``/``sin``: ``(T, hd)``, or ``(B, 1, T, hd)`` for per-row positions; ``mask``:
        None (causal) or a boolean ``(B, 1, T, T)`` (True = may attend), a packed row's."""
        b, t, _ = x.shape
        qkv = self.qkv(x)
        heads = qkv.shape[-1] // (3 * self.head_dim)  # this rank's, under tensor parallelism
        # (b, t, heads, 3, hd) -> (3, b, heads, t, hd); no -1: an empty micro-batch has b = 0
        q, k, v = qkv.view(b, t, heads, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        dropout = self.dropout if self.training else 0.0
        if mask is None:
            # Right padding only: a real token never attends to a later pad, so the causal
            # mask is the only mask needed and the fused kernel stays usable.
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        return self.proj(y.transpose(1, 2).reshape(b, t, heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), cos, sin, mask))
        return x + self.drop(self.mlp(self.norm2(x)))


class GPT(nn.Module):
    """Byte-level GPT: ``model(input_ids)`` maps ``(B, T)`` byte ids to ``(B, T, vocab)`` logits."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        # Scale residual output projections so the residual stream's variance does not grow
        # with depth (GPT-2 initialisation).
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
        if cfg.tie_weights:
            self.lm_head.weight = self.embed.weight

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_parameters(self) -> int:
        """Unique parameters (a tied head is counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        seq_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        hidden: bool = False,
    ) -> torch.Tensor | LossSum:
        """``(B, T)`` ids to ``(B, T, vocab)`` logits, or with ``labels`` (aligned with the ids:
        ``labels[:, t]`` is position ``t``'s target, -100 for none) their summed
        cross-entropy and count as a :class:`~gradstep.LossSum`.

        ``seq_ids`` (``(B, T)``, :func:`gradstep.packing.pack`'s): each position's sequence
        in its row; a position attends only to earlier positions of its own sequence, and
        its rotary position counts from its sequence's start (``position_ids``, derived
        from ``seq_ids`` when not given). ``position_ids`` alone is refused: without the
        mask, packed sequences would attend to each other. ``hidden=True``: the final
        norm's output instead, the output projection's input (evaluation applies the
        projection a chunk of positions at a time).
        """
        t = input_ids.shape[1]
        if t > self.config.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len {self.config.max_seq_len}")
        x = self.drop(self.embed(input_ids))
        if seq_ids is None:
            if position_ids is not None:
                raise ValueError(
                    "GPT.forward: position_ids without seq_ids: packed sequences would attend "
                    "to each other; pass seq_ids (gradstep.packing.pack's) too"
                )
            mask = None
            cos, sin = rotary_tables(
                t, self.config.head_dim, self.config.rope_base, device=x.device, dtype=x.dtype
            )
        else:
            mask, cos, sin = self._packed(seq_ids, position_ids, x)
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        out = self.norm(x)
        if hidden:  # the projection's input: evaluation applies it a chunk at a time
            return out
        if labels is None:
            return self.lm_head(out)
        chunk = self.config.loss_chunk_tokens
        if chunk is None:
            return token_loss(self.lm_head(out), labels)
        # The head's weight as this forward sees it: under FSDP2 the gathered one.
        return chunked_token_loss(
            out, self.lm_head.weight, labels, self.lm_head.bias, chunk_tokens=chunk
        )

    def _packed(
        self, seq_ids: torch.Tensor, position_ids: torch.Tensor | None, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block-causal mask and per-row rotary tables ``(B, 1, T, hd)`` of packed rows.
        The tables are rows of the same ``rotary_tables`` a sequence alone uses, so each
        sequence's rotations are bitwise the ones it gets alone."""
        if seq_ids.shape != x.shape[:2]:
            raise ValueError(
                f"GPT.forward: seq_ids shape {tuple(seq_ids.shape)} differs from input_ids "
                f"shape {tuple(x.shape[:2])}"
            )
        seq_ids = seq_ids.to(x.device)
        if position_ids is None:
            position_ids = positions_from(seq_ids)
        position_ids = position_ids.to(x.device)
        cos, sin = rotary_tables(
            x.shape[1], self.config.head_dim, self.config.rope_base, device=x.device, dtype=x.dtype
        )
        # (T, hd) rows at each position: (B, T, hd), then a heads axis to broadcast over.
        cos, sin = cos[position_ids].unsqueeze(1), sin[position_ids].unsqueeze(1)
        return block_causal_mask(seq_ids), cos, sin


def positions_from(seq_ids: torch.Tensor) -> torch.Tensor:
    """Each position's offset from the start of its sequence (a run of equal ``seq_ids``):
    the positions :func:`gradstep.packing.pack` gives, padding included."""
    t = seq_ids.shape[-1]
    index = torch.arange(t, device=seq_ids.device).expand_as(seq_ids)
    starts = torch.ones_like(seq_ids, dtype=torch.bool)
    starts[..., 1:] = seq_ids[..., 1:] != seq_ids[..., :-1]
    return index - torch.where(starts, index, 0).cummax(-1).values


def generate(
    model: nn.Module,
    prompt_bytes: bytes,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> bytes:
    """Sample ``max_new_tokens`` bytes after ``prompt_bytes`` and return only the new bytes
    (:func:`generate_ids` on the byte values; an empty prompt starts from a newline)."""
    prompt = list(prompt_bytes) or [ord("\n")]
    return bytes(generate_ids(model, prompt, max_new_tokens, temperature, top_k, generator))


@torch.no_grad()
def generate_ids(
    model: nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    max_len: int | None = None,
) -> list[int]:
    """Sample ``max_new_tokens`` token ids after ``prompt_ids`` (not empty) and return only
    the new ones.

    No KV cache: the demo model is tiny and samples are short, so re-running the context
    (cropped to ``max_len``, default the model's ``config.max_seq_len`` when it has one)
    keeps this function obviously correct. ``temperature <= 0`` means greedy decoding. The
    model's train/eval mode is restored afterwards.
    """
    device = next(model.parameters()).device
    if max_len is None:
        max_len = getattr(getattr(model, "config", None), "max_seq_len", None)
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=device)[None]
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            context = ids if max_len is None else ids[:, -max_len:]
            logits = model(context)[0, -1].float()
            if temperature <= 0:
                next_id = logits.argmax().view(1, 1)
            else:
                logits = logits / temperature
                if top_k is not None and top_k < logits.numel():
                    kth = torch.topk(logits, top_k).values[-1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1).cpu()
                next_id = torch.multinomial(probs, 1, generator=generator).view(1, 1).to(device)
            ids = torch.cat((ids, next_id), dim=1)
    finally:
        model.train(was_training)
    return ids[0, len(prompt_ids) :].tolist()
