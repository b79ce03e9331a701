"""A forged several-rank checkpoint is refused on every entry point, and its payload never
runs (robustness-3 S4, S11).

A 2-rank FSDP2 run of the local Llama is saved once; each test forges a copy the way
``forge.py`` does (a pickle payload in ``dcp/.metadata``, or in one optimizer entry of a
``.distcp`` file, every checksum recomputed so the folder verifies) and opens it the way a
user would: ``Checkpointer.load_latest`` (an elastic 2 -> 1 reshard), ``Checkpointer.load``
on 2 ranks, ``gradstep export``, ``gradstep train --resume`` on 1 process and on 2 ranks.
Each must fail with a message that says the file would have run code, and the payload's
marker file must not exist. The untouched run loads on the same paths (the refusal is the
forgery's, not the reader's).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from gradstep.checkpoint import Checkpointer, CheckpointError, saved_state  # noqa: E402
from gradstep_cli.cli import main  # noqa: E402
from tests.checkpoint.cli_ranks import cli_rank  # noqa: E402
from tests.checkpoint.forge import forge_entry, forge_metadata  # noqa: E402
from tests.integration.cli.test_export import FLAGS, corpus  # noqa: E402
from tests.support import hf_assets  # noqa: E402
from tests.support.multiproc import run_ranks  # noqa: E402

pytestmark = pytest.mark.distributed
FORGERIES = {"metadata": forge_metadata, "entry": forge_entry}
STEP = "step-000002"


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    tmp = tmp_path_factory.mktemp("fsdp")
    base = hf_assets.model_dir(tmp / "base", "llama", seed=0)
    argv = ["train", *FLAGS, "--model", f"hf:{base}", "--data", str(corpus(tmp / "data"))]
    argv += ["--strategy", "fsdp", "--eval-batches", "2"]
    assert run_ranks(cli_rank, 2, [*argv, "--out", str(tmp / "run")], timeout=300) == [0, 0]
    return tmp / "run", argv


def forged(run: Path, dest: Path, how: str) -> tuple[Path, Path]:
    """A copy of ``run`` whose newest checkpoint is forged; (its folder, the marker)."""
    copy = dest / f"forged-{how}"
    shutil.copytree(run, copy)
    marker = dest / f"PWNED-{how}"
    FORGERIES[how](copy / "checkpoints" / STEP, marker)
    return copy, marker


def refused(text: str, how: str) -> bool:
    said = {"metadata": "would run code of its own", "entry": "it is not plain data"}[how]
    return "refused to read" in text and said in text


def llama() -> torch.nn.Module:
    return hf_assets.build_model("llama", seed=0)


@pytest.mark.parametrize("how", FORGERIES)
def test_load_latest_refuses_a_forged_checkpoint(fsdp_run, tmp_path: Path, how: str) -> None:
    run, _ = fsdp_run
    folder, marker = forged(run, tmp_path, how)
    checkpointer = Checkpointer(folder / "checkpoints")
    info = checkpointer.latest()  # the checksums were recomputed: it verifies
    assert info is not None and info.path.name == STEP
    assert saved_state(info.manifest, "config") is not None  # JSON only: nothing runs
    model = llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as caught:
        checkpointer.load_latest(strict=False, model=model, optimizer=_adamw(model))
    assert refused(str(caught.value), how), caught.value
    assert str(folder / "checkpoints" / STEP / "dcp") in str(caught.value)
    assert not marker.exists()
    after = model.state_dict()  # refused before anything was loaded
    assert all(torch.equal(before[k], after[k]) for k in before)
    # the same calls load the untouched run
    model = llama()
    assert Checkpointer(run / "checkpoints").load_latest(
        strict=False, model=model, optimizer=_adamw(model)
    ) == 2  # fmt: skip


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay}, {"params": rest}])


@pytest.mark.parametrize("how", FORGERIES)
def test_export_refuses_a_forged_checkpoint(fsdp_run, tmp_path: Path, capsys, how) -> None:
    run, _ = fsdp_run
    folder, marker = forged(run, tmp_path, how)
    assert main(["export", str(folder), "--out", str(tmp_path / "out")]) != 0
    err = capsys.readouterr().err
    assert refused(err, how) and "Traceback" not in err, err
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("how", FORGERIES)
def test_resume_refuses_a_forged_checkpoint_on_one_and_two_ranks(
    fsdp_run, tmp_path: Path, capsys, how
) -> None:
    run, argv = fsdp_run
    folder, marker = forged(run, tmp_path, how)
    resume = [*argv, "--max-steps", "4", "--out", str(folder), "--resume"]
    one = [a for a in resume if a not in ("--strategy", "fsdp")]
    assert main(one) != 0
    err = capsys.readouterr().err
    assert refused(err, how) and "Traceback" not in err, err
    assert not marker.exists()
    assert run_ranks(cli_rank, 2, resume, timeout=300) != [0, 0]
    assert not marker.exists()
    # the refusal named the forgery; nothing was written to the run
    assert sorted(p.name for p in (folder / "checkpoints").iterdir()) == [STEP]
