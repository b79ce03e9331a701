"""The tiny models of the tests (and benchmarks).

``TinyLM`` mixes each position with its prefix (a running mean, causal like attention), so
right-padding never changes the logits of real positions: a micro-batch padded to its own
length and the full batch padded to the longest sequence give the same per-token losses.
``tiny_gpt`` is the demo GPT at its smallest, with the same weights in every process.
"""

from __future__ import annotations

import torch
from torch import nn

from gradstep_cli.models.gpt import GPT, GPTConfig

VOCAB = 11  # TinyLM's
GPT_VOCAB = 32
TINY_GPT = GPTConfig(vocab_size=GPT_VOCAB, n_layer=2, n_head=2, d_model=16, max_seq_len=16)


class TinyLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        steps = torch.arange(1, ids.size(1) + 1, device=ids.device, dtype=h.dtype)
        prefix_mean = h.cumsum(1) / steps[None, :, None]
        return self.head(torch.tanh(self.mix(prefix_mean)))


def tiny_gpt(dtype: torch.dtype = torch.float32) -> GPT:
    """The same initial weights in every process (fixed seed, CPU)."""
    torch.manual_seed(1234)
    return GPT(TINY_GPT).to(dtype)


class BF16Linear(nn.Linear):
    """Parameters stored in bf16, computed in fp32: isolates the accumulation error."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x.float(), self.weight.float(), self.bias.float())
