"""`gradstep_cli.config.preflight.check_run`: what train refuses before it builds anything, and
`gradstep plan` refusing exactly the same (robustness-2 rows N124, N125, N127; memory-2
"global batch 15 on 2 ranks")."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gradstep.parallel import DistEnv
from gradstep_cli.cli import main
from gradstep_cli.config.preflight import check_global_batch, check_run
from gradstep_cli.config.settings import ConfigError, TrainConfig
from gradstep_cli.data.batching import layout_for

CPU = torch.device("cpu")


def env(world: int = 1, backend: str | None = None) -> DistEnv:
    return DistEnv(rank=0, world_size=world, local_rank=0, device=CPU, backend=backend)


SMALL = [
    "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16",
    "--micro-batch-size", "2", "--accum-steps", "2", "--eval-batches", "1",
    "--sample-tokens", "0", "--warmup", "1", "--eval-every", "0", "--max-steps", "2",
]  # fmt: skip


@pytest.fixture
def small_corpus(tmp_path: Path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    gen = random.Random(0)
    for i in range(4):
        (folder / f"f{i}.py").write_text(" ".join(gen.choices(["def", "x", "(y)"], k=400)))
    return folder


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def mesh_env(world: int) -> DistEnv:
    return DistEnv(rank=0, world_size=world, local_rank=0, device=CPU, backend="gloo")


@given(global_batch=st.integers(1, 300), world=st.integers(1, 16))
def test_a_global_batch_is_accepted_iff_every_rank_gets_the_same_nonempty_share(
    global_batch: int, world: int
) -> None:
    """The rule against its definition, and against the layout train builds from it."""
    cfg = TrainConfig(global_batch=global_batch, micro_batch_size=3)
    splits = global_batch % world == 0  # the definition: equal shares, each >= 1 (gb >= 1)
    launch = env(world, "gloo" if world > 1 else None)
    strategy = "ddp" if world > 1 else "none"
    run = TrainConfig(
        global_batch=global_batch, micro_batch_size=3, strategy=strategy, eval_batches=world
    )
    if splits:
        check_global_batch(global_batch, world)
        check_run(run, launch)
        check_run(run, launch, planning=True)
        layout = layout_for(cfg, world)  # train's layout of the same batch
        assert layout.rows_per_rank * world == global_batch and layout.rows_per_rank >= 1
        return
    for check in (
        lambda: check_global_batch(global_batch, world),
        lambda: check_run(run, launch),
        lambda: check_run(run, launch, planning=True),
        lambda: layout_for(cfg, world),  # train refuses it too, wherever it is checked
    ):
        with pytest.raises(ConfigError, match="must be a multiple of the number of ranks"):
            check()


def test_the_global_batch_message_names_the_flag_and_near_values() -> None:
    with pytest.raises(ConfigError) as exc:
        check_global_batch(15, 2)
    assert str(exc.value) == (
        "--global-batch (15) must be a multiple of the number of ranks (2): every rank takes "
        "the same number of sequences per step; use e.g. 14 or 16"
    )
    with pytest.raises(ConfigError, match=r"\(1\) .* use e\.g\. 4$"):
        check_global_batch(1, 4)  # fewer sequences than ranks


@pytest.mark.parametrize(
    ("settings", "launch", "needle"),
    [
        ({}, env(2, "gloo"), "launched as 2 processes but strategy='none'"),
        ({"strategy": "ddp"}, env(1), "strategy='ddp' needs a torchrun launch"),
        ({"strategy": "fsdp"}, env(1), "--strategy fsdp"),
        ({"strategy": "ddp", "eval_batches": 1}, env(2, "gloo"), "--eval-batches must be >="),
        ({"strategy": "ddp", "eval_batches": 3, "global_batch": 10}, env(3, "gloo"), "(10)"),
    ],
)
def test_launch_refusals(settings: dict, launch: DistEnv, needle: str) -> None:
    cfg = TrainConfig(**settings)
    for planning in (False, True):
        with pytest.raises(ConfigError) as exc:
            check_run(cfg, launch, planning=planning)
        assert needle in str(exc.value)


def test_devices_this_machine_lacks_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    cuda = DistEnv(0, 1, 0, torch.device("cuda", 0), None)
    with pytest.raises(ConfigError, match="device='cuda': this torch build or machine has no"):
        check_run(TrainConfig(device="cuda"), cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"device='cuda:1': only 1 CUDA device\(s\) here"):
        check_run(TrainConfig(device="cuda:1"), DistEnv(0, 1, 0, torch.device("cuda", 1), None))
    mps = DistEnv(0, 1, 0, torch.device("mps"), None)
    with pytest.raises(ConfigError, match="MPS is not available"):
        check_run(TrainConfig(device="mps"), mps)


def test_planning_needs_the_batch_it_splits_and_takes_hf_models(tmp_path) -> None:
    """A plan needs the global batch it splits. An HF model is planned like the demo GPT
    (issue 21: the probe runs it, the analytic model reads its config), so neither `plan`
    nor `train --micro-batch-size auto` / `--activation-checkpointing` refuses it."""
    hf = TrainConfig(model=f"hf:{tmp_path}", global_batch=8)
    check_run(hf, env())
    check_run(hf, env(), planning=True)
    auto = TrainConfig(model=f"hf:{tmp_path}", global_batch=8, micro_batch_size="auto")
    check_run(auto, env(), planning=True)
    TrainConfig(model=f"hf:{tmp_path}", activation_checkpointing=True)
    check_run(TrainConfig(), env())
    for cfg in (TrainConfig(), TrainConfig(model=f"hf:{tmp_path}")):
        with pytest.raises(ConfigError, match="gradstep plan needs --global-batch"):
            check_run(cfg, env(), planning=True)


def test_strategy_without_torchrun_fails_clearly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--strategy", "ddp", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "strategy" in err and "torchrun" in err


def test_mps_absent_is_a_clear_error(small_corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("torch.backends.mps.is_available", lambda: False)
    code, err = run(capsys, "train", *SMALL, "--data", str(small_corpus),
                    "--out", str(tmp_path / "r"), "--device", "mps")  # fmt: skip
    assert code == 2 and "MPS is not available" in err  # row 23


def test_eval_batches_below_the_world_size_is_an_error():
    """Row 126: with --eval-batches 1 on 2 ranks every validation loss was NaN."""
    import torch

    from gradstep.parallel import DistEnv
    from gradstep_cli.config.preflight import check_run
    from gradstep_cli.config.settings import ConfigError, TrainConfig

    env = DistEnv(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"), backend="gloo")
    with pytest.raises(ConfigError, match=r"--eval-batches must be >= the number of ranks \(2\)"):
        check_run(TrainConfig(strategy="ddp", eval_batches=1), env)
    check_run(TrainConfig(strategy="ddp", eval_batches=2), env)


def test_the_launch_must_hold_the_mesh() -> None:
    """--tp / --hsdp divide the ranks; --eval-batches and --global-batch count the ranks
    that read different data: the data-parallel ones under --tp, every rank under --hsdp."""
    with pytest.raises(ConfigError, match=re.escape("--tp 4 must divide the number of ranks (6)")):
        check_run(TrainConfig(strategy="fsdp", tp=4, eval_batches=8), mesh_env(6))
    with pytest.raises(
        ConfigError, match=re.escape("--hsdp 4 must divide the number of ranks (6)")
    ):
        check_run(TrainConfig(strategy="fsdp", hsdp=4, eval_batches=8), mesh_env(6))
    check_run(TrainConfig(strategy="fsdp", tp=2, eval_batches=2, global_batch=6), mesh_env(4))
    with pytest.raises(ConfigError, match="--eval-batches must be >= the number of ranks"):
        check_run(TrainConfig(strategy="fsdp", hsdp=2, eval_batches=2), mesh_env(4))
    with pytest.raises(ConfigError, match=re.escape("number of data-parallel ranks (2)")):
        check_run(TrainConfig(strategy="fsdp", tp=2, global_batch=5), mesh_env(4))
