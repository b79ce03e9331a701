"""A ramped run (``--batch-ramp``) resumes only on the world size it was saved on, in both
directions: its micro-batches per rank do not rescale. A held-out mutation audit found a
resume on FEWER ranks accepted (issue 20, section 4; the test beside it covered more ranks
only). Saved on 2 ranks, resumed on 1 process: refused with the message naming both world
sizes, exit code 2, and nothing written: the run unchanged, no run started in a new --out.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gradstep_cli.cli import main
from tests.support.asserts import tree_hash
from tests.support.batches import text_corpus

TINY = [
    "--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32",
    "--micro-batch-size", "2", "--eval-every", "0", "--eval-batches", "2",
    "--sample-tokens", "0", "--warmup", "1",
]  # fmt: skip
RAMP = ["--batch-ramp", "1:2", "--accum-steps", "4", "--max-steps", "2", "--save-every", "1"]


def _train_ramped_on_two_ranks(rank: int, world: int, data: str, out: str) -> int:
    argv = ["train", *TINY, *RAMP, "--data", data, "--strategy", "ddp", "--device", "cpu"]
    return main([*argv, "--out", out])


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_ramped_run_saved_on_two_ranks_is_not_resumed_on_one(tmp_path: Path, capsys) -> None:
    from tests.support.multiproc import run_ranks

    data = str(text_corpus(tmp_path / "data"))
    ramped = tmp_path / "ramped"
    assert run_ranks(_train_ramped_on_two_ranks, 2, data, str(ramped), timeout=240) == [0, 0]
    capsys.readouterr()
    before = tree_hash(ramped)
    base = ["train", *TINY, "--data", data, "--max-steps", "4"]
    for flags in (["--resume", str(ramped), "--out", str(tmp_path / "one")],
                  ["--resume", "--out", str(ramped)]):  # fmt: skip
        code = main([*base, *flags])
        err = capsys.readouterr().err
        assert code == 2, (flags, err)
        assert "saved on 2 rank(s): resume it on 2, not 1" in err, err
        assert "Traceback" not in err
        assert tree_hash(ramped) == before, flags
    # The refused --out holds no run (its lock file aside): no metrics, no checkpoints.
    left = [p.name for p in (tmp_path / "one").rglob("*")] if (tmp_path / "one").exists() else []
    assert set(left) <= {".gradstep.lock"}, left
