"""``gradstep train --packing`` end to end (issue 31 §1): the demo GPT and a tiny HF Llama
train on packed rows (the start line gives the padding), a packed run resumes bitwise, a
resume may not change --packing, and an HF family not shown exact is refused naming the
family and its attention implementation. Exactness itself: tests/cli/test_sft_packed.py."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from gradstep_cli.cli import main

BASE = [
    "--seq-len", "32", "--eval-batches", "2", "--eval-every", "0", "--sample-tokens", "0",
    "--warmup", "1", "--packing",
]  # fmt: skip
TINY = [*BASE, "--micro-batch-size", "2", "--accum-steps", "2", "--n-layer", "2",
        "--d-model", "32", "--n-head", "2"]  # fmt: skip
KEYS = ("step", "loss", "grad_norm", "items", "clip_coef", "lr")


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _pick(rows: list[dict]) -> list[dict]:
    return [{k: r.get(k) for k in KEYS} for r in rows]


def _resumes_bitwise(run: list[str], out: Path) -> None:
    assert main([*run, "--max-steps", "4", "--save-every", "2", "--out", str(out)]) == 0
    straight = _rows(out)
    shutil.rmtree(sorted((out / "checkpoints").glob("step-*"))[-1])  # stopped after step 2
    assert main([*run, "--max-steps", "4", "--resume", "--out", str(out)]) == 0
    assert _pick(_rows(out)) == _pick(straight) and len(straight) == 4
    assert _rows(out)[-1]["val_loss"] == straight[-1]["val_loss"]


def test_a_packed_demo_run_reports_its_padding_and_resumes_bitwise(tmp_path, capsys) -> None:
    _resumes_bitwise(["train", *TINY], tmp_path / "run")
    err = capsys.readouterr().err
    line = re.search(r"packing: ([\d,]+) sequences an epoch in ([\d,]+) rows of --seq-len 32 "
                     r"\(padding ([\d.]+)% of the positions\)", err)  # fmt: skip
    assert line, err
    assert int(line[1].replace(",", "")) > int(line[2].replace(",", ""))
    assert float(line[3]) < 2.0
    # --packing is part of the data stream: a resume keeps the checkpoint's, and may not
    # change it
    unpacked = [a for a in TINY if a != "--packing"]
    out = str(tmp_path / "run")
    assert main(["train", *unpacked, "--max-steps", "5", "--resume", "--out", out]) == 0
    assert "the checkpoint's settings apply: packing=True" in capsys.readouterr().err
    out = str(tmp_path / "unpacked")
    assert main(["train", *unpacked, "--max-steps", "1", "--save-every", "1", "--out", out]) == 0
    assert main(["train", *TINY, "--max-steps", "2", "--resume", "--out", out]) == 2
    err = capsys.readouterr().err
    assert "packing" in err.splitlines()[-1] and "Traceback" not in err


def test_a_packed_run_with_a_global_batch_trains_every_row(tmp_path) -> None:
    out = tmp_path / "gb"
    run = ["train", *BASE, "--micro-batch-size", "2", "--global-batch", "5", "--n-layer", "2",
           "--d-model", "32", "--n-head", "2", "--max-steps", "2", "--out", str(out)]  # fmt: skip
    assert main(run) == 0
    assert all(r["items"] > 0 for r in _rows(out))


pytest.importorskip("transformers")


def _llama(folder: Path, **extra) -> Path:
    from transformers import LlamaConfig, MixtralConfig

    shape = dict(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    kind = extra.pop("kind", "llama")
    config = (LlamaConfig if kind == "llama" else MixtralConfig)(**shape, **extra)
    config.save_pretrained(folder / kind)
    return folder / kind


def test_a_packed_hf_run_resumes_bitwise(tmp_path) -> None:
    run = ["train", *BASE, "--micro-batch-size", "2", "--accum-steps", "2",
           "--model", f"hf:{_llama(tmp_path)}"]  # fmt: skip
    _resumes_bitwise(run, tmp_path / "run")


def test_a_family_not_shown_exact_is_refused_naming_it(tmp_path, capsys) -> None:
    path = _llama(tmp_path, kind="mixtral", num_local_experts=2, num_experts_per_tok=1)
    run = ["train", "--seq-len", "32", "--packing", "--model", f"hf:{path}",
           "--max-steps", "1", "--out", str(tmp_path / "run")]  # fmt: skip
    assert main(run) == 2
    err = capsys.readouterr().err
    assert "--packing: not shown exact for the family 'mixtral' under the attention " in err
    assert "implementation 'sdpa'" in err and "Traceback" not in err


def _launch(args: list[str], out: Path) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "gradstep", "train", "--nproc-per-node", "2", *args]
    proc = subprocess.run(
        [*cmd, "--out", str(out)], capture_output=True, text=True, timeout=400, env=env
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("strategy", "kind"), [("ddp", "gpt"), ("fsdp", "llama")])
def test_two_ranks_packed_take_the_steps_one_process_takes(tmp_path, strategy, kind) -> None:
    """A packed global batch split over 2 ranks: the same rows, so the same steps (float32
    rounding of sums in another order)."""
    model = ["--n-layer", "2", "--d-model", "32", "--n-head", "2"]
    if kind == "llama":
        model = ["--model", f"hf:{_llama(tmp_path)}"]
    args = [*BASE, *model, "--micro-batch-size", "2", "--global-batch", "4", "--max-steps", "3"]
    assert main(["train", *args, "--out", str(tmp_path / "one")]) == 0
    _launch([*args, "--strategy", strategy], tmp_path / "two")
    one, two = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert [r["items"] for r in one] == [r["items"] for r in two] and len(one) == 3
    for a, b in zip(one, two, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert one[-1]["val_loss"] == pytest.approx(two[-1]["val_loss"], rel=1e-5)
