"""``--loss-chunk-tokens N`` (issue 31 §2): a run whose loss is computed N tokens at a time
(the whole logits never held) trains the same steps as the run from the whole logits
(``--loss-chunk-tokens 0``), within float32 rounding: the demo GPT (its forward's chunked
loss) and a tiny HF llama (``causal_lm_loss(chunk_tokens=N)``), on one process and under
``--strategy fsdp`` on 2 ranks. A head the library cannot chunk (LoRA-adapted) falls back
to the whole logits with a note. Small chunks (7 tokens) so that every micro-batch is
several chunks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from gradstep_cli.cli import main  # noqa: E402

GPT = [
    "--device", "cpu", "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16",
    "--micro-batch-size", "2", "--accum-steps", "2", "--eval-batches", "2", "--eval-every", "0",
    "--sample-tokens", "0", "--max-steps", "3",
]  # fmt: skip
HF = [
    "--device", "cpu", "--seq-len", "32", "--micro-batch-size", "2", "--accum-steps", "2",
    "--eval-batches", "2", "--eval-every", "0", "--sample-tokens", "0", "--warmup", "1",
    "--max-steps", "3",
]  # fmt: skip
SHAPE = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
KEYS = ("loss", "grad_norm")
RTOL = 1e-5  # float32 rounding of a sum in another order, over 3 steps of training


def _llama(folder: Path, vocab: int = 256) -> Path:
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=vocab, **SHAPE).save_pretrained(folder / "llama")
    return folder / "llama"


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _worst(chunked: Path, whole: Path) -> float:
    """Largest relative difference of the steps' losses and grad norms and the last
    val_loss between two runs (same steps asserted)."""
    a, b = _rows(chunked), _rows(whole)
    assert [r["step"] for r in a] == [r["step"] for r in b] and len(a) == 3
    pairs = [(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in KEYS]
    pairs.append((a[-1]["val_loss"], b[-1]["val_loss"]))
    worst = max(abs(x - y) / abs(y) for x, y in pairs)
    print(f"chunked vs whole logits, worst relative difference: {worst:.3g}")  # pytest -s
    return worst


def _train(args: list[str], out: Path) -> None:
    assert main(["train", *args, "--out", str(out)]) == 0


def _launch(args: list[str], out: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "gradstep", "train", "--nproc-per-node", "2", *args]
    proc = subprocess.run(
        [*cmd, "--out", str(out)], capture_output=True, text=True, timeout=400, env=ENV
    )
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.mark.timeout(300)
def test_demo_gpt_chunked_run_equals_the_whole_logits_run(tmp_path: Path) -> None:
    _train([*GPT, "--loss-chunk-tokens", "7"], tmp_path / "chunked")
    _train([*GPT, "--loss-chunk-tokens", "0"], tmp_path / "whole")
    assert _worst(tmp_path / "chunked", tmp_path / "whole") <= RTOL
    saved = json.loads((tmp_path / "chunked" / "config.json").read_text())
    assert saved["loss_chunk_tokens"] == 7


@pytest.mark.timeout(300)
def test_hf_llama_chunked_run_equals_the_whole_logits_run(tmp_path: Path) -> None:
    model = ["--model", f"hf:{_llama(tmp_path)}"]
    _train([*HF, *model, "--loss-chunk-tokens", "7"], tmp_path / "chunked")
    _train([*HF, *model, "--loss-chunk-tokens", "0"], tmp_path / "whole")
    assert _worst(tmp_path / "chunked", tmp_path / "whole") <= RTOL


@pytest.mark.timeout(300)
def test_a_lora_adapted_head_falls_back_to_the_whole_logits_with_a_note(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = ["--model", f"hf:{_llama(tmp_path)}", "--lora", "4"]
    lora = [*HF, *model, "--lora-targets", "q_proj,lm_head"]
    _train([*lora, "--loss-chunk-tokens", "7"], tmp_path / "chunked")
    notes = [line for line in capsys.readouterr().err.splitlines() if "--loss-chunk-tokens" in line]
    assert len(notes) == 1 and "not a plain nn.Linear" in notes[0], notes
    _train([*lora, "--loss-chunk-tokens", "0"], tmp_path / "whole")
    assert "--loss-chunk-tokens" not in capsys.readouterr().err
    assert _worst(tmp_path / "chunked", tmp_path / "whole") == 0  # the same computation


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_fsdp_two_ranks_chunked_run_equals_the_whole_logits_run(tmp_path: Path, kind: str) -> None:
    args = GPT if kind == "gpt" else [*HF, "--model", f"hf:{_llama(tmp_path)}"]
    args = [*args, "--strategy", "fsdp"]
    chunked = _launch([*args, "--loss-chunk-tokens", "7"], tmp_path / "chunked")
    assert "--loss-chunk-tokens" not in chunked.stderr  # chunked, not fallen back
    _launch([*args, "--loss-chunk-tokens", "0"], tmp_path / "whole")
    assert json.loads((tmp_path / "chunked" / "summary.json").read_text())["world_size"] == 2
    assert _worst(tmp_path / "chunked", tmp_path / "whole") <= RTOL
