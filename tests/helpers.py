"""A tiny causal LM and variable-length data for the parity tests.

The model mixes each position with its prefix (a running mean, causal like attention), so
right-padding never changes the logits of real positions: a micro-batch padded to its own
length and the full batch padded to the longest sequence give the same per-token losses.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import gradstep

VOCAB = 11


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


def make_seq(length: int, gen: torch.Generator, ignore_frac: float = 0.2):
    ids = torch.randint(0, VOCAB, (length,), generator=gen)
    labels = torch.randint(0, VOCAB, (length,), generator=gen)
    mask = torch.rand(length, generator=gen) < ignore_frac
    labels[mask] = -100
    return ids, labels


def collate(seqs, pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """Right-pad: inputs with 0, labels with -100 (so padding carries no loss)."""
    width = pad_to or max(len(ids) for ids, _ in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (x, y) in enumerate(seqs):
        ids[i, : len(x)] = x
        labels[i, : len(y)] = y
    return {"input_ids": ids, "labels": labels}


def make_window(lengths: list[list[int]], seed: int = 0):
    """Micro-batches from per-micro-batch lists of sequence lengths, and all sequences."""
    gen = torch.Generator().manual_seed(seed)
    per_mb = [[make_seq(n, gen) for n in mb] for mb in lengths]
    return [collate(mb) for mb in per_mb], [s for mb in per_mb for s in mb]


def loss_fn(model: nn.Module, mb: dict[str, torch.Tensor]) -> gradstep.LossSum:
    return gradstep.token_loss(model(mb["input_ids"]), mb["labels"])


def reference_grads(model: nn.Module, seqs) -> tuple[list[torch.Tensor], float]:
    """The plain way: one batch holding every item, mean over all non-ignored tokens."""
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    batch = collate(seqs)
    logits = ref(batch["input_ids"])
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), batch["labels"].reshape(-1), ignore_index=-100
    )
    loss.backward()
    return [p.grad.detach().clone() for p in ref.parameters()], float(loss.detach())


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def rel_err(a, b) -> float:
    a, b = flat(a).detach().double(), flat(b).detach().double()
    return float((a - b).norm() / b.norm())


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer):
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = copy.deepcopy(optimizer.state_dict())
    return params, opt


def assert_bitwise_equal(a, b) -> None:
    """Recursive bitwise equality of nested dicts/lists of tensors and numbers."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b), "tensors differ"
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_bitwise_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_bitwise_equal(x, y)
    else:
        assert a == b
