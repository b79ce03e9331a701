"""Integration tests are chosen by their place: tests/conftest.py marks everything under
tests/integration/ (and every ``distributed`` test) ``integration``, the folder mirrors
tests/, and the guard that keeps process-starting tests out of ``make test-fast`` catches
one left outside it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import INTEGRATION, ROOT, _starts_python

MARKERS = """
[pytest]
markers =
    distributed: real multi-process gloo runs
    integration: starts processes or runs the CLI end to end
"""


def _session(pytester: pytest.Pytester) -> None:
    """A fresh pytest folder with this conftest: its tests/integration/ is ``integration/``."""
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makeini(MARKERS)


def test_the_integration_folder_mirrors_tests() -> None:
    """tests/integration/x/ exists only where tests/x/ does, and is a package (two modules
    of one name, tests/cli/test_cli.py and tests/integration/cli/test_cli.py, need it)."""
    assert (INTEGRATION / "__init__.py").is_file()
    for folder in (p for p in INTEGRATION.rglob("*") if p.is_dir() and p.name != "__pycache__"):
        place = folder.relative_to(INTEGRATION)
        assert (ROOT / "tests" / place).is_dir(), f"tests/integration/{place} mirrors nothing"
        assert (folder / "__init__.py").is_file(), f"tests/integration/{place}: no __init__.py"


def test_a_test_is_integration_by_its_place_or_by_distributed(
    pytester: pytest.Pytester,
) -> None:
    """``-m "not integration"`` (the fast loop) runs only the test outside integration/ that
    is not marked distributed."""
    _session(pytester)
    pytester.makepyfile(
        test_fast="def test_fast():\n    pass\n",
        test_ranks="import pytest\n@pytest.mark.distributed\ndef test_ranks():\n    pass\n",
    )
    for place in ("integration", "integration/cli"):
        folder = pytester.path / place
        folder.mkdir(parents=True)
        name = place.replace("/", "_")
        (folder / f"test_{name}.py").write_text(f"def test_{name}():\n    pass\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-m", "not integration")
    result.assert_outcomes(passed=1, deselected=3)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-m", "integration", "-v")
    result.assert_outcomes(passed=3, deselected=1)
    result.stdout.fnmatch_lines_random(["*test_ranks*PASSED*", "*test_integration_cli*PASSED*"])


@pytest.mark.parametrize(
    ("argv", "python"),
    [
        ([sys.executable, "-c", "pass"], True),
        (["setpriv", "--bounding-set", "-dac_override", sys.executable, "-m", "x"], True),
        (["torchrun", "--nproc_per_node=2", "-m", "gradstep"], True),
        ("python3 -c pass", True),
        (["g++", "-O2", "kernel.cpp"], False),
        ("uname -a", False),
    ],
)
def test_the_guard_knows_a_python_command_line(argv: list[str] | str, python: bool) -> None:
    assert _starts_python(argv) is python


def test_an_unmarked_test_that_starts_python_fails_with_what_to_do(
    pytester: pytest.Pytester,
) -> None:
    """A fresh pytest run, with this conftest, of one test outside integration/ that runs
    Python."""
    _session(pytester)
    pytester.makepyfile(
        test_new="import subprocess, sys\n"
        "def test_spawns():\n"
        "    subprocess.run([sys.executable, '-c', 'pass'], check=True)\n"
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*starts a process but is not marked integration: move it into tests/integration/*"]
    )


def test_a_non_python_program_is_allowed() -> None:
    assert subprocess.run(["true"], check=False).returncode == 0
