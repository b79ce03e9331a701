"""The fine-tuning benchmark's machinery (bench/finetune_data.py, bench/finetune_workers.py).

The benchmark's claims rest on three things checked here on tiny local assets: the pairs
are the functions they come from, the Trainer trains on exactly the records gradstep
trained on (left-padded, with the labels the variant says), and on those records a
left-padded Trainer with TRL-style labels takes gradstep's step.
"""

from __future__ import annotations

import ast
import json
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.append(str(BENCH))  # last: its module names never shadow others

import finetune_data as fd  # noqa: E402
import finetune_workers as fw  # noqa: E402

pytestmark = pytest.mark.slow

IGNORE = fd.IGNORE
STDLIB = Path(sysconfig.get_paths()["stdlib"])
SOURCES = ("textwrap.py", "shlex.py", "fractions.py")


def _unindented(text: str | None) -> str | None:
    """``text`` without the indentation of its lines: a method's multi-line strings lose
    the class's indentation when the pair dedents the function."""
    return None if text is None else "\n".join(line.lstrip() for line in text.split("\n"))


class _Unindented(ast.NodeTransformer):
    def visit_Constant(self, node: ast.Constant) -> ast.Constant:
        if isinstance(node.value, str):
            node.value = _unindented(node.value)
        return node


def _without_decorators(node: ast.AST) -> str:
    node.decorator_list = []  # type: ignore[attr-defined]
    return ast.dump(_Unindented().visit(node))


@pytest.mark.parametrize("name", SOURCES)
def test_pair_is_its_function(name: str) -> None:
    """Prompt + completion parse back to the very function (decorators aside); the prompt
    is its signature and docstring, the completion the rest of its body, never empty."""
    source = (STDLIB / name).read_text()
    pairs = fd.file_pairs(name, source)
    assert len(pairs) >= 5
    by_line = {n.lineno: n for n in ast.walk(ast.parse(source)) if hasattr(n, "decorator_list")}
    for pair in pairs:
        original = by_line[int(pair.where.split(":")[1])]
        (rebuilt,) = ast.parse(pair.prompt + pair.completion).body
        assert _without_decorators(rebuilt) == _without_decorators(original)
        (head,) = ast.parse(pair.prompt + "\n    pass").body
        assert _unindented(ast.get_docstring(head)) == _unindented(ast.get_docstring(original))
        assert len(head.body) == 2 and pair.completion.strip()


def _pairs_jsonl(path: Path, tokenizer: object, seq_len: int, limit: int) -> Path:
    pairs = fd.file_pairs("operator.py", (STDLIB / "operator.py").read_text())
    return fd.write_jsonl(fd.fitting(pairs, tokenizer, seq_len, limit), path)


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-step gradstep SFT run (tiny Llama with weights, the tests' tokenizer), saved."""
    from gradstep_cli.cli import main as cli_main
    from tests.support.hf_assets import load_tokenizer, model_dir

    tmp = tmp_path_factory.mktemp("bench-finetune")
    model = model_dir(tmp / "model", "llama")
    data = _pairs_jsonl(tmp / "pairs.jsonl", load_tokenizer(), 128, 14)
    run = tmp / "run"
    argv = ["train", "--model", f"hf:{model}", "--data", str(data), "--val-data", str(data),
            "--seq-len", "128", "--micro-batch-size", "2", "--accum-steps", "2",
            "--max-steps", "3", "--warmup", "1", "--lr", "1e-2", "--weight-decay", "0",
            "--eval-batches", "1", "--sample-tokens", "0", "--save-every", "3",
            "--device", "cpu", "--out", str(run)]  # fmt: skip
    assert cli_main(argv) == 0
    return run


def _config(run: Path) -> object:
    from gradstep_cli.config.settings import TrainConfig

    return TrainConfig(**json.loads((run / "config.json").read_text()))


@pytest.mark.parametrize("variant", ["trl", "pad-id"])
def test_trainer_rows_are_gradstep_records(sft_run: Path, variant: str) -> None:
    """The rows rebuilt from gradstep's stream are records of the data file with their
    targets; the collator left-pads them, and ``pad-id`` drops exactly the EOS targets."""
    from transformers import AutoTokenizer

    cfg = _config(sft_run)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.removeprefix("hf:"))
    rows = [r for w in fw.gradstep_windows(cfg) for mb in w for r in fw.unpadded_rows(mb)]
    assert len(rows) == 3 * 2 * 2
    assert fw.check_same_records(rows, Path(cfg.data), tokenizer) > 1
    batch = fw.collator(tokenizer, variant)(rows[:4])
    eos = tokenizer.eos_token_id
    for i, row in enumerate(rows[:4]):
        n, width = len(row["input_ids"]), batch["input_ids"].shape[1]
        assert batch["input_ids"][i, width - n :].tolist() == row["input_ids"]
        assert batch["attention_mask"][i].tolist() == [0] * (width - n) + [1] * n
        labels = batch["labels"][i, width - n :].tolist()
        expected = [IGNORE if variant == "pad-id" and t == eos else t for t in row["labels"]]
        assert labels == expected
        assert (batch["labels"][i, : width - n] == IGNORE).all()
    assert all(row["labels"][-1] == eos for row in rows)  # every record trains its EOS


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _rel(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], base: dict) -> float:
    """||theirs - ours|| / ||ours - base|| over all weights: relative to the update."""
    diff = sum(float((theirs[k].double() - v.double()).square().sum()) for k, v in ours.items())
    step = sum(float((v.double() - base[k].double()).square().sum()) for k, v in ours.items())
    return (diff / step) ** 0.5


def test_left_padded_trainer_takes_gradstep_step(sft_run: Path, tmp_path: Path) -> None:
    """3 steps: the left-padded Trainer with TRL-style labels ends on gradstep's weights to
    float32 rounding (relative to the update; the prompt is masked, so the pad before the
    first real token predicts nothing trained); with ``pad-id`` (pad = EOS: the EOS targets
    are dropped) it does not."""
    from gradstep_cli.cli import main as cli_main

    ours = tmp_path / "ours"
    assert cli_main(["export", str(sft_run), "--out", str(ours)]) == 0
    base = _weights(Path(_config(sft_run).model.removeprefix("hf:")))
    errors = {}
    for variant in ("trl", "pad-id"):
        out = tmp_path / variant
        fw.trainer_worker(sft_run, out, variant)
        errors[variant] = _rel(_weights(ours), _weights(out), base)
    # float32 rounding of differently padded batches (measured 6.5e-7); pad-id: 0.58
    assert errors["trl"] < 1e-5, errors
    assert errors["pad-id"] > 0.1, errors
