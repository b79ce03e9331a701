"""The ``integration`` lists in tests/conftest.py name tests that exist, and the guard that
keeps process-starting tests out of ``make test-fast`` catches one."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from tests.conftest import INTEGRATION_MODULES, INTEGRATION_TESTS, ROOT, _starts_python


def _test_names(path: str) -> set[str]:
    tree = ast.parse((ROOT / path).read_text())
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


@pytest.mark.parametrize("path", INTEGRATION_MODULES)
def test_every_listed_module_exists(path: str) -> None:
    assert (ROOT / path).is_file(), f"tests/conftest.py INTEGRATION_MODULES: {path} is gone"


@pytest.mark.parametrize("entry", INTEGRATION_TESTS)
def test_every_listed_test_exists(entry: str) -> None:
    path, name = entry.split("::")
    assert (ROOT / path).is_file() and name in _test_names(path), (
        f"tests/conftest.py INTEGRATION_TESTS: {entry} is gone (renamed or moved?)"
    )


def test_no_test_is_listed_twice() -> None:
    assert len(set(INTEGRATION_MODULES)) == len(INTEGRATION_MODULES)
    assert len(set(INTEGRATION_TESTS)) == len(INTEGRATION_TESTS)
    listed = {entry.split("::")[0] for entry in INTEGRATION_TESTS}
    assert not listed & set(INTEGRATION_MODULES)  # a whole module needs no single entries


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
    """A fresh pytest run, with this conftest, of one unmarked test that runs Python."""
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makepyfile(
        test_new="import subprocess, sys\n"
        "def test_spawns():\n"
        "    subprocess.run([sys.executable, '-c', 'pass'], check=True)\n"
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*starts a process but is not marked integration*"])


def test_a_non_python_program_is_allowed() -> None:
    assert subprocess.run(["true"], check=False).returncode == 0
