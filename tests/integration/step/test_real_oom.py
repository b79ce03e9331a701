"""Out-of-memory as the allocators really report it, under a real address-space limit.

A child process per precision (``real_oom_child.py``) warms up, takes an unlimited
reference step, compiles the kernels of every halved micro-batch size, then caps
``RLIMIT_AS`` a little above what it uses and takes the same step with
``Stepper(on_oom="split")``. Under the cap torch's CPU allocator fails (``RuntimeError:
... DefaultCPUAllocator: can't allocate memory``). The window must be split and its update
must equal the reference's: fp32 to 1e-5 (relative, whole update; only the summation order
over micro-batches differs), bf16 autocast to 5e-3 (its matmuls round per micro-batch;
bf16's epsilon is 7.8e-3).

The kernels are compiled before the cap because oneDNN in torch 2.13 cannot recover from a
kernel it failed to compile for lack of memory (``could not create a primitive``): the
failure stays in a thread-local flag and every later new kernel on that thread fails too,
whatever the memory (see the child's docstring). Left under the cap, that made this test
pass or fail by where the cap happened to bite (about half the bf16 runs failed).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from gradstep.memory.process import _KERNEL_CACHES

CHILD = Path(__file__).with_name("real_oom_child.py")
TOLERANCE = {"fp32": 1e-5, "bf16": 5e-3}


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(resource, "RLIMIT_AS"),
    reason="needs Linux's RLIMIT_AS and /proc/self/status",
)
@pytest.mark.timeout(180)
def test_a_real_out_of_memory_splits_the_window_and_keeps_the_update():
    # The child starts from this process's environment minus what earlier tests of this
    # process may have set (gradstep bounds oneDNN's caches through the environment).
    env = {k: v for k, v in os.environ.items() if k not in _KERNEL_CACHES}
    for _ in range(3):
        proc = subprocess.run(
            [sys.executable, str(CHILD), *TOLERANCE],
            capture_output=True,
            text=True,
            timeout=170,
            cwd=CHILD.parents[3],
            env=env,
        )
        # Under a hard address-space cap native code (a thread's stack, a C++ allocation
        # outside torch's allocator) may die by a signal before any Python error exists:
        # seen in a few whole-suite runs under load, never alone. That is the cap, not gradstep;
        # a Python-level failure (rc 1: e.g. an unrecognised RuntimeError) is not retried.
        if proc.returncode >= 0:
            break
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    outcome = json.loads(proc.stdout.strip().splitlines()[-1])
    for precision, tol in TOLERANCE.items():
        got = outcome[precision]
        assert got["splits"], (precision, got)  # the limit really made it split
        assert got["rel_err"] < tol, (precision, got)
