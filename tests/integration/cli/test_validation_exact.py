"""The CLI's validation metrics equal an independent float64 evaluator on the exported model.

A tiny local Llama (tests/support/hf_assets.py) trains a few steps with ``--val-data``,
is exported, and reloaded with plain transformers (PEFT for the adapter, found through
``--base-name``). The evaluator never looks at gradstep's batches: it tokenizes every
validation record itself (prompt with the tokenizer's special tokens, completion without,
EOS appended; a conversation piece by piece from the ChatML template), runs each record
alone and unpadded in float64, and takes the token-weighted mean NLL of the tokens that
train (completion and EOS; the assistant's content and <|im_end|>), the share of them the
argmax predicts, and their mean entropy. The run's final ``val_loss`` (right-padded
micro-batches in float32) must match to float32 rounding (measured: 1e-7 relative), and it
must have scored exactly those tokens and records.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
pytest.importorskip("peft")

from gradstep_cli.cli import main  # noqa: E402
from tests.cli.test_sft import chats, pairs, plain_chat, plain_pair, write_jsonl  # noqa: E402
from tests.support import hf_assets  # noqa: E402

FLAGS = [
    "--seq-len", "256", "--micro-batch-size", "2", "--accum-steps", "2", "--max-steps", "3",
    "--warmup", "1", "--lr", "1e-2", "--save-every", "3", "--eval-every", "0",
    "--sample-tokens", "0", "--device", "cpu",
]  # fmt: skip
VAL = 7  # records: an odd number, so the last micro-batch is short


def evaluator(model: Any, sequences: list[tuple[list[int], list[bool]]]) -> dict[str, float]:
    """Token-weighted NLL, accuracy and entropy, each record alone and unpadded, float64."""
    nll = correct = entropy = 0.0
    count = 0
    with torch.no_grad():
        for ids, trainable in sequences:
            x = torch.tensor(ids)
            logits = model(input_ids=x[None, :-1], use_cache=False).logits[0].double()
            mask = torch.tensor(trainable[1:])
            logp = F.log_softmax(logits[mask], dim=-1)
            target = x[1:][mask]
            nll -= float(logp.gather(1, target[:, None]).sum())
            correct += float((logp.argmax(-1) == target).sum())
            entropy -= float((logp.exp() * logp).sum())
            count += int(mask.sum())
    return {"loss": nll / count, "accuracy": correct / count, "entropy": entropy / count,
            "items": count}  # fmt: skip


def _train_export(tmp: Path, kind: str, *extra: str, export: tuple[str, ...] = ()) -> Path:
    base = hf_assets.model_dir(tmp / "base", "llama", seed=0)
    make = chats if kind == "chat" else pairs
    train = write_jsonl(tmp / "train.jsonl", make(8))
    val = write_jsonl(tmp / "val.jsonl", make(VAL, offset=40))
    argv = ["train", *FLAGS, "--model", f"hf:{base}", "--data", str(train), "--val-data", str(val)]
    assert main([*argv, *extra, "--out", str(tmp / "run")]) == 0
    assert main(["export", str(tmp / "run"), "--out", str(tmp / "exp"), *export]) == 0
    return tmp / "run"


def _check(run: Path, model: Any, kind: str) -> dict[str, float]:
    tok = hf_assets.load_tokenizer()
    plain = plain_chat if kind == "chat" else plain_pair
    records = [json.loads(line) for line in (run.parent / "val.jsonl").read_text().splitlines()]
    want = evaluator(model.double().eval(), [plain(tok, r) for r in records])
    summary = json.loads((run / "summary.json").read_text())
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["val_loss"] == summary["final_val_loss"]
    assert last["val_loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert last["val_items"] == want["items"] and last["val_records"] == VAL
    assert last["val_accuracy"] == pytest.approx(want["accuracy"], abs=1.5 / want["items"])
    assert last["val_entropy"] == pytest.approx(want["entropy"], rel=1e-4)
    assert summary["initial_val_loss"] != pytest.approx(want["loss"], rel=1e-3)  # it trained
    return {"rel": abs(last["val_loss"] / want["loss"] - 1), **want}


@pytest.mark.parametrize("kind", ["prompt/completion", "chat"])
def test_full_fine_tune_val_loss_is_the_float64_evaluators(kind: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    run = _train_export(tmp_path, kind)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "exp"), dtype=torch.float64)
    print(kind, _check(run, model, kind))


def test_lora_val_loss_is_the_float64_evaluators_through_a_portable_base_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--base-name base: the adapter names its base relative to where it is loaded, so the
    two folders move together and AutoModelForCausalLM finds the base from there."""
    from transformers import AutoModelForCausalLM

    lora = ("--lora", "4", "--lora-targets", "all-linear")
    run = _train_export(tmp_path, "prompt/completion", *lora, export=("--base-name", "base"))
    config = json.loads((tmp_path / "exp" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "base"
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.move(tmp_path / "base", moved / "base")
    shutil.move(tmp_path / "exp", moved / "adapter")
    monkeypatch.chdir(moved)
    model = AutoModelForCausalLM.from_pretrained("adapter", dtype=torch.float64)
    print("lora", _check(run, model, "prompt/completion"))
