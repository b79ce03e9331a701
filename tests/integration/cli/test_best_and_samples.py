"""--keep-best, --early-stopping-patience, `gradstep export --best` and --sample-prompts, end
to end on a tiny local Llama (tests/support/hf_assets.py).

AdamW at a learning rate far too high makes the validation loss rise after the first steps,
so the best checkpoint is an early one and the run stops early; every evaluation row of
metrics.jsonl, best.json, the kept checkpoints and the exported weights must agree.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from gradstep_cli.cli import main  # noqa: E402
from tests.cli.test_sft import chats, pairs, write_jsonl  # noqa: E402
from tests.support import hf_assets  # noqa: E402

FLAGS = [
    "--seq-len", "64", "--micro-batch-size", "2", "--accum-steps", "2", "--warmup", "0",
    "--optimizer", "adamw", "--clip", "none", "--weight-decay", "0", "--save-every", "100",
    "--keep-checkpoints", "1", "--sample-tokens", "6", "--device", "cpu",
]  # fmt: skip


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    tmp = tmp_path_factory.mktemp("best")
    base = hf_assets.model_dir(tmp / "base", "llama", seed=0)
    train = write_jsonl(tmp / "train.jsonl", pairs(8))
    val = write_jsonl(tmp / "val.jsonl", pairs(3, offset=40))
    prompts = write_jsonl(tmp / "prompts.jsonl", ["def scale(x):", chats(1)[0]])
    argv = ["train", *FLAGS, "--model", f"hf:{base}", "--data", str(train)]
    return tmp, [*argv, "--val-data", str(val), "--sample-prompts", str(prompts)]


def test_best_checkpoint_early_stop_resume_and_export(
    setup: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    tmp, argv = setup
    out = tmp / "run"
    flags = ["--lr", "1", "--max-steps", "12", "--eval-every", "1", "--keep-best", "val_loss"]
    flags += ["--early-stopping-patience", "2", "--sample-every", "2"]
    assert main([*argv, *flags, "--out", str(out)]) == 0
    err = capsys.readouterr().err
    rows = _rows(out)
    evals = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    finite = [(s, v) for s, v in evals if v is not None]
    best_step, best_value = min(finite, key=lambda sv: sv[1])
    assert len(rows) < 12 and "stopping early" in err  # stopped: 2 evaluations after the best
    assert [s for s, _ in evals][-1] == best_step + 2 == len(rows)
    best = json.loads((out / "checkpoints" / "best.json").read_text())
    assert best == {"metric": "val_loss", "value": best_value, "step": best_step,
                    "checkpoint": f"step-{best_step:06d}"}  # fmt: skip
    kept = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    assert kept == sorted({f"step-{best_step:06d}", f"step-{len(rows):06d}"})  # keep 1 + best
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_early"] and summary["best"]["step"] == best_step
    # Samples: step 0, every 2nd step, and the last; both prompts each time.
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    steps = sorted({s["step"] for s in samples})
    assert steps == sorted({0, *range(2, len(rows) + 1, 2), len(rows)})
    assert all(s["tokens"] <= 6 and s["stop"] in ("eos", "length") for s in samples)
    assert [s["index"] for s in samples if s["step"] == 0] == [0, 1]
    assert "step 0: sample 2: " in err

    # A resume knows the run stopped early: nothing trains, nothing changes.
    before = (out / "metrics.jsonl").read_text()
    assert main(["train", "--resume", "--out", str(out)]) == 0
    assert "the run stopped early" in capsys.readouterr().err
    assert (out / "metrics.jsonl").read_text() == before

    # export --best writes the best checkpoint's weights; the newest differs.
    assert main(["export", str(out), "--best", "--out", str(tmp / "best")]) == 0
    assert main(["export", str(out), "--out", str(tmp / "newest")]) == 0
    record = json.loads((tmp / "best" / "gradstep_export.json").read_text())
    assert record["step"] == best_step
    got, newest = (load_file(tmp / n / "model.safetensors") for n in ("best", "newest"))
    assert any(not torch.equal(got[k], newest[k]) for k in got)
    assert main(["export", str(out), "--best", "--step", "1", "--out", str(tmp / "x")]) == 2
    assert "--best exports the best checkpoint" in capsys.readouterr().err


def test_keep_best_without_improvement_keeps_its_first_evaluation(
    setup: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    """--keep-best val_accuracy (higher is better), no --save-every: checkpoints are saved
    only where the metric improved, plus the final one; the resumed run keeps protecting
    the best from pruning and knows it."""
    tmp, argv = setup
    out = tmp / "acc"
    flags = ["--lr", "1e-3", "--max-steps", "2", "--eval-every", "1", "--save-every", "0"]
    assert main([*argv, *flags, "--keep-best", "val_accuracy", "--out", str(out)]) == 0
    rows = _rows(out)
    accs = [r["val_accuracy"] for r in rows]
    best = json.loads((out / "checkpoints" / "best.json").read_text())
    assert best["value"] == max(accs) and best["step"] == 1 + accs.index(max(accs))
    assert main(["train", "--resume", "--max-steps", "4", "--out", str(out)]) == 0
    kept = {p.name for p in (out / "checkpoints").glob("step-*")}
    after = json.loads((out / "checkpoints" / "best.json").read_text())
    accs = [r["val_accuracy"] for r in _rows(out)]
    assert after["value"] == max(accs) and f"step-{after['step']:06d}" in kept
    assert "step-000004" in kept


def test_eval_batches_is_a_stated_sample(
    setup: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    tmp, argv = setup
    out = tmp / "sample"
    flags = ["--lr", "1e-3", "--max-steps", "1", "--eval-batches", "1", "--sample-tokens", "0"]
    argv = [a for a in argv if not a.endswith("prompts.jsonl") and a != "--sample-prompts"]
    assert main([*argv, *flags, "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "validation scores a sample of 2 of the 3 validation sequences" in err
    assert _rows(out)[-1]["val_records"] == 2
