"""Shared test settings: deterministic CPU, small hypothesis budgets (CI has 2 cores), and
the ``integration`` marker that keeps ``make test-fast`` fast."""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.process
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, settings

pytest_plugins = ("pytester",)  # tests/test_markers.py runs the marker guard in a fresh session

settings.register_profile(
    "gradstep",
    max_examples=int(os.environ.get("GRADSTEP_HYPOTHESIS_EXAMPLES", "12")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
settings.load_profile("gradstep")

# Tiny models: one intra-op thread is as fast, and 2-rank tests do not oversubscribe 2 cores.
torch.set_num_threads(1)

# Token stores and datasets' Arrow caches of the tests' data go to one temporary folder (child
# processes inherit it), not the user's ~/.cache.
if "GRADSTEP_CACHE" not in os.environ:
    os.environ["GRADSTEP_CACHE"] = tempfile.mkdtemp(prefix="gradstep-test-cache-")
    atexit.register(shutil.rmtree, os.environ["GRADSTEP_CACHE"], True)
os.environ.setdefault("HF_DATASETS_CACHE", os.path.join(os.environ["GRADSTEP_CACHE"], "datasets"))

ROOT = Path(__file__).resolve().parents[1]

# ``integration``: tests that start processes (a subprocess, torchrun, gloo ranks through
# tests.support.multiproc.run_ranks), run an example, or run the CLI end to end (a
# `main([...])` that trains or plans). They hold most of the suite's time; `make test-fast`
# leaves them out, `make test` (CI) runs them. Such a test lives in tests/integration/, at
# the place its unit tests have under tests/ (tests/integration/cli/test_export.py,
# tests/integration/checkpoint/test_checkpoint.py), and is marked by its place; a test
# marked `distributed` starts ranks too and gets the marker wherever it lives. CLI refusals
# (bad flags, --help) stay in the fast loop: they stop before any step, in milliseconds.
# `_no_unmarked_processes` fails any other test that starts a Python process, so the fast
# loop cannot silently slow down again (tests/test_markers.py checks both rules).
INTEGRATION = Path(__file__).resolve().parent / "integration"

# Tests that `make test-fast` leaves out, and that may therefore start processes.
HEAVY_MARKERS = ("integration", "distributed", "slow", "combinations", "cuda")


def is_integration(item: pytest.Item) -> bool:
    """Under tests/integration/, or marked ``distributed``."""
    return item.path.is_relative_to(INTEGRATION) or bool(item.get_closest_marker("distributed"))


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if is_integration(item):
            item.add_marker(pytest.mark.integration)


def _starts_python(args: Any) -> bool:
    """True for a command line that runs Python (``setpriv ... python -m x`` included)."""
    if isinstance(args, (str, bytes, os.PathLike)):
        args = os.fsdecode(args).split()
    for arg in map(os.fsdecode, args):
        if arg == sys.executable or Path(arg).name.startswith(("python", "torchrun")):
            return True
    return False


@contextlib.contextmanager
def _no_unmarked_processes(item: pytest.Item) -> Iterator[None]:
    """Fail a test left in the fast loop that starts a Python process or a
    multiprocessing one. Other programs (a compiler torch.compile calls) are allowed."""
    if any(item.get_closest_marker(m) for m in HEAVY_MARKERS):
        yield
        return
    message = (
        f"{item.nodeid} starts a process but is not marked integration: move it into "
        "tests/integration/, at its module's place (tests/x/test_y.py -> "
        "tests/integration/x/test_y.py)"
    )
    popen_init = subprocess.Popen.__init__

    def guarded_popen(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
        if _starts_python(args):
            pytest.fail(message, pytrace=False)
        popen_init(self, args, *rest, **kwargs)

    def refuse_start(self: multiprocessing.process.BaseProcess) -> None:
        pytest.fail(message, pytrace=False)

    with (
        mock.patch.object(subprocess.Popen, "__init__", guarded_popen),
        mock.patch.object(multiprocessing.process.BaseProcess, "start", refuse_start),
    ):
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    # Setup too: a module-scoped fixture may be what starts the ranks.
    with _no_unmarked_processes(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _no_unmarked_processes(item):
        return (yield)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
