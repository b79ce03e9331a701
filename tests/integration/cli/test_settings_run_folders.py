"""Run-folder rules as properties (gradstep_cli.run.folder), where an independent mutation
audit found surviving bugs (issue 20, section 4):

- a folder holding another run is never modified, whatever combination of --resume DIR,
  --out, --overwrite and --resume-or-start is given (every --out against every way to
  start or resume, each case on fresh copies of two runs, compared by a hash of every file
  and folder);
- a ramped run resumed on another world size is refused, and nothing is written;
- an exact global batch resumed on another world size keeps the LR clock (the split into
  micro-batches per rank differs: 3 on 1 rank, 2 on 2 ranks for 6 sequences of 2).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

from gradstep_cli.cli import main
from tests.support.asserts import tree_hash
from tests.support.batches import text_corpus

TINY = [
    "--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "32",
    "--micro-batch-size", "2", "--accum-steps", "2", "--eval-every", "0",
    "--eval-batches", "2", "--sample-tokens", "0", "--warmup", "1",
]  # fmt: skip

OUTS = ["B", "A/checkpoints", "A/checkpoints/step-000002", "A/sub", "new", "."]
MODES = [
    [], ["--overwrite"], ["--resume-or-start"], ["--resume"],
    ["--resume", "A"], ["--resume", "A/checkpoints"], ["--resume", "A/checkpoints/step-000002"],
    ["--resume", "B/checkpoints/step-000001"],  # B's own older checkpoint
    ["--resume", "B/imported/step-000002"],  # A's checkpoint kept inside B: another run's
    # What the flags exclude: refused before anything is looked at.
    ["--resume", "A", "--overwrite"], ["--resume-or-start", "--overwrite"],
    ["--resume", "A", "--resume-or-start"],
]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """Two finished 2-step runs, A and B, with a checkpoint at every step; B also keeps a
    copy of A's checkpoints (B/imported)."""
    root = tmp_path_factory.mktemp("folders")
    data = str(text_corpus(root / "data"))
    for name in ("A", "B"):
        argv = ["train", *TINY, "--data", data, "--max-steps", "2", "--save-every", "1"]
        assert main([*argv, "--out", str(root / "templates" / name)]) == 0
    shutil.copytree(root / "templates/A/checkpoints", root / "templates/B/imported")
    return data, root / "templates"


def may_change_b(out: str, mode: list[str]) -> bool:
    """The invocations that may change B: B is their --out, and they either start over in
    it or continue B's own checkpoints (the flags' exclusions aside)."""
    own = mode in (["--resume"], ["--resume-or-start"], ["--resume", "B/checkpoints/step-000001"])
    return out == "B" and (own or mode == ["--overwrite"])


def test_a_folder_holding_another_run_is_never_modified(runs, tmp_path, monkeypatch, capsys):
    data, templates = runs
    cases = [(out, mode) for out in OUTS for mode in MODES]
    for i, (out, mode) in enumerate(cases):
        case = tmp_path / f"case{i}"
        for name in ("A", "B"):
            shutil.copytree(templates / name, case / name)
        before = {name: tree_hash(case / name) for name in ("A", "B")}
        monkeypatch.chdir(case)  # relative --out/--resume, as a user types them
        flags = ["--out", out, *mode]
        code = main(["train", *TINY, "--data", data, "--max-steps", "3", *flags])
        err = capsys.readouterr().err
        assert code in (0, 2) and "Traceback" not in err, (flags, err)
        assert tree_hash(case / "A") == before["A"], (flags, code, err)
        if not may_change_b(out, mode):
            assert tree_hash(case / "B") == before["B"], (flags, code, err)
        else:  # and these work: B's own run goes on, or starts over as asked
            assert code == 0 and tree_hash(case / "B") != before["B"], (flags, err)
        shutil.rmtree(case)


def test_a_project_folder_with_checkpoints_of_its_own_is_not_a_run(runs, tmp_path):
    """The nesting rule looks for runs (metrics.jsonl) and checkpoints folders, not for a
    project that keeps its own gradstep checkpoints and a config.json at its root."""
    data, templates = runs
    project = tmp_path / "project"
    shutil.copytree(templates / "A" / "checkpoints", project / "checkpoints")
    (project / "config.json").write_text("{}")
    out = project / "runs" / "demo"
    assert main(["train", *TINY, "--data", data, "--max-steps", "1", "--out", str(out)]) == 0


def _resume_on_two_ranks(rank: int, world: int, data: str, root: str) -> dict:
    """Each rank runs the CLI as torchrun would start it; stderr is kept for the caller."""
    results = {}
    for name, source in (("ramp", "ramped"), ("exact", "straight/checkpoints/step-000002")):
        err = io.StringIO()
        argv = ["train", *TINY, "--data", data, "--strategy", "ddp", "--device", "cpu",
                "--resume", f"{root}/{source}", "--out", f"{root}/{name}-2ranks"]  # fmt: skip
        if name == "exact":
            argv += ["--global-batch", "6", "--max-steps", "4"]
        with contextlib.redirect_stderr(err):
            results[name] = (main(argv), err.getvalue())
    return results


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_resumes_on_another_world_size(tmp_path: Path) -> None:
    """A ramped run's micro-batches per rank do not rescale: its resume on 2 ranks is
    refused, nothing written. An exact global batch resumed on 2 ranks trains the LRs of
    the uninterrupted 1-rank run (its clock counted 3 micro-batches a step, now 4)."""
    from tests.support.multiproc import run_ranks

    data = str(text_corpus(tmp_path / "data"))
    base = ["train", *TINY, "--data", data]
    ramp = ["--batch-ramp", "1:2", "--accum-steps", "4", "--max-steps", "3", "--save-every", "1"]
    assert main([*base, *ramp, "--out", str(tmp_path / "ramped")]) == 0
    exact = ["--global-batch", "6", "--save-every", "1"]
    assert main([*base, *exact, "--max-steps", "4", "--out", str(tmp_path / "straight")]) == 0
    before = tree_hash(tmp_path / "ramped")
    first, second = run_ranks(_resume_on_two_ranks, 2, data, str(tmp_path), timeout=240)
    for rank in (first, second):
        code, err = rank["ramp"]
        assert code == 2 and "resume it on 1, not 2" in err, err
        assert rank["exact"][0] == 0, rank["exact"][1]
    assert tree_hash(tmp_path / "ramped") == before
    refused = tmp_path / "ramp-2ranks"
    assert sorted(p.name for p in refused.iterdir()) == [".gradstep.lock"]
    assert (refused / ".gradstep.lock").read_text() == ""  # not even claimed

    def lrs(out: str) -> dict[int, float]:
        lines = (tmp_path / out / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["lr"] for r in map(json.loads, lines)}

    resumed, straight = lrs("exact-2ranks"), lrs("straight")
    assert sorted(resumed) == [3, 4]  # a run resumed into a new folder logs its own steps
    assert [resumed[s] for s in (3, 4)] == [straight[s] for s in (3, 4)]
