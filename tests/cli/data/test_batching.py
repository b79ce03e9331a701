"""How a window is cut into micro-batches (gradstep_cli.data.batching): rows merged into exact
global batches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from gradstep_cli.data.sources import TrainBatches

SEQ = 16


def take(it: TrainBatches, n: int) -> list[dict[str, torch.Tensor]]:
    return [next(it) for _ in range(n)]


def record_stream_source(tmp_path: Path) -> Any:
    """Token records of varied lengths, some cut from the left, plus text documents."""
    from gradstep_cli.config.settings import TrainConfig
    from gradstep_cli.data.sources import load_source
    from tests.support import hf_assets

    records = [
        {"prompt": "x = " * (i % 7 + 1), "completion": f"{i}" * (i % 5 + 1)} for i in range(30)
    ]
    records += [{"text": f"value_{i} = {i}\n" * (i + 3)} for i in range(4)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = TrainConfig(data=str(data), val_data=str(data), seq_len=SEQ)
    return load_source(cfg, hf_assets.load_tokenizer())


def test_record_rows_merge_into_exact_global_batches(tmp_path: Path) -> None:
    """--global-batch: single rows merged into micro-batches keep every row's tokens and
    targets (right padding, -100 labels) whatever the micro-batch size."""
    pytest.importorskip("transformers")
    from gradstep_cli.data.batching import merge_rows

    src = record_stream_source(tmp_path)
    rows = take(src.train_batches(SEQ, 1, 0, 0, 1), 7)
    merged = merge_rows(rows)
    assert merged["input_ids"].shape[0] == 7
    for i, row in enumerate(rows):
        n = row["input_ids"].shape[1]
        assert torch.equal(merged["input_ids"][i, :n], row["input_ids"][0])
        assert torch.equal(merged["labels"][i, :n], row["labels"][0])
        assert (merged["labels"][i, n:] == -100).all()
    assert sum(int((r["labels"] != -100).sum()) for r in rows) == int(
        (merged["labels"] != -100).sum()
    )
