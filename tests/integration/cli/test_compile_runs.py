"""``gradstep train --compile`` (issue 31 §3) trains the run without it, within float32
rounding (:data:`RTOL` on every step's loss and pre-clip norm and the validation losses):

- on one process, where the checkpoints also cross: a compiled run's step-2 checkpoint
  resumes with ``--no-compile`` and an eager run's with ``--compile``, each onto the same
  steps 3 and 4 (the state_dict keys are the eager ones: no ``_orig_mod.``); the compile
  time is in summary.json (``compile_seconds``, null without --compile) and on the console;
- on 2 gloo ranks under ``--strategy ddp`` and ``--strategy fsdp`` (one job runs the four
  runs, as torchrun's ranks would: tests/cli/mesh_ranks.py).

The model-level parity (packing, LoRA, activation checkpointing, an HF model) is in
tests/cli/models/test_compile.py; these runs compile the demo GPT's one block graph.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch

from gradstep_cli.cli import main
from tests.cli.mesh_ranks import cli_runs
from tests.support.batches import text_corpus
from tests.support.multiproc import run_ranks

dynamo = pytest.importorskip("torch._dynamo")
if not dynamo.is_dynamo_supported():
    pytest.skip(
        "torch.compile is not supported on this Python / torch build", allow_module_level=True
    )

FLAGS = [
    "--device", "cpu", "--n-layer", "2", "--n-head", "2", "--d-model", "32", "--seq-len", "16",
    "--micro-batch-size", "4", "--accum-steps", "2", "--eval-batches", "2", "--eval-every", "2",
    "--sample-tokens", "4", "--warmup", "1", "--max-steps", "4",
]  # fmt: skip
RTOL = 1e-5  # float32 rounding: inductor fuses and reorders the block's arithmetic
KEYS = ("loss", "grad_norm", "val_loss")


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _assert_same_steps(got: Path, want: Path, steps: list[int]) -> None:
    a = [r for r in _rows(got) if r["step"] in steps]
    b = [r for r in _rows(want) if r["step"] in steps]
    assert [r["step"] for r in a] == [r["step"] for r in b] == steps
    for x, y in zip(a, b, strict=True):
        for key in KEYS:
            assert (key in x) is (key in y), (x["step"], key)  # val_loss: evaluated steps
            if key in y:
                assert x[key] == pytest.approx(y[key], rel=RTOL), (x["step"], key)


def _summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "summary.json").read_text())


def _model_keys(out: Path, step: int) -> set[str]:
    path = out / "checkpoints" / f"step-{step:06d}" / "model.safetensors"
    return set(safetensors.torch.load_file(path))


@pytest.mark.timeout(400)
def test_a_compiled_run_trains_the_eager_run_and_their_checkpoints_cross(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from torch._dynamo.utils import counters

    dynamo.reset()  # compiled here, as in a fresh process
    counters.clear()
    args = ["train", *FLAGS, "--data", str(text_corpus(tmp_path / "data")), "--save-every", "2"]
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    assert main([*args, "--out", str(eager)]) == 0
    assert "compile" not in capsys.readouterr().out
    assert main([*args, "--compile", "--out", str(compiled)]) == 0
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]  # compiled
    out, err = capsys.readouterr()
    assert "--compile: 2 transformer blocks (Block) compiled with torch.compile" in err
    assert "\ncompile: " in out and "s (--compile: the first step's time beyond" in out
    _assert_same_steps(compiled, eager, [1, 2, 3, 4])
    assert _summary(eager)["compile_seconds"] is None
    assert _summary(compiled)["compile_seconds"] >= 0.0
    assert _model_keys(compiled, 2) == _model_keys(eager, 2)

    # Each step-2 checkpoint resumed the other way: steps 3 and 4 as both runs took them.
    for source, flag in ((compiled, "--no-compile"), (eager, "--compile")):
        resumed = tmp_path / f"{source.name}-resumed"
        step2 = str(source / "checkpoints" / "step-000002")
        assert main([*args, flag, "--resume", step2, "--out", str(resumed)]) == 0
        assert json.loads((resumed / "config.json").read_text())["compile"] is (flag == "--compile")
        _assert_same_steps(resumed, source, [3, 4])
        _assert_same_steps(resumed, eager, [3, 4])
        assert (_summary(resumed)["compile_seconds"] is None) is (flag == "--no-compile")


@pytest.mark.distributed
@pytest.mark.timeout(500)
def test_ddp_and_fsdp_compiled_runs_train_their_eager_runs(tmp_path: Path) -> None:
    args = ["train", *FLAGS, "--data", str(text_corpus(tmp_path / "data"))]
    runs = {
        (strategy, compiled): tmp_path / f"{strategy}-{'compiled' if compiled else 'eager'}"
        for strategy in ("ddp", "fsdp")
        for compiled in (False, True)
    }
    argvs = [
        [*args, "--strategy", strategy, *(["--compile"] if compiled else []), "--out", str(out)]
        for (strategy, compiled), out in runs.items()
    ]
    ranks = run_ranks(cli_runs, 2, argvs, timeout=450)
    assert [[rc for rc, _, _ in res] for res in ranks] == [[0] * 4] * 2, ranks
    for strategy in ("ddp", "fsdp"):
        compiled, eager = runs[strategy, True], runs[strategy, False]
        assert _summary(compiled)["world_size"] == 2
        _assert_same_steps(compiled, eager, [1, 2, 3, 4])
        assert _summary(compiled)["compile_seconds"] >= 0.0
