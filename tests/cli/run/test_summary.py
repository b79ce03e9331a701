"""The end of a run (gradstep_cli.run.summary): the sample, encoded and decoded with the run's
tokenizer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from gradstep_cli.config.settings import TrainConfig  # noqa: E402
from gradstep_cli.run import summary  # noqa: E402
from tests.support import hf_assets  # noqa: E402

TEXT = "def area(r):\n    return 3.14159 * r ** 2  # <|endoftext|> stays text\n"


def _ids(tokenizer, text: str = TEXT) -> list[int]:
    return tokenizer(text)["input_ids"]


class _Spike(torch.nn.Module):
    """An HF-like model whose next token is always ``token``; records the contexts it saw."""

    def __init__(self, vocab: int, token: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.vocab, self.token, self.seen = vocab, token, []

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> SimpleNamespace:
        self.seen.append(input_ids[0].tolist())
        logits = torch.full((*input_ids.shape, self.vocab), -1e4)
        logits[..., self.token] = 0.0
        return SimpleNamespace(logits=logits + self.w)


def _run(model: torch.nn.Module, tokenizer, n: int = 3) -> SimpleNamespace:
    cfg = TrainConfig(model="hf:unused", seq_len=32, sample_tokens=n)
    return SimpleNamespace(cfg=cfg, model=model, tokenizer=tokenizer)


def test_the_sample_is_encoded_and_decoded_with_the_tokenizer() -> None:
    tokenizer = hf_assets.load_tokenizer()
    token = _ids(tokenizer, " return")
    assert len(token) == 1  # one BPE token (not one byte): decoding it proves the tokenizer
    model = _Spike(hf_assets.VOCAB, token[0])
    assert summary._sample(_run(model, tokenizer)) == " return" * 3
    assert model.seen[0] == _ids(tokenizer, summary.SAMPLE_PROMPT.decode())
    # Without a tokenizer an HF model reads and writes bytes; ids past 255 are no byte.
    assert summary._sample(_run(_Spike(hf_assets.VOCAB, ord("x")), None)) == "xxx"
    assert summary._sample(_run(_Spike(hf_assets.VOCAB, 300), None, 2)) == "\ufffd\ufffd"
    model = _Spike(hf_assets.VOCAB, ord("y"))
    summary._sample(_run(model, None, 40))  # prompt + 40 > --seq-len 32: the context is cut
    assert max(len(seen) for seen in model.seen) == 32
