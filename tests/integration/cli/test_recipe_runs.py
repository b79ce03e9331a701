"""Recipes end to end (issue 30 §1): the defaults that fit a pretrained model, said and
recorded; ``--epochs`` train every record of every epoch exactly once; ``--stop-after`` stops
a run without touching its schedule, and a resume continues it to the same curve. And what
every step measures (§4): peak memory against ``--memory-budget`` (said when near it), and
processed besides trained tokens per second on the progress line."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from gradstep_cli.cli import main as gradstep_main
from tests.cli.test_sft import pairs, write_jsonl
from tests.support import hf_assets
from tests.support.batches import text_corpus

SFT = ["--seq-len", "48", "--eval-batches", "1", "--eval-every", "0", "--sample-tokens", "0"]
BATCH = ["--micro-batch-size", "2", "--accum-steps", "2", "--val-fraction", "0.25"]
TOY = [
    "--device", "cpu", "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16",
    "--micro-batch-size", "2", "--accum-steps", "2", "--eval-batches", "1", "--eval-every", "0",
    "--sample-tokens", "0",
]  # fmt: skip


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf_assets.model_dir(tmp_path_factory.mktemp("hf") / "llama")


def rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize(("lora", "lr"), [([], 2e-5), (["--lora", "4"], 2e-4)])
def test_a_pretrained_model_trains_with_trls_defaults_and_says_so(
    tmp_path: Path, pretrained: Path, capsys, lora: list[str], lr: float
) -> None:
    data = write_jsonl(tmp_path / "train.jsonl", pairs(8))
    out = tmp_path / "run"
    args = ["train", "--model", f"hf:{pretrained}", "--data", str(data), *SFT, *BATCH, *lora]
    assert gradstep_main([*args, "--max-steps", "2", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    which = "fine-tuning with LoRA" if lora else "fine-tuning"
    assert f"{which} defaults (a pretrained model" in err, err
    assert "linear schedule to min-lr 0, no warm-up, weight decay 0, betas 0.9,0.999" in err
    assert "optimizer: AdamW, lr " in err and "betas (0.9, 0.999), eps 1e-08" in err
    config = json.loads((out / "config.json").read_text())
    assert (config["lr"], config["lr_schedule"], config["min_lr"], config["warmup"]) == (
        lr, "linear", 0.0, 0,
    )  # fmt: skip
    assert (config["weight_decay"], config["adam_betas"], config["adam_eps"]) == (
        0.0, "0.9,0.999", 1e-8,
    )  # fmt: skip
    done = summary(out)
    assert done["optimizer"]["class"] == "torch.optim.adamw.AdamW"
    assert done["optimizer"]["betas"] == [0.9, 0.999] and done["optimizer"]["eps"] == 1e-8
    assert done["lr_schedule"]["kind"] == "linear" and done["lr_schedule"]["peak_lr"] == lr
    assert [r["lr"] for r in rows(out)] == [lr, lr / 2]  # transformers' linear, no warm-up
    for record in rows(out):  # an SFT step processes its prompts and padding too
        assert record["processed_tokens"] > record["items"] > 0 and record["rss_mb"] > 0


def test_flags_win_over_the_defaults(tmp_path: Path, pretrained: Path) -> None:
    data = write_jsonl(tmp_path / "train.jsonl", pairs(8))
    out = tmp_path / "run"
    given = ["--lr", "5e-4", "--lr-schedule", "cosine", "--warmup", "0.5", "--adam-betas",
             "0.9,0.95", "--adam-eps", "1e-6", "--weight-decay", "0.01"]  # fmt: skip
    args = ["train", "--model", f"hf:{pretrained}", "--data", str(data), *SFT, *BATCH, *given]
    assert gradstep_main([*args, "--max-steps", "4", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["lr"], config["lr_schedule"], config["warmup"]) == (5e-4, "cosine", 0.5)
    assert (config["adam_betas"], config["adam_eps"], config["weight_decay"]) == (
        "0.9,0.95", 1e-6, 0.01,
    )  # fmt: skip
    assert [r["lr"] for r in rows(out)][:3] == [0.0, 2.5e-4, 5e-4]  # warm-up: ceil(0.5 x 4)


def test_epochs_train_every_record_of_every_epoch_once(
    tmp_path: Path, pretrained: Path, capsys
) -> None:
    """10 records in micro-batches of 3: an epoch is 3 full ones and one of the record
    left (dropped before), 2 a step. One step of all 10 records trains T targets; 2 epochs
    train 2 T in 4 steps, 1.5 epochs 3 steps; nothing is dropped."""
    data = write_jsonl(tmp_path / "train.jsonl", pairs(10))
    val = write_jsonl(tmp_path / "val.jsonl", pairs(2, offset=40))
    base = ["train", "--model", f"hf:{pretrained}", "--data", str(data), "--val-data", str(val),
            *SFT]  # fmt: skip
    one = tmp_path / "one"
    assert gradstep_main([*base, "--global-batch", "10", "--epochs", "1", "--out", str(one)]) == 0
    (targets,) = [r["items"] for r in rows(one)]
    for epochs, steps in (("2", 4), ("1.5", 3)):
        out = tmp_path / f"e{epochs}"
        split = ["--micro-batch-size", "3", "--accum-steps", "2"]
        assert gradstep_main([*base, *split, "--epochs", epochs, "--out", str(out)]) == 0
        err = capsys.readouterr().err
        assert f"--epochs {epochs}: 10 sequences an epoch (4 micro-batches" in err, err
        assert f"max_steps {steps}" in err
        assert (
            len(rows(out)) == steps
            and json.loads((out / "config.json").read_text())["max_steps"] == steps
        )
    assert sum(r["items"] for r in rows(tmp_path / "e2")) == 2 * targets


def test_stop_after_keeps_the_schedule_and_a_resume_continues_it(tmp_path: Path, capsys) -> None:
    """The walk's refused smoke run: --warmup 8 with 4 steps of an 20-step schedule; the
    resume then takes steps 5-20 at the LRs (and losses) of the run never stopped."""
    corpus = text_corpus(tmp_path / "data")
    base = ["train", *TOY, "--data", str(corpus), "--max-steps", "20", "--warmup", "8"]
    whole = tmp_path / "whole"
    assert gradstep_main([*base, "--out", str(whole)]) == 0
    out = tmp_path / "smoke"
    assert gradstep_main([*base, "--stop-after", "4", "--save-every", "2", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "this invocation stops after step 4 (--stop-after)" in err
    assert len(rows(out)) == 4 and summary(out)["stopped_after"] == 4
    # --stop-after is this invocation's, not the run's: a resume may stop again, 6 later.
    resume = ["train", "--out", str(out), "--resume"]
    assert gradstep_main([*resume, "--stop-after", "6"]) == 0
    assert "this invocation stops after step 10 (--stop-after)" in capsys.readouterr().err
    assert [r["window"] for r in rows(out)] == list(range(1, 11))
    assert summary(out)["stopped_after"] == 6 and summary(out)["max_steps"] == 20
    assert gradstep_main(resume) == 0
    assert [r["window"] for r in rows(out)] == list(range(1, 21))
    assert [r["lr"] for r in rows(out)] == [r["lr"] for r in rows(whole)]
    assert [r["loss"] for r in rows(out)] == [r["loss"] for r in rows(whole)]
    assert summary(out)["stopped_after"] is None


@pytest.mark.parametrize("near", [True, False])
def test_a_run_near_its_memory_budget_says_so_and_shows_both_rates(
    tmp_path: Path, capsys, near: bool
) -> None:
    """A budget at this process's resident set now: the run's peak reaches it, and the run
    says so once, naming the step; a budget far above it: nothing said. Every step records
    its resident set and the peak; the progress line shows trained and processed tok/s."""
    from gradstep.memory import current_bytes

    corpus = text_corpus(tmp_path / "data")
    budget = f"{current_bytes('cpu')}B" if near else "64GiB"
    out = tmp_path / "run"
    args = ["train", *TOY, "--data", str(corpus), "--max-steps", "3", "--log-every", "1"]
    assert gradstep_main([*args, "--memory-budget", budget, "--out", str(out)]) == 0
    err = capsys.readouterr().err
    said = re.findall(r"warning: step (\d+): peak memory [\d.]+ [KMG]iB is (?:over|\d+% of) "
                      r"--memory-budget", err)  # fmt: skip
    assert said == (["1"] if near else []), err
    assert summary(out)["memory_budget_warning_step"] == (1 if near else None)
    for record in rows(out):
        assert record["rss_mb"] > 0 and record["peak_memory_mb"] >= record["rss_mb"]
    progress = [line for line in err.splitlines() if re.match(r"step \d+/3 ", line)]
    assert len(progress) == 3, err
    assert all(" trained tok/s " in line and " processed tok/s " in line for line in progress)
