"""Every rank's RNG is saved and restored as its own (README: RNG states "of every rank").

Two DDP ranks train with dropout on and a different torch RNG stream each, so each rank's
dropout masks, and through the gradient all-reduce every parameter, depend on that rank's
RNG. Restoring rank 0's state on both ranks, or swapping them, changes the parameters.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gradstep.checkpoint import MANIFEST
from tests.checkpoint.cli_ranks import rng_resume, rng_save_and_continue
from tests.checkpoint.helpers import assert_same_full_state
from tests.support.multiproc import run_ranks

STEPS = 2  # before the checkpoint, and after it


def _params_differ(a: dict, b: dict) -> bool:
    return any(not torch.equal(t, b["params"][name]) for name, t in a["params"].items())


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_each_rank_resumes_its_own_rng_with_dropout_on(tmp_path: Path) -> None:
    """2 DDP ranks (dropout 0.1): STEPS steps, save, STEPS more. Fresh ranks (new processes,
    RNG scrambled) resume the checkpoint and take the same STEPS: parameters, optimizer
    state, scheduler and Stepper bitwise equal the uninterrupted run's, and each rank's
    torch RNG ends where that rank's did. Controls in the same ranks: loading rank 0's RNG
    on both, or swapping the two, gives other parameters (so the check can fail)."""
    directory = str(tmp_path / "ckpt")
    whole = run_ranks(rng_save_and_continue, 2, directory, STEPS)
    resumed = run_ranks(rng_resume, 2, directory, STEPS)

    # The test means something only if the ranks' saved RNG states differ.
    assert not torch.equal(whole[0]["rng_at_save"], whole[1]["rng_at_save"])
    [step_dir] = Path(directory).iterdir()
    files = json.loads((step_dir / MANIFEST).read_text())["files"]
    assert files["rng-rank00000.json"]["sha256"] != files["rng-rank00001.json"]["sha256"]

    for rank in range(2):
        own = resumed[rank]["own"]
        assert own["start"] == STEPS
        assert_same_full_state(own["final"], whole[rank]["final"])
        assert_same_full_state(own["final"], whole[0]["final"])  # DDP: ranks agree
        assert torch.equal(own["rng_end"], whole[rank]["rng_end"]), f"rank {rank} RNG"
        for control in ("swapped", "rank0"):
            got = resumed[rank][control]["final"]
            assert _params_differ(got, whole[rank]["final"]), (control, rank)
