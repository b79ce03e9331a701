"""The line between the library and its command line, in content (docs/guide/cli.md, "The
library and the command line"): the library imports and runs without the CLI's packages, the CLI
uses only the library's public names, and the one library -> CLI edge (``python -m
gradstep``) says what to install when the CLI's packages are missing."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

from packaging.requirements import Requirement

import gradstep_cli
from gradstep_cli.cli import CLI_EXTRA
from gradstep_cli.config.checks import PRECISIONS

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
CLI = Path(gradstep_cli.__file__).parent


def test_the_cli_extra_is_what_pyproject_declares():
    """The command line's check and the ``cli`` extra name the same packages."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in extras["optional-dependencies"]["cli"]]
    assert {r.name for r in reqs if r.marker is None or r.marker.evaluate()} == set(CLI_EXTRA)
    for name in extras["dependencies"]:
        assert Requirement(name).name not in {r.name for r in reqs}


def _library_imports(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, module, name) of every import of the library in ``path`` (name None for a
    plain ``import gradstep.x``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.partition(".")[0] == "gradstep":
                found += [(node.lineno, node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names if a.name == "gradstep"]
            found += [(node.lineno, a.name, None) for a in node.names if "gradstep." in a.name]
    return found


def _public(module_name: str, name: str | None) -> str | None:
    """Why ``from module_name import name`` is not public API (None: it is)."""
    parts = module_name.split(".")
    if any(part.startswith("_") for part in parts):
        return f"{module_name} is private"
    if len(parts) > 2:
        return f"{module_name} is inside {'.'.join(parts[:2])}: import from its __init__"
    module = importlib.import_module(module_name)
    if name is None:
        return None if hasattr(module, "__all__") else f"{module_name} has no __all__"
    target = getattr(module, name, None)
    if inspect.ismodule(target) and target.__name__ == f"{module_name}.{name}":
        return _public(target.__name__, None)
    if name not in getattr(module, "__all__", ()):
        return f"{name} is not in {module_name}.__all__"
    return None


def test_the_cli_imports_only_public_library_names():
    """Public (docs/guide/cli.md): in the ``__all__`` of ``gradstep``, of a subpackage's
    ``__init__`` or of a top-level module, none named with a leading underscore; a
    subpackage's own modules are its inside. Imports inside functions count too."""
    checked, wrong = 0, []
    for path in sorted(CLI.rglob("*.py")):
        for line, module, name in _library_imports(path):
            checked += 1
            why = _public(module, name)
            if why is not None:
                wrong.append(f"{path.relative_to(CLI)}:{line}: {why}")
    assert checked > 40 and not wrong, wrong


def test_the_rule_refuses_what_the_cli_used_to_import():
    assert _public("gradstep._validate", "check_choice") == "gradstep._validate is private"
    assert _public("gradstep.step.precision", "PRECISIONS") == (
        "gradstep.step.precision is inside gradstep.step: import from its __init__"
    )
    assert _public("gradstep.step", "PRECISIONS") == "PRECISIONS is not in gradstep.step.__all__"
    for inside in ("gradstep.checkpoint.codec", "gradstep.memory.plan"):
        assert _public(inside, "decode") == (
            f"{inside} is inside {inside.rpartition('.')[0]}: import from its __init__"
        )
    assert _public("gradstep.checkpoint", "saved_state") is None
    assert _public("gradstep.memory", "sweep_widths") is None
    assert _public("gradstep", "parallel") is None
    assert _public("gradstep.policies", "base") == (
        "gradstep.policies.base is inside gradstep.policies: import from its __init__"
    )


def test_the_clis_precisions_are_the_steppers():
    """The CLI lists ``--precision``'s choices itself (the library does not export its
    table); they must stay the Stepper's."""
    from gradstep.step.precision import PRECISIONS as STEPPER_PRECISIONS

    assert set(PRECISIONS) == set(STEPPER_PRECISIONS)
