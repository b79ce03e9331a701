"""``--tp N`` and ``--hsdp R``: refused, naming the flag and what it takes, in the config
(any launch), at launch (the ranks they must divide) and by the CLI's train and plan (status
2, before anything runs); the batch split over the data-parallel ranks; the demo GPT's
head-major attention; the run folder's resume rules.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gradstep.parallel import DistEnv
from gradstep_cli.cli import main
from gradstep_cli.config.preflight import check_run
from gradstep_cli.config.settings import ConfigError, TrainConfig
from gradstep_cli.data.batching import layout_for
from gradstep_cli.models.gpt import GPT, GPTConfig, rotary_tables
from gradstep_cli.models.parallel_plan import data_rank, gpt_tp_plan
from gradstep_cli.run.folder import ENVIRONMENT

CPU = torch.device("cpu")


def env(world: int) -> DistEnv:
    return DistEnv(rank=0, world_size=world, local_rank=0, device=CPU, backend="gloo")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"tp": 2, "strategy": "ddp"}, "--tp 2 needs --strategy fsdp (FSDP2 on a 2-D mesh), "
         "got --strategy ddp"),
        ({"hsdp": 2}, "--hsdp 2 needs --strategy fsdp (FSDP2 on a 2-D mesh), got --strategy none"),
        ({"tp": 2, "hsdp": 2, "strategy": "fsdp"}, "--tp 2 and --hsdp 2 do not combine"),
        ({"tp": 0}, "--tp must be >= 1, got 0"),
        ({"hsdp": -1}, "--hsdp must be >= 1, got -1"),
        ({"tp": 3, "strategy": "fsdp"}, "--tp 3 must divide --n-head (4): each tensor-parallel "
         "rank holds whole heads; use --tp 1 or 2 or 4"),
        ({"tp": 2, "strategy": "fsdp", "dropout": 0.1}, "--dropout 0.1 with --tp 2 is not "
         "supported"),
        ({"tp": 2, "strategy": "fsdp", "model": "hf:/x"}, "--tp 2 needs --model gpt"),
    ],
)  # fmt: skip
def test_mesh_flags_are_refused_naming_the_flag(settings: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        TrainConfig(**settings)


@pytest.mark.parametrize("command", ["train", "plan"])
def test_train_and_plan_refuse_them_with_status_2(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([command, "--strategy", "ddp", "--tp", "2", "--global-batch", "4"]) == 2
    err = capsys.readouterr().err
    assert f"gradstep {command}: error: --tp 2 needs --strategy fsdp" in err, err


def test_the_launch_must_hold_the_mesh() -> None:
    """--tp / --hsdp divide the ranks; --eval-batches and --global-batch count the ranks
    that read different data: the data-parallel ones under --tp, every rank under --hsdp."""
    with pytest.raises(ConfigError, match=re.escape("--tp 4 must divide the number of ranks (6)")):
        check_run(TrainConfig(strategy="fsdp", tp=4, eval_batches=8), env(6))
    with pytest.raises(
        ConfigError, match=re.escape("--hsdp 4 must divide the number of ranks (6)")
    ):
        check_run(TrainConfig(strategy="fsdp", hsdp=4, eval_batches=8), env(6))
    check_run(TrainConfig(strategy="fsdp", tp=2, eval_batches=2, global_batch=6), env(4))
    with pytest.raises(ConfigError, match="--eval-batches must be >= the number of ranks"):
        check_run(TrainConfig(strategy="fsdp", hsdp=2, eval_batches=2), env(4))
    with pytest.raises(ConfigError, match=re.escape("number of data-parallel ranks (2)")):
        check_run(TrainConfig(strategy="fsdp", tp=2, global_batch=5), env(4))


@given(world=st.sampled_from([2, 4, 6, 8]), tp=st.sampled_from([1, 2]), rank=st.integers(0, 7))
def test_tensor_parallel_peers_read_one_data_rank(world: int, tp: int, rank: int) -> None:
    """Rank r of a (world / tp, tp) mesh, row-major, reads data rank r // tp: the tp ranks
    of a row share it, rows differ, and a global batch splits over the rows."""
    cfg = TrainConfig(strategy="fsdp", tp=tp, global_batch=world * 3)
    rank %= world
    mine, rows = data_rank(cfg, rank, world)
    assert rows == world // tp and 0 <= mine < rows
    assert mine == data_rank(cfg, rank - rank % tp, world)[0]  # its row's first rank
    layout = layout_for(cfg, rows)
    assert layout.rows_per_rank * rows == world * 3


def test_the_attention_is_head_major_so_a_row_shard_is_whole_heads() -> None:
    """The forward of the demo attention on one contiguous half of ``qkv``'s rows (and the
    matching half of ``proj``'s columns) is that half of the heads: the two halves sum to
    the whole attention, as a column-wise qkv and row-wise proj compute it."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=16, n_layer=1, n_head=4, d_model=16, max_seq_len=8)
    attn = GPT(cfg).double().blocks[0].attn
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    cos, sin = rotary_tables(8, cfg.head_dim, dtype=torch.float64)
    whole = attn(x, cos, sin)
    halves = []
    for part in range(2):
        half = type(attn)(cfg).double()
        rows, cols = slice(24 * part, 24 * (part + 1)), slice(8 * part, 8 * (part + 1))
        half.qkv.weight = torch.nn.Parameter(attn.qkv.weight[rows].clone())
        half.proj.weight = torch.nn.Parameter(attn.proj.weight[:, cols].clone())
        halves.append(half(x, cos, sin))
    torch.testing.assert_close(halves[0] + halves[1], whole, rtol=1e-12, atol=1e-12)
    assert set(gpt_tp_plan()) == {"attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"}


def test_the_mesh_is_where_a_run_runs_not_the_runs_setting() -> None:
    """A checkpoint of a --tp run resumes with any --tp (or none): the flags are this
    invocation's, like --strategy, and checkpoints do not record them as run settings."""
    assert {"tp", "hsdp", "strategy"} <= ENVIRONMENT
