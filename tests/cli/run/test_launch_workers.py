"""``--nproc-per-node`` without starting a process: its settings, the checks made once before
any worker starts, torchrun's command line, and the one line a failed launch ends in."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from gradstep_cli.config.preflight import check_before_launch
from gradstep_cli.config.settings import ConfigError, TrainConfig
from gradstep_cli.run import launch


def failure(exitcode: int, timestamp: int = 100, ours: dict | None = None) -> SimpleNamespace:
    """A torch ProcessFailure as worker_failure reads it."""
    data = {} if ours is None else {"gradstep": ours}
    message = f"Signal {-exitcode}" if exitcode < 0 else "To enable traceback see: ..."
    return SimpleNamespace(
        exitcode=exitcode, timestamp=timestamp, error_file_data=data, message=message
    )


def test_launch_settings_are_checked_when_the_config_is_built() -> None:
    with pytest.raises(ConfigError, match="--nnodes is an option of the launch"):
        TrainConfig(nnodes="2")
    for bad in ("0", "2:1", "x", "1:2:3"):
        with pytest.raises(ConfigError, match="--nnodes must be N or MIN:MAX"):
            TrainConfig(nproc_per_node=2, nnodes=bad)
    with pytest.raises(ConfigError, match="--nproc-per-node must be >= 1"):
        TrainConfig(nproc_per_node=0)
    with pytest.raises(ConfigError, match="--master-port must be in"):
        TrainConfig(nproc_per_node=2, master_port=70000)
    with pytest.raises(ConfigError, match="add --resume-or-start"):
        TrainConfig(nproc_per_node=2, max_restarts=1)
    assert TrainConfig(nproc_per_node=2, max_restarts=1, resume_or_start=True).max_restarts == 1


def test_torchruns_command_line_runs_gradstep_on_every_worker() -> None:
    cfg = TrainConfig(nproc_per_node=2, nnodes="1:2", rdzv_backend="c10d", rdzv_id="job")
    args = launch.torchrun_args(cfg, ["train", "--out", "x"])
    assert args[-5:] == ["--module", "gradstep", "train", "--out", "x"]
    assert "--nproc_per_node=2" in args and "--nnodes=1:2" in args and "--rdzv_id=job" in args
    assert not any(a.startswith("--master_port") for a in args)  # one node: a free port
    from torch.distributed import run as torchrun

    parsed = torchrun.get_args_parser().parse_args(args)
    assert (parsed.nproc_per_node, parsed.module, parsed.training_script) == ("2", True, "gradstep")
    assert launch.planned_launch(cfg) is None  # elastic: the world is known at rendezvous
    fixed = launch.planned_launch(TrainConfig(nproc_per_node=2, nnodes="3", device="cpu"))
    assert (fixed.world_size, fixed.backend) == (6, "gloo")


def test_the_flags_are_checked_once_before_any_worker(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="launched as 2 processes but strategy='none'"):
        plain = TrainConfig(nproc_per_node=2, out=str(out))
        check_before_launch(plain, frozenset(), planning=False)
    ddp = TrainConfig(nproc_per_node=2, strategy="ddp", device="cpu", global_batch=3, out=str(out))
    with pytest.raises(ConfigError, match="--global-batch .3. must be a multiple"):
        check_before_launch(ddp, frozenset(), planning=False)
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")
    held = TrainConfig(nproc_per_node=2, strategy="ddp", device="cpu", out=str(out))
    with pytest.raises(ConfigError, match="already holds a run"):
        check_before_launch(held, frozenset(), planning=False)
    overwrite = TrainConfig(nproc_per_node=2, strategy="ddp", device="cpu", out=str(out),
                            overwrite=True)  # fmt: skip
    check_before_launch(overwrite, frozenset(), planning=False)
    assert (out / "metrics.jsonl").exists()  # the check deletes nothing: the workers do
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match="under torchrun, drop it"):
        check_before_launch(overwrite, frozenset(), planning=False)


def test_a_failed_launch_is_one_line_naming_the_rank() -> None:
    error = {"message": "--data 'x': no such file or folder", "status": 2}
    same = {0: failure(2, ours={**error, "time": 5.0}), 1: failure(2, ours={**error, "time": 4.0})}
    assert launch.worker_failure(same) == (2, "ranks 0, 1: --data 'x': no such file or folder")
    one = {0: failure(-signal.SIGTERM), 1: failure(1, ours={"message": "boom", "status": 1,
                                                             "time": 9.0})}  # fmt: skip
    assert launch.worker_failure(one) == (1, "rank 1: boom")
    # A worker killed (SIGKILL: the OOM killer) is the cause, not the SIGTERM the launcher
    # sent the others, nor the collective error a survivor wrote about its lost peer.
    killed = {
        0: failure(1, timestamp=90, ours={"message": "a peer is gone", "status": 1, "time": 1}),
        1: failure(-signal.SIGKILL, timestamp=100),
        2: failure(-signal.SIGTERM, timestamp=99),
    }
    assert launch.worker_failure(killed) == (1, "rank 1: Signal 9")
    crashed = {0: failure(-signal.SIGTERM), 1: failure(3)}
    assert launch.worker_failure(crashed)[1] == (
        "rank 1 exited with status 3 (its output above says why)"
    )


def test_a_workers_error_goes_to_its_error_file(tmp_path: Path, monkeypatch) -> None:
    assert not launch.record_worker_error("nowhere", 2)  # no launcher: nothing written
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    monkeypatch.setenv("RANK", "1")
    assert launch.record_worker_error("--lr must be in (0, 1e+06]", 2)
    data = json.loads(path.read_text())
    assert data["message"] == "--lr must be in (0, 1e+06]" and isinstance(data["timestamp"], int)
    assert data["gradstep"]["status"] == 2 and data["gradstep"]["rank"] == "1"
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    read = ProcessFailure(local_rank=1, pid=1, exitcode=2, error_file=str(path))
    assert read.message == data["message"]  # torchrun's own summary shows the line
    assert launch.worker_failure({1: read}) == (2, "rank 1: --lr must be in (0, 1e+06]")
