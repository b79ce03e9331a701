"""Right-padded LM micro-batches: ``{"input_ids", "labels"}``, labels -100 past each row.

One ``collate`` builds every padded batch here: the TinyLM windows (``make_window``), the
multi-rank data of the distributed tests (``make_windows``) and the one big batch a
reference step takes (``concat``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import torch

from gradstep_cli.data.sources import IGNORE_INDEX, PAD_ID
from tests.support.models import TINY_GPT, VOCAB

Batch = dict[str, torch.Tensor]
Seq = tuple[torch.Tensor, torch.Tensor]  # (input ids, labels) of one row, unpadded


def collate(seqs: Sequence[Seq], pad_to: int | None = None, pad_id: int = PAD_ID) -> Batch:
    """Right-pad: inputs with ``pad_id``, labels with -100 (so padding carries no loss)."""
    width = pad_to or max(len(ids) for ids, _ in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), IGNORE_INDEX, dtype=torch.long)
    for i, (x, y) in enumerate(seqs):
        ids[i, : len(x)] = x
        labels[i, : len(y)] = y
    return {"input_ids": ids, "labels": labels}


def rows(batch: Batch) -> list[Seq]:
    """The rows of a batch, padding included (``collate`` of them is the batch again)."""
    return list(zip(batch["input_ids"], batch["labels"], strict=True))


def concat(batches: Sequence[Batch]) -> Batch:
    """One batch of all rows, right-padded to the widest (padding is ignored by the loss)."""
    return collate([row for b in batches for row in rows(b)])


# ------------------------------------------------------------------ TinyLM windows


def make_seq(length: int, gen: torch.Generator, ignore_frac: float = 0.2) -> Seq:
    ids = torch.randint(0, VOCAB, (length,), generator=gen)
    labels = torch.randint(0, VOCAB, (length,), generator=gen)
    mask = torch.rand(length, generator=gen) < ignore_frac
    labels[mask] = IGNORE_INDEX
    return ids, labels


def make_window(lengths: list[list[int]], seed: int = 0) -> tuple[list[Batch], list[Seq]]:
    """Micro-batches from per-micro-batch lists of sequence lengths, and all sequences."""
    gen = torch.Generator().manual_seed(seed)
    per_mb = [[make_seq(n, gen) for n in mb] for mb in lengths]
    return [collate(mb) for mb in per_mb], [s for mb in per_mb for s in mb]


# ------------------------------------------------------------ multi-rank (tiny GPT)


def _micro_batch(gen: torch.Generator, n_rows: int, lo: int, hi: int) -> Batch:
    """Rows of random lengths in [lo, hi] of next-token data for the tiny GPT."""
    lengths = torch.randint(lo, hi + 1, (n_rows,), generator=gen)
    ids = torch.randint(1, TINY_GPT.vocab_size, (n_rows, int(lengths.max()) + 1), generator=gen)
    return collate([(ids[r, :n], ids[r, 1 : n + 1]) for r, n in enumerate(lengths.tolist())])


def make_windows(steps: int, world: int, k: int, seed: int = 0) -> list[list[list[Batch]]]:
    """``data[step][rank]`` = that rank's k micro-batches; rank r gets longer sequences
    than rank r-1, so the ranks' token counts differ (rank 0 ~3 tokens/row, rank 1 ~9)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        per_rank = []
        for r in range(world):
            lo, hi = (2, 4) if r == 0 else (6, TINY_GPT.max_seq_len - 1)
            per_rank.append([_micro_batch(gen, 2 + (j + r) % 2, lo, hi) for j in range(k)])
        out.append(per_rank)
    return out


def text_corpus(folder: Path) -> Path:
    """A small, fixed folder of Python-like text files for ``gradstep train --data``: enough
    for tiny models to train a few steps, far faster to load than the default corpus."""
    folder.mkdir()
    gen = random.Random(0)
    words = ["def", "return", "self", "value", "for", "in", "if", "else", "None", "(x)"]
    for i in range(6):
        lines = [" ".join(gen.choices(words, k=8)) for _ in range(40)]
        (folder / f"f{i}.py").write_text("\n".join(lines) + "\n")
    return folder
