"""The tests of tests/checkpoint/test_lease.py that start processes or run the CLI end to end;
its other tests stay there.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gradstep.checkpoint import Checkpointer, lease
from tests.checkpoint.test_lease import _model, _steps

pytestmark = pytest.mark.skipif(lease.fcntl is None, reason="leases need flock (POSIX)")


_HOLDER = """
import sys, time
from gradstep.checkpoint import read_lease
with read_lease(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_killed_readers_lease_never_blocks_pruning(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, keep=1)
    first = ckpt.save(1, model=_model())
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(first)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        ckpt.save(2, model=_model())
        assert "step-000001" in _steps(tmp_path)  # another process's lease holds it
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        holder.stdout.close()
    ckpt.save(3, model=_model())  # the kernel dropped the dead reader's lock
    assert _steps(tmp_path) == ["step-000003"]
    assert not list(tmp_path.glob(".*"))  # no lease file, nothing left behind
