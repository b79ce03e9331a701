"""``--loss-chunk-tokens N`` (issue 31 §2): checked as an int >= 0 with an error naming the
flag, on by default (the library's chunk, in training and evaluation), and what the run's
loss function, its evaluation and the demo GPT's shape get from it. The runs themselves:
tests/integration/cli/test_chunked_loss_runs.py."""

from __future__ import annotations

import pytest
import torch

from gradstep.step.loss import CHUNK_TOKENS
from gradstep_cli.config.settings import ConfigError, TrainConfig
from gradstep_cli.models.hf import HFLoss, gpt_config
from gradstep_cli.run.components import GPTLoss, loss_for
from gradstep_cli.run.evaluation import LMLoss

CPU = torch.device("cpu")


def test_the_library_s_chunk_is_the_default() -> None:
    assert TrainConfig().loss_chunk_tokens == CHUNK_TOKENS
    cfg = TrainConfig(loss_chunk_tokens=CHUNK_TOKENS)
    assert gpt_config(cfg).loss_chunk_tokens == 1024
    assert isinstance(loss_for(cfg, CPU)[0], GPTLoss)


def test_zero_turns_it_off() -> None:
    cfg = TrainConfig(loss_chunk_tokens=0)
    assert gpt_config(cfg).loss_chunk_tokens is None
    assert isinstance(loss_for(cfg, CPU)[0], LMLoss)


@pytest.mark.parametrize("bad", [-1, -1024])
def test_a_negative_chunk_is_refused_naming_the_flag(bad: int) -> None:
    with pytest.raises(ConfigError, match=r"--loss-chunk-tokens must be >= 0, got -"):
        TrainConfig(loss_chunk_tokens=bad)


@pytest.mark.parametrize("bad", ["many", 1.5, True])
def test_a_non_integer_chunk_is_refused_naming_the_flag(bad: object) -> None:
    with pytest.raises(ConfigError, match="loss.chunk.tokens"):
        TrainConfig(loss_chunk_tokens=bad)


def test_an_hf_run_passes_its_chunk_to_the_loss(tmp_path) -> None:
    cfg = TrainConfig(model=f"hf:{tmp_path}", loss_chunk_tokens=64)
    loss_fn, count = loss_for(cfg, CPU)
    assert isinstance(loss_fn, HFLoss) and loss_fn.chunk_tokens == 64 and count is not None
