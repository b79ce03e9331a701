"""The command line (gradstep_cli.cli): `gradstep train` end to end on the default corpus
with a tiny model; every user mistake one line ``gradstep COMMAND: error: ...`` and exit
status 2, a machine's failure one line naming the file and status 1; `gradstep plan`
refusing exactly what `train` refuses, with the same message and before anything is
probed (robustness-2 N124, N125, N127; N133: `plan --json` errors as JSON)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from gradstep import parallel
from gradstep_cli.cli import main
from gradstep_cli.plan import planning
from tests.support.batches import text_corpus

TINY = [
    "--n-layer", "1", "--n-head", "2", "--d-model", "32", "--seq-len", "32",
    "--micro-batch-size", "2", "--accum-steps", "2", "--eval-batches", "2",
    "--sample-tokens", "8", "--warmup", "1",
]  # fmt: skip


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


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


def _train_under_file_size_limit(limit: int, *argv: str) -> tuple[int, str, list[str]]:
    """``gradstep train argv`` in a child whose files may not grow past ``limit`` bytes
    (RLIMIT_FSIZE: EFBIG, as under ``ulimit -f``): (exit status, stderr, its error lines)."""
    import os
    import resource
    import subprocess
    import sys

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    cmd = [sys.executable, "-m", "gradstep", "train", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=140, env=env, preexec_fn=limited
    )
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    return proc.returncode, proc.stderr, errors


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

    monkeypatch.setattr(planning, "plan_for", refuse)


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


def test_cli_reports_config_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--clip", "bogus", "--out", str(tmp_path)]) == 2
    assert "clip" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # argparse rejects choices itself
        main(["train", "--precision", "fp8"])
    assert exc.value.code == 2
    assert "precision" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("case", "flags", "needle"),
    [
        ("8 lr inf", ["--lr", "inf"], "--lr must be a finite number"),
        ("7 lr nan", ["--lr", "nan"], "lr must be"),
        ("9 weight decay inf", ["--weight-decay", "inf"], "--weight-decay must be a finite"),
        ("9 weight decay nan", ["--weight-decay", "nan"], "--weight-decay must be a finite"),
        ("11 warmup above max steps", ["--warmup", "100"], "--warmup must be <= --max-steps"),
        ("22 cuda absent", ["--device", "cuda"], "no CUDA"),
        ("24 malformed device", ["--device", "cuda:abc"], "--device must be one of"),
        ("24 empty device index", ["--device", "cuda:"], "--device must be one of"),
        ("28 negative seed", ["--seed=-1"], "--seed must be in [0, 2**32)"),
        ("29 huge seed", ["--seed", "99999999999999999999999"], "--seed must be in [0, 2**32)"),
        ("35 empty out", ["--out", ""], "--out must name a run folder"),
        ("O55 negative lr, no =", ["--lr", "-1e-3"], "--lr must be in (0, 1e+06], got -0.001"),
        ("O55 negative seed, no =", ["--seed", "-1"], "--seed must be in [0, 2**32)"),
    ],
)
def test_bad_flags_are_one_clear_error(small_corpus, tmp_path, capsys, case, flags, needle):
    argv = ["train", *SMALL, "--data", str(small_corpus), "--out", str(tmp_path / "run"), *flags]
    code, err = run(capsys, *argv)
    assert code == 2 and needle in err, (case, err)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    ("error", "needles"),
    [
        (OSError(27, "File too large", "/runs/r/metrics.jsonl"), ["'/runs/r/metrics.jsonl'",
                                                                "ulimit -f", "--resume"]),
        (OSError(28, "No space left on device", "/runs/r/ck/model.safetensors"),
         ["'/runs/r/ck/model.safetensors'", "the disk is full", "--out"]),
        (OSError(18, "Invalid cross-device link", "/a", None, "/b"), ["'/a' -> '/b'"]),
        (OSError(5, "Input/output error"), ["Input/output error"]),
    ],
)  # fmt: skip
def test_an_os_error_is_one_line_naming_the_file(capsys, monkeypatch, error, needles):
    """N119: a full disk printed `[Errno 27] File too large`, not the file nor what to do.
    Failures of the machine keep exit status 1 (user mistakes: 2)."""
    from gradstep_cli import train as cli_train

    def fail(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(cli_train, "train", fail)
    code, err = run(capsys, "train", *SMALL)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("gradstep train: error: ")
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_real_file_size_limit_during_the_metrics_write_names_the_file(small_corpus, tmp_path):
    """N119 for real: RLIMIT_FSIZE (EFBIG, as `ulimit -f`) hit by metrics.jsonl."""
    out = tmp_path / "run"
    flags = [a if a != "2" or i != SMALL.index("--max-steps") + 1 else "40"
             for i, a in enumerate(SMALL)]  # fmt: skip
    # 4096 bytes: config.json fits; metrics.jsonl reaches it within a few steps.
    code, stderr, errors = _train_under_file_size_limit(
        4096, *flags, "--accum-steps", "1", "--data", str(small_corpus), "--out", str(out)
    )
    assert code == 1 and "Traceback" not in stderr, stderr
    assert len(errors) == 1 and str(out / "metrics.jsonl") in errors[0], stderr
    assert "ulimit -f" in errors[0]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_real_file_size_limit_during_a_checkpoint_names_the_file(small_corpus, tmp_path):
    """N117: the same limit hit by a checkpoint's tensor file: one line naming that file and
    what to do, exit status 1 like any failure of the machine, no checkpoint published."""
    out = tmp_path / "run"
    # 8192 bytes: config.json and the metrics fit; the model's tensors (> 16 KiB) do not.
    code, stderr, errors = _train_under_file_size_limit(
        8192, *SMALL, "--save-every", "1", "--data", str(small_corpus), "--out", str(out)
    )
    assert code == 1 and "Traceback" not in stderr, stderr
    assert len(errors) == 1 and "checkpoint of step 1 not saved" in errors[0], stderr
    assert ".safetensors" in errors[0] and "ulimit -f" in errors[0], errors[0]
    assert not list((out / "checkpoints").glob("step-*")), "a partial checkpoint was published"


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
