"""The tests of tests/checkpoint/test_names_and_full_disk.py that start processes or run the CLI
end to end; its other tests stay there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gradstep.errors import GradstepError

ROOT = Path(__file__).resolve().parents[3]  # full_disk_child runs with -m from the repo root


@pytest.fixture(scope="module")
def full_disk(tmp_path_factory: pytest.TempPathFactory) -> dict:
    directory = tmp_path_factory.mktemp("full")
    cmd = [sys.executable, "-m", "tests.checkpoint.full_disk_child", str(directory)]
    if os.geteuid() == 0 and shutil.which("setpriv"):  # root ignores a read-only folder
        cmd = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    "name", ["model.safetensors", "optimizer.safetensors", "rng-rank00000.json", "manifest.json"]
)
def test_a_full_disk_is_one_checkpoint_error_naming_the_file(full_disk: dict, name: str) -> None:
    case = full_disk[name]
    error = case["error"]
    assert error is not None, "the save went through: the limit did not bite"
    assert error["type"] == "CheckpointError"
    assert {GradstepError.__name__, "ValueError"} <= set(error["mro"])
    assert error["filename"].endswith(f".tmp-step-000002/{name}"), error
    assert error["filename"] in error["message"] and "File too large" in error["message"]
    assert "step 2 not saved" in error["message"] and "ulimit -f" in error["message"]
    # The partial folder is gone, step 1 is intact and is what a resume loads.
    assert case["listing"] == ["step-000001"]
    assert case["loaded"] == 1 and case["loaded_equals_step_1"]


def test_a_read_only_checkpoint_folder_is_one_checkpoint_error(full_disk: dict) -> None:
    """N120: ``[Errno 13] Permission denied`` with the path, as an OSError; now one
    CheckpointError saying what to do, and nothing lost."""
    case = full_disk["read-only"]
    if case["error"] is None:
        pytest.skip("the folder's mode was bypassed (root without setpriv)")
    assert case["error"]["type"] == "CheckpointError"
    assert case["error"]["filename"].endswith(".tmp-step-000002")
    assert "Permission denied" in case["error"]["message"]
    assert "make the checkpoint folder writable" in case["error"]["message"]
    assert case["listing"] == ["step-000001"] and case["loaded"] == 1
