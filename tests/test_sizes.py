"""The size budget the project keeps, measured: no module of the library or the command line
over 400 lines, no function over 60 (from its first decorator to its end, docstring
included). A budget is an alarm for a split by concern, not a target."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGES = ("gradstep", "gradstep_cli")
MODULE_LINES, FUNCTION_LINES = 400, 60


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (SRC / pkg).rglob("*.py"))


def _functions(path: Path) -> list[tuple[str, int]]:
    """(qualified name, lines) of every function and method in ``path``."""
    out = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([d.lineno for d in child.decorator_list] + [child.lineno])
                out.append((f"{prefix}{child.name}", child.end_lineno - start + 1))
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")

    walk(ast.parse(path.read_text()), "")
    return out


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_is_over_400_lines(package: str) -> None:
    long = {
        str(p.relative_to(SRC)): n
        for p in _modules()
        if p.is_relative_to(SRC / package) and (n := len(p.read_text().splitlines())) > 400
    }
    assert not long, long


@pytest.mark.parametrize("package", PACKAGES)
def test_no_function_is_over_60_lines(package: str) -> None:
    long = {
        f"{p.relative_to(SRC)}:{name}": n
        for p in _modules()
        if p.is_relative_to(SRC / package)
        for name, n in _functions(p)
        if n > FUNCTION_LINES
    }
    assert not long, long
