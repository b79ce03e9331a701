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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig", "apply_rotary", "generate", "generate_ids", "rotary_tables"]


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

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})"
            )
        if (self.d_model // self.n_head) % 2:
            raise ValueError("head dimension d_model // n_head must be even for rotary embeddings")

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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x)
        heads = qkv.shape[-1] // (3 * self.head_dim)  # this rank's, under tensor parallelism
        # (b, t, heads, 3, hd) -> (3, b, heads, t, hd); no -1: an empty micro-batch has b = 0
        q, k, v = qkv.view(b, t, heads, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # Right padding only: a real token never attends to a later pad, so the causal mask
        # is the only mask needed and the fused kernel stays usable.
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), cos, sin))
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

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        if t > self.config.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len {self.config.max_seq_len}")
        x = self.drop(self.embed(input_ids))
        cos, sin = rotary_tables(
            t, self.config.head_dim, self.config.rope_base, device=x.device, dtype=x.dtype
        )
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x))


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
