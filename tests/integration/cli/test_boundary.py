"""The tests of tests/cli/test_boundary.py that start processes or run the CLI end to end; its
other tests stay there.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.cli.test_boundary import ROOT

# Makes ``import tqdm`` / ``import tomli`` fail as if they were not installed.
BLOCK = """
import sys

class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("tqdm", "tomli"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
"""


def run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


def test_the_library_imports_every_module_without_the_cli_extra():
    walk = """
import pkgutil, sys, gradstep
names = [m.name for m in pkgutil.walk_packages(gradstep.__path__, "gradstep.")
         if m.name != "gradstep.__main__"]
for name in names:
    __import__(name)
loaded = [m for m in ("tqdm", "tomli", "gradstep_cli") if m in sys.modules]
print(len(names), loaded)
"""
    done = run_python(BLOCK + walk)
    assert done.returncode == 0, done.stderr
    count, loaded = done.stdout.split(maxsplit=1)
    assert int(count) > 40 and loaded.strip() == "[]", done.stdout


@pytest.mark.parametrize("blocked", [True, False])
def test_python_m_gradstep_without_the_cli_extra_says_what_to_install(blocked):
    main = 'import runpy, sys; sys.argv = ["gradstep", "train", "--help"]\n'
    main += 'runpy.run_module("gradstep", run_name="__main__", alter_sys=True)\n'
    done = run_python((BLOCK if blocked else "") + main)
    if not blocked:  # installed: the help, as always
        assert done.returncode == 0 and "--micro-batch-size" in done.stdout, done.stderr
        return
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip() == (
        "gradstep: the command line needs tqdm, which the library does not: "
        "pip install 'gradstep[cli]'"
    )
