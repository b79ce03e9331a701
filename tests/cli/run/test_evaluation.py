"""Validation loss (gradstep_cli.run.evaluation): the training loss's definition, token-weighted."""

from __future__ import annotations

import pytest
import torch

from gradstep_cli.data.sources import collate
from gradstep_cli.models.gpt import GPT, GPTConfig
from gradstep_cli.train import evaluate


def test_evaluate_is_token_weighted() -> None:
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, max_seq_len=16))
    batches = [collate([b"abcdefghij", b"ab"]), collate([b"xyz"])]
    logits = [model(b["input_ids"]) for b in batches]
    per_token = torch.cat(
        [
            torch.nn.functional.cross_entropy(
                lg.flatten(0, 1), b["labels"].flatten(), reduction="none"
            )[b["labels"].flatten() != -100]
            for lg, b in zip(logits, batches, strict=True)
        ]
    )
    assert per_token.numel() == 9 + 1 + 2
    assert evaluate(model, batches, torch.device("cpu")) == pytest.approx(per_token.mean().item())
