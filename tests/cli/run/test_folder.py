"""The run-folder rules (gradstep_cli.run.folder): what a resume may change, what the checkpoint
decides, where a run runs, and what ``--overwrite`` deletes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from gradstep.checkpoint import CheckpointInfo
from gradstep_cli.cli import main
from gradstep_cli.config.settings import GPT_SHAPE, TrainConfig
from gradstep_cli.run import folder as run_folder
from gradstep_cli.run.folder import ENVIRONMENT
from tests.support.asserts import tree_hash
from tests.support.batches import text_corpus


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def _fake_checkpoint(settings: dict) -> CheckpointInfo:
    """A checkpoint's manifest as the run folder reads it (settings in 'config')."""
    manifest = {"world_size": 1, "accum_steps": 2, "objects": {"config": {"state": settings}}}
    return CheckpointInfo(4, Path("/nowhere/checkpoints/step-000004"), manifest)


GPT = [
    "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16",
    "--micro-batch-size", "2", "--accum-steps", "1", "--eval-batches", "1",
    "--sample-tokens", "0", "--warmup", "1", "--max-steps", "1",
]  # fmt: skip

HF = [
    "--seq-len", "32", "--micro-batch-size", "2", "--accum-steps", "1", "--eval-batches", "1",
    "--sample-tokens", "0", "--warmup", "1", "--max-steps", "1",
]  # fmt: skip


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run the CLI, expect exit status 2 and one error line; return that line."""
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if " error: " in line]
    assert len(lines) == 1, err
    return lines[0]


def train(capsys: Any, tmp_path: Path, *flags: str, model: Path | None = None) -> str:
    """``refused`` for a tiny run into ``tmp_path/run``: the demo GPT, or ``hf:model``."""
    size = GPT if model is None else ["--model", f"hf:{model}", *HF]
    return refused(capsys, "train", *size, "--out", str(tmp_path / "run"), *flags)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return text_corpus(tmp_path_factory.mktemp("data") / "corpus")


TINY = [
    "--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32",
    "--micro-batch-size", "2", "--eval-every", "0", "--eval-batches", "2",
    "--sample-tokens", "0", "--warmup", "1",
]  # fmt: skip

RAMP = ["--batch-ramp", "1:2", "--accum-steps", "4", "--max-steps", "2", "--save-every", "1"]


def _train_ramped_on_two_ranks(rank: int, world: int, data: str, out: str) -> int:
    argv = ["train", *TINY, *RAMP, "--data", data, "--strategy", "ddp", "--device", "cpu"]
    return main([*argv, "--out", out])


def test_an_older_hf_checkpoint_with_gpt_shape_ints_still_resumes() -> None:
    """Checkpoints of hf: runs saved n_layer 4, n_head 4, d_model 160 (the GPT defaults)."""
    saved = TrainConfig(model="hf:cfg", accum_steps=2, max_steps=4).to_dict()
    saved.update(GPT_SHAPE)  # what an older gradstep recorded
    for name in run_folder.ENVIRONMENT:
        saved.pop(name)
    now = TrainConfig(max_steps=8)  # `--resume --max-steps 8`, no --model: the checkpoint's
    info = _fake_checkpoint(saved)
    merged, notes = run_folder.resumed_settings(now, info, frozenset({"max_steps"}), 1)
    assert merged.model == "hf:" + os.path.abspath("cfg") and merged.max_steps == 8
    assert (merged.n_layer, merged.n_head, merged.d_model) == (None, None, None)
    assert not any("n_layer" in line for line in notes)
    # No horizon saved with its schedule (older checkpoints): the run's max_steps is.
    assert run_folder.schedule_horizon(info) == 4
    assert any("keeps the checkpoint's max_steps 4" in line for line in notes), notes


def test_the_mesh_is_where_a_run_runs_not_the_runs_setting() -> None:
    """A checkpoint of a --tp run resumes with any --tp (or none): the flags are this
    invocation's, like --strategy, and checkpoints do not record them as run settings."""
    assert {"tp", "hsdp", "strategy"} <= ENVIRONMENT


@pytest.mark.parametrize("entry", ["checkpoints", "metrics.jsonl"])
def test_overwrite_refuses_a_symlinked_entry_before_deleting_anything(
    tmp_path, corpus, capsys, entry
) -> None:
    """SY1: 'Cannot call rmtree on a symbolic link', after config.json was deleted."""
    precious, out = tmp_path / "precious", tmp_path / "run"
    for folder in (precious, out):
        folder.mkdir(parents=True)
    (precious / "file.txt").write_text("keep me")
    (out / "config.json").write_text("{}")
    target = precious if entry == "checkpoints" else precious / "file.txt"
    (out / entry).symlink_to(target)
    line = train(capsys, tmp_path, "--data", str(corpus), "--overwrite")
    assert f"--overwrite: {str(out / entry)!r} (-> {str(target)!r}): a symbolic link" in line
    assert "nothing was deleted" in line, line
    assert (out / "config.json").exists()
    assert (out / entry).is_symlink() and (precious / "file.txt").read_text() == "keep me"


@pytest.mark.parametrize("entry", ["checkpoints", "metrics.jsonl", "summary.json"])
def test_overwrite_refuses_a_dangling_symlinked_entry_too(tmp_path, corpus, capsys, entry) -> None:
    """SY1 for a link whose target is gone (checkpoints kept on a disk not mounted now): it is
    an entry of the run all the same, refused before anything is deleted; the run never
    writes through it (which would create the target outside the run folder)."""
    out, target = tmp_path / "run", tmp_path / "unmounted" / entry
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / entry).symlink_to(target)
    line = train(capsys, tmp_path, "--data", str(corpus), "--overwrite")
    assert f"--overwrite: {str(out / entry)!r} (-> {str(target)!r}): a symbolic link" in line
    assert "nothing was deleted" in line, line
    assert (out / "config.json").exists() and (out / entry).is_symlink()
    assert not target.exists() and not target.parent.exists()


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
