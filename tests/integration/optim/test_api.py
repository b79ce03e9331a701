"""The tests of tests/optim/test_api.py that start processes or run the CLI end to end; its
other tests stay there.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gradstep_cli.cli import main
from tests.support.batches import text_corpus

SMALL = [
    "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16",
    "--micro-batch-size", "2", "--accum-steps", "2", "--eval-batches", "1",
    "--sample-tokens", "0", "--warmup", "1", "--eval-every", "0", "--max-steps", "2",
]  # fmt: skip


def test_demo_trains_with_lamb_and_refuses_another_optimizer_on_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = text_corpus(tmp_path / "corpus")
    out = tmp_path / "run"
    flags = ["train", *SMALL, "--data", str(corpus), "--out", str(out)]
    assert main([*flags, "--optimizer", "lamb", "--save-every", "1"]) == 0
    assert '"optimizer": "lamb"' in (out / "config.json").read_text()
    capsys.readouterr()
    assert main([*flags, "--resume", "--max-steps", "3", "--optimizer", "lars"]) == 2
    err = capsys.readouterr().err
    assert "refused" in err and "--optimizer 'lars'" in err, err
    # Not given: the checkpoint's optimizer (LAMB) carries on.
    assert main([*flags, "--resume", "--max-steps", "3"]) == 0
    assert '"optimizer": "lamb"' in (out / "config.json").read_text()
