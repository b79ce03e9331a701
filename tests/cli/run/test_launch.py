"""Where a run runs (gradstep_cli.run.launch): the process group gets ``--collective-timeout``,
and a rank stuck in a collective ends the job with an error."""

from __future__ import annotations

import pytest

from gradstep_cli.cli import main

SMALL = [
    "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16",
    "--micro-batch-size", "2", "--accum-steps", "2", "--eval-batches", "1",
    "--sample-tokens", "0", "--warmup", "1", "--eval-every", "0", "--max-steps", "2",
]  # fmt: skip


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def _stuck_peer(rank: int, world: int) -> dict:
    """Rank 1 never joins the all-reduce: rank 0 must raise within the timeout."""
    import time

    import torch
    import torch.distributed as dist

    started = time.monotonic()
    outcome = "returned"
    if rank == 0:
        try:
            dist.all_reduce(torch.ones(1))
        except RuntimeError as exc:  # DistBackendError: gloo's timeout
            outcome = type(exc).__name__ + ": " + str(exc)[:200]
    else:
        time.sleep(5)
    dist.destroy_process_group()  # the group is broken: no barrier
    return {"outcome": outcome, "waited": time.monotonic() - started}


def test_the_collective_timeout_reaches_the_process_group(tmp_path, capsys, monkeypatch):
    """Row 129: the CLI set no collective timeout, so a stuck rank meant 30 minutes of
    silence. The flag's value (default 600 s) is what init() gets."""
    from gradstep_cli.config.settings import ConfigError
    from gradstep_cli.run import launch

    seen = []

    def init(device=None, backend="auto", timeout_s=None):  # noqa: ANN001, ANN202
        seen.append(timeout_s)
        raise ConfigError("stop here")

    monkeypatch.setattr(launch.parallel, "init", init)
    out = ["--out", str(tmp_path / "r")]
    assert run(capsys, "train", *SMALL, *out, "--collective-timeout", "7")[0] == 2
    assert run(capsys, "train", *SMALL, *out)[0] == 2
    assert seen == [7.0, 600.0]


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_stuck_rank_ends_in_an_error_not_a_hang():
    from tests.support.multiproc import run_ranks

    first, _ = run_ranks(_stuck_peer, 2, timeout=40, collective_timeout_s=2)
    assert first["outcome"] != "returned" and first["waited"] < 4.5, first
