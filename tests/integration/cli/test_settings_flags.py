"""A run's settings end to end: defaults that fit any run, flags that never claim what they do not
do, and messages that name the flag (issue 20; rows of shared/reviews/robustness-2.md and
hf-client-2.md in each docstring)."""

from __future__ import annotations

import json

import pytest

from gradstep_cli.cli import main
from gradstep_cli.config.settings import GPT_SHAPE
from tests.integration.cli.test_lr_runs import TINY
from tests.support.batches import text_corpus


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(text_corpus(tmp_path_factory.mktemp("settings") / "corpus"))


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def test_a_short_run_with_default_flags_trains(data, tmp_path) -> None:
    out = tmp_path / "run"
    assert main(["train", *TINY, "--data", data, "--max-steps", "3", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["warmup"], config["min_lr"]) == (0, 3e-4)  # the resolved values


def test_an_hf_run_records_no_gpt_shape(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    hf, out = tmp_path / "llama", tmp_path / "run"
    transformers.LlamaConfig(
        vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    ).save_pretrained(hf)  # fmt: skip
    data = str(text_corpus(tmp_path / "d"))
    argv = ["train", "--model", f"hf:{hf}", "--seq-len", "16", "--micro-batch-size", "2",
            "--accum-steps", "1", "--max-steps", "1", "--eval-batches", "1",
            "--sample-tokens", "0", "--data", data, "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    config = json.loads((out / "config.json").read_text())
    assert [config[name] for name in GPT_SHAPE] == [None, None, None]


def test_noise_scale_settings_that_do_nothing_get_a_note(data, tmp_path, capsys) -> None:
    """N44: --gns-beta without --gns; N43: --gns with 1 micro-batch per step (gns_b_simple
    stays null): both were silent."""
    base = ["train", *TINY, "--data", data, "--max-steps", "1"]
    code, err = run(capsys, *base, "--gns-beta", "0.5", "--out", str(tmp_path / "a"))
    assert code == 0 and "--gns-beta has no effect without --gns" in err
    code, err = run(capsys, *base, "--gns", "--accum-steps", "1", "--out", str(tmp_path / "b"))
    assert code == 0 and "gns_b_simple stays null" in err and "--accum-steps" in err
    record = json.loads((tmp_path / "b" / "metrics.jsonl").read_text())
    assert record["gns_b_simple"] is None  # what the note says
    code, err = run(capsys, *base, "--gns", "--out", str(tmp_path / "c"))  # 2: measured
    assert code == 0 and "note:" not in err


def test_resume_messages_say_what_is_true(data, tmp_path, capsys) -> None:
    """O24: 'unusable ones are listed above' with none listed; O29/N136: --resume-or-start
    errors named --resume; N98: a lock-file problem did not name the lock file."""
    empty = tmp_path / "empty"
    empty.mkdir()
    base = ["train", *TINY, "--data", data, "--max-steps", "2"]
    code, err = run(capsys, *base, "--resume", str(empty), "--out", str(tmp_path / "x"))
    assert code == 2 and "no valid checkpoint" in err and "listed above" not in err, err
    held = tmp_path / "held"  # a run without checkpoints
    assert run(capsys, *base, "--out", str(held))[0] == 0
    code, err = run(capsys, *base, "--resume-or-start", "--out", str(held))
    assert code == 2 and "error: --resume-or-start: no valid checkpoint" in err, err
    ckpt = tmp_path / "ckpt"
    assert run(capsys, *base, "--save-every", "1", "--out", str(ckpt))[0] == 0
    for model in (ckpt / "checkpoints").glob("step-*/model.safetensors"):
        flipped = bytearray(model.read_bytes())
        flipped[-1] ^= 0xFF
        model.write_bytes(bytes(flipped))
    code, err = run(capsys, *base, "--resume", "--max-steps", "3", "--out", str(ckpt))
    assert code == 2 and "(the unusable ones are listed above)" in err, err
    locked = tmp_path / "lockdir"
    (locked / ".gradstep.lock").mkdir(parents=True)
    code, err = run(capsys, *base, "--out", str(locked))
    assert code == 2 and str(locked / ".gradstep.lock") in err and "lock file" in err, err
