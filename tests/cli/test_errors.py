"""User mistakes end with one clear message and a non-zero exit, never a traceback.

The cases are the TRACEBACK and SILENT WRONG rows of the robustness probe
(shared/reviews/robustness.md) that concern the command line; the row is in each id.
"""

from __future__ import annotations

import json
import pathlib
import random
from pathlib import Path

import pytest

from gradstep_cli.cli import main

SMALL = [
    "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16",
    "--micro-batch-size", "2", "--accum-steps", "2", "--eval-batches", "1",
    "--sample-tokens", "0", "--warmup", "1", "--eval-every", "0", "--max-steps", "2",
]  # fmt: skip


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
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
def test_bad_flags_are_one_clear_error(corpus, tmp_path, capsys, case, flags, needle):
    argv = ["train", *SMALL, "--data", str(corpus), "--out", str(tmp_path / "run"), *flags]
    code, err = run(capsys, *argv)
    assert code == 2 and needle in err, (case, err)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_mps_absent_is_a_clear_error(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("torch.backends.mps.is_available", lambda: False)
    code, err = run(capsys, "train", *SMALL, "--data", str(corpus), "--out", str(tmp_path / "r"),
                    "--device", "mps")  # fmt: skip
    assert code == 2 and "MPS is not available" in err  # row 23


def test_out_that_cannot_be_a_run_folder(corpus, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    base = ["train", *SMALL, "--data", str(corpus)]
    code, err = run(capsys, *base, "--out", str(afile))  # row 57
    assert code == 2 and "is not a folder" in err
    code, err = run(capsys, *base, "--out", str(afile / "sub"))  # row 58
    assert code == 2 and "cannot write the run folder" in err
    if Path("/sys").is_dir():  # row 59: read-only even for root (the tests run as root)
        code, err = run(capsys, *base, "--out", "/sys/gradstep-test-run")
        assert code == 2 and "cannot write the run folder" in err


def test_data_that_cannot_train(tmp_path, capsys, monkeypatch):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("hi")
    base = ["train", *SMALL, "--out", str(tmp_path / "run")]
    code, err = run(capsys, *base, "--data", str(tiny))  # row 51
    assert code == 2 and "micro-batches" in err and "use more data" in err
    assert "val_loss" not in err  # refused before any evaluation ran
    folder = tmp_path / "noperm"
    folder.mkdir()
    (folder / "a.txt").write_text("some text " * 100)
    real = pathlib.Path.read_bytes

    def unreadable(self: Path) -> bytes:
        if self.name == "a.txt":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(pathlib.Path, "read_bytes", unreadable)  # row 54 (root reads mode 000)
    code, err = run(capsys, *base, "--data", str(folder))
    assert code == 2 and "cannot read" in err and "a.txt" in err


def test_data_folder_with_glob_characters_and_late_nul_bytes(tmp_path, capsys):
    folder = tmp_path / "run[1]"  # row 55: an existing path is not a glob pattern
    folder.mkdir()
    (folder / "a.py").write_text("def f(x):\n    return x\n" * 400)
    binary = folder / "b.txt"  # row 56: NUL bytes after 8 KB mark a binary file
    binary.write_bytes(b"text " * 2000 + b"\x00" * 5000)
    from gradstep_cli.data.sources import load_corpus

    corpus = load_corpus(str(folder))
    assert {d.name.removesuffix("#val") for d in (*corpus.train, *corpus.val)} == {"a.py"}


@pytest.mark.parametrize(
    ("case", "content", "needle"),
    [
        ("41 a folder", None, "is a folder"),
        ("42 not UTF-8", b"\xff\xfe", "not UTF-8"),
        ("43 key spelled twice", b"max_steps = 3\nmax-steps = 4\n", "sets max_steps twice"),
        ("44 top level and [train]", b"max-steps = 3\n[train]\nmax-steps = 5\n", "twice"),
    ],
)
def test_bad_config_files(tmp_path, capsys, case, content, needle):
    path = tmp_path / "cfg.toml"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    code, err = run(capsys, "train", "--config", str(path), "--out", str(tmp_path / "r"))
    assert code == 2 and needle in err, (case, err)


def test_report_errors_and_overflowing_numbers(tmp_path, capsys):
    runs = tmp_path / "run"
    runs.mkdir()
    rows = [{"step": 1, "loss": 10**400, "grad_norm": 1.0}, {"step": 2, "loss": 1.0}]
    (runs / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, _ = run(capsys, "report", str(runs))  # row 87: a huge integer is not drawable
    assert code == 0 and (runs / "report" / "report.html").exists()
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, err = run(capsys, "report", str(runs), "--out", str(afile))  # row 89
    assert code == 2 and "cannot write the report" in err


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


def test_the_collective_timeout_reaches_the_process_group(tmp_path, capsys, monkeypatch):
    """Row 129: the CLI set no collective timeout, so a stuck rank meant 30 minutes of
    silence. The flag's value (default 600 s) is what init() gets."""
    from gradstep_cli import train as demo_train
    from gradstep_cli.config.settings import ConfigError

    seen = []

    def init(device=None, backend="auto", timeout_s=None):  # noqa: ANN001, ANN202
        seen.append(timeout_s)
        raise ConfigError("stop here")

    monkeypatch.setattr(demo_train.parallel, "init", init)
    out = ["--out", str(tmp_path / "r")]
    assert run(capsys, "train", *SMALL, *out, "--collective-timeout", "7")[0] == 2
    assert run(capsys, "train", *SMALL, *out)[0] == 2
    assert seen == [7.0, 600.0]


def _stuck_peer(rank: int, world: int) -> dict:
    """Rank 1 never joins the all-reduce: rank 0 must raise within the timeout."""
    import time

    import torch
    import torch.distributed as dist

    started = time.monotonic()
    outcome = "returned"
    if rank == 0:
        try:
            dist.all_reduce(torch.ones(1))
        except RuntimeError as exc:  # DistBackendError: gloo's timeout
            outcome = type(exc).__name__ + ": " + str(exc)[:200]
    else:
        time.sleep(5)
    dist.destroy_process_group()  # the group is broken: no barrier
    return {"outcome": outcome, "waited": time.monotonic() - started}


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_stuck_rank_ends_in_an_error_not_a_hang():
    from tests.support.multiproc import run_ranks

    first, _ = run_ranks(_stuck_peer, 2, timeout=40, collective_timeout_s=2)
    assert first["outcome"] != "returned" and first["waited"] < 4.5, first


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
    from gradstep_cli import train as demo_train

    def fail(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(demo_train, "train", fail)
    code, err = run(capsys, "train", *SMALL)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("gradstep train: error: ")
    for needle in needles:
        assert needle in lines[0], lines[0]


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


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_real_file_size_limit_during_the_metrics_write_names_the_file(corpus, tmp_path):
    """N119 for real: RLIMIT_FSIZE (EFBIG, as `ulimit -f`) hit by metrics.jsonl."""
    out = tmp_path / "run"
    flags = [a if a != "2" or i != SMALL.index("--max-steps") + 1 else "40"
             for i, a in enumerate(SMALL)]  # fmt: skip
    # 4096 bytes: config.json fits; metrics.jsonl reaches it within a few steps.
    code, stderr, errors = _train_under_file_size_limit(
        4096, *flags, "--accum-steps", "1", "--data", str(corpus), "--out", str(out)
    )
    assert code == 1 and "Traceback" not in stderr, stderr
    assert len(errors) == 1 and str(out / "metrics.jsonl") in errors[0], stderr
    assert "ulimit -f" in errors[0]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_real_file_size_limit_during_a_checkpoint_names_the_file(corpus, tmp_path):
    """N117: the same limit hit by a checkpoint's tensor file: one line naming that file and
    what to do, exit status 1 like any failure of the machine, no checkpoint published."""
    out = tmp_path / "run"
    # 8192 bytes: config.json and the metrics fit; the model's tensors (> 16 KiB) do not.
    code, stderr, errors = _train_under_file_size_limit(
        8192, *SMALL, "--save-every", "1", "--data", str(corpus), "--out", str(out)
    )
    assert code == 1 and "Traceback" not in stderr, stderr
    assert len(errors) == 1 and "checkpoint of step 1 not saved" in errors[0], stderr
    assert ".safetensors" in errors[0] and "ulimit -f" in errors[0], errors[0]
    assert not list((out / "checkpoints").glob("step-*")), "a partial checkpoint was published"
