"""``gradstep train``'s setup as one pipeline (gradstep_cli.train): checks -> data -> model ->
plan -> run, each part built once and handed on. Counted here on the way to the loop (which
is stubbed out): an hf: model's config.json is read once, its tokenizer loaded once, the
data read once (the planner reuses it), the run's model built once, and ``gradstep plan``
runs the same first stages."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import pytest

from gradstep_cli import train as cli_train
from gradstep_cli.cli import main
from gradstep_cli.data import sources
from gradstep_cli.models import hf, spec
from tests.support.batches import text_corpus

GPT = ["--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16"]
RUN = ["--eval-batches", "1", "--sample-tokens", "0", "--warmup", "1", "--max-steps", "1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return text_corpus(tmp_path_factory.mktemp("data") / "corpus")


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> collections.Counter:
    """How often each part is made: config.json read, tokenizer loaded, data files read,
    model built; the loop replaced by one that returns the run it was handed."""
    made: collections.Counter = collections.Counter()

    def count(module: Any, name: str, key: str) -> None:
        real = getattr(module, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            made[key] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    count(hf, "_read_config", "config.json")
    count(hf, "_auto_tokenizer", "tokenizer")
    count(sources, "prepare", "data")
    count(spec, "build_model", "model")
    monkeypatch.setattr(cli_train, "run_loop", lambda run, started, callbacks: {"run": run})
    return made


def test_a_fixed_run_makes_each_part_once(counted, corpus, tmp_path):
    out = tmp_path / "run"
    argv = ["train", *GPT, *RUN, "--data", str(corpus), "--out", str(out)]
    assert main(argv) == 0
    assert counted == {"data": 1, "model": 1}  # --data; the toy GPT has no config.json


def test_an_auto_run_probes_its_own_instance_on_the_data_read_once(counted, corpus, tmp_path):
    auto = ["--global-batch", "4", "--micro-batch-size", "auto", "--memory-budget", "8GiB"]
    argv = ["train", *GPT, *RUN, *auto, "--data", str(corpus), "--out", str(tmp_path / "run")]
    assert main(argv) == 0
    assert counted == {"data": 1, "model": 2}  # the probe's throwaway, then the run's


def test_an_hf_run_reads_its_config_and_tokenizer_once(counted, tmp_path):
    pytest.importorskip("transformers")
    from tests.support.hf_assets import model_dir

    folder = model_dir(tmp_path / "llama", "llama")
    records = tmp_path / "sft.jsonl"
    lines = [{"prompt": f"q{i}: ", "completion": f"answer {i}"} for i in range(20)]
    records.write_text("".join(json.dumps(line) + "\n" for line in lines))
    model = ["--model", f"hf:{folder}", "--seq-len", "32", "--data", str(records)]
    assert main(["train", *model, *RUN, "--out", str(tmp_path / "run")]) == 0
    assert counted == {"config.json": 1, "tokenizer": 1, "data": 1, "model": 1}
    counted.clear()
    plan = ["--global-batch", "4", "--memory-budget", "8GiB", "--no-probe", "--json"]
    assert main(["plan", *model, *plan]) == 0  # the same first stages, nothing built
    assert counted == {"config.json": 1, "tokenizer": 1, "data": 1}
