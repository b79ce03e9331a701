"""`gradstep plan` refuses exactly what `gradstep train` refuses, with the same message and
before anything is probed (robustness-2 N124, N125, N127; memory-2 "global batch 15 on 2
ranks"), and `plan --json` reports errors as JSON (N133).

Two ranks are simulated by the launch description ``parallel.init`` returns: every refusal
here is decided from it before any collective (the real 2-rank launch is in
test_torchrun_launch.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gradstep import parallel
from gradstep_cli.cli import main
from gradstep_cli.plan import planning
from tests.support.batches import text_corpus

MODEL = ["--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16"]
RUN = [*MODEL, "--micro-batch-size", "2", "--accum-steps", "2", "--eval-batches", "2",
       "--sample-tokens", "0", "--warmup", "1", "--eval-every", "0",
       "--max-steps", "2"]  # fmt: skip
PREFIX = {cmd: f"gradstep {cmd}: error: " for cmd in ("train", "plan")}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return text_corpus(tmp_path_factory.mktemp("data") / "corpus")


@pytest.fixture
def no_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planning at all is a failure here: every case must be refused before the probe."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("planned (probed) a run that must be refused first")

    monkeypatch.setattr(planning, "plan_run", refuse)


def launched_as(monkeypatch: pytest.MonkeyPatch, world: int) -> None:
    """``parallel.init`` describes a ``world``-rank torchrun launch (rank 0, gloo)."""
    env = parallel.DistEnv(0, world, 0, torch.device("cpu"), "gloo")
    monkeypatch.setattr(parallel, "init", lambda *a, **k: env)


def error_of(capsys: pytest.CaptureFixture[str], command: str) -> tuple[str, str]:
    """(the message of the one error line on stderr, stdout)."""
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err, captured.err
    lines = [line for line in captured.err.splitlines() if line.startswith(PREFIX[command])]
    assert len(lines) == 1, captured.err
    return lines[0][len(PREFIX[command]) :], captured.out


CASES = [  # (world, flags, a part of the message)
    (1, ["--strategy", "ddp"], "strategy='ddp' needs a torchrun launch"),
    (1, ["--device", "cuda"], "has no CUDA"),
    (2, ["--global-batch", "8"], "launched as 2 processes but strategy='none'"),
    (2, ["--strategy", "ddp", "--eval-batches", "1"], "--eval-batches must be >= the number"),
    (2, ["--strategy", "ddp", "--global-batch", "7"], "--global-batch (7) must be a multiple"),
    (2, ["--strategy", "fsdp", "--global-batch", "15"], "use e.g. 14 or 16"),
    # N125: train planned (probed, printed a choice) before refusing the same batch.
    (2, ["--strategy", "ddp", "--global-batch", "7", "--micro-batch-size", "auto"], "(7)"),
]


@pytest.mark.parametrize(("world", "flags", "needle"), CASES)
def test_plan_refuses_what_train_refuses_with_the_same_message_before_probing(
    corpus, tmp_path, capsys, monkeypatch, no_probe, world, flags, needle
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if world > 1:
        launched_as(monkeypatch, world)
    out = tmp_path / "run"
    batch = [] if "--global-batch" in flags else ["--global-batch", "8"]
    budget = ["--memory-budget", "4GiB"]
    train = ["train", *RUN, "--data", str(corpus), "--out", str(out), *budget, *flags]
    assert main(train) == 2
    trained, _ = error_of(capsys, "train")
    assert not out.exists()  # refused before the run folder was made
    for probe in ([], ["--no-probe"]):
        assert main(["plan", *MODEL, *batch, *budget, *probe, *flags]) == 2
        planned, stdout = error_of(capsys, "plan")
        assert planned == trained and needle in planned, (planned, trained)
        assert stdout == ""  # no table, no "chosen:"


@pytest.mark.parametrize("probe", [[], ["--no-probe"]])
def test_plan_refuses_a_bad_hf_folder_as_train_auto_does(tmp_path, capsys, probe):
    """N127 was `plan --model hf:` planning the demo GPT; now an HF model is planned, and a
    folder without a model is refused by both with the same message."""
    model = f"hf:{tmp_path}"  # no config.json: nothing to plan
    args = ["--model", model, "--global-batch", "8", "--memory-budget", "4GiB"]
    auto = ["--micro-batch-size", "auto", "--out", str(tmp_path / "run")]
    assert main(["train", *args, *auto]) == 2
    trained, _ = error_of(capsys, "train")
    assert main(["plan", *args, *probe]) == 2
    planned, stdout = error_of(capsys, "plan")
    assert "config.json" in trained and planned == trained and stdout == ""


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--global-batch", "8", "--memory-budget", "1KiB"], "memory budget"),  # after probing
        (["--global-batch", "8", "--strategy", "ddp"], "needs a torchrun launch"),  # preflight
        (["--memory-budget", "1GiB"], "needs --global-batch"),
    ],
)
def test_plan_json_errors_are_one_json_object_on_stdout(capsys, flags, needle):
    assert main(["plan", *MODEL, *flags, "--json"]) == 2
    message, stdout = error_of(capsys, "plan")
    assert needle in message
    assert stdout.count("\n") == 1 and json.loads(stdout) == {"error": message}
    assert main(["plan", *MODEL, *flags]) == 2  # without --json: stderr only
    again, stdout = error_of(capsys, "plan")
    assert needle in again and stdout == ""


def test_plan_json_usage_errors_are_json_too(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", *MODEL, "--global-batch", "8", "--precision", "fp99", "--json"])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    message = captured.err.strip().splitlines()[-1].removeprefix(PREFIX["plan"])
    assert "--precision" in message and "fp32" in message  # names the flag and the choices
    assert json.loads(captured.out) == {"error": message}
    with pytest.raises(SystemExit):  # a later call without --json: no stale JSON
        main(["plan", *MODEL, "--precision", "fp99"])
    assert capsys.readouterr().out == ""


def test_a_plan_that_train_accepts_still_plans(capsys):
    assert main(["plan", *MODEL, "--global-batch", "6", "--memory-budget", "4GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["global_batch"] == 6 and "error" not in plan
