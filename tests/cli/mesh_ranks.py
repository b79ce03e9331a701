"""Rank side of test_mesh_runs.py: several ``gradstep`` command lines, one after the other,
on the ranks of one ``run_ranks`` job (what ``torchrun -m gradstep`` runs on each rank; the
job's process group is reused, so one start serves every run)."""

from __future__ import annotations

import contextlib
import io


def cli_runs(rank: int, world: int, argvs: list[list[str]]) -> list[tuple[int, str, str]]:
    """``(exit status, stdout, stderr)`` of ``gradstep_cli.cli.main(argv)`` per argv."""
    from gradstep_cli.cli import main

    out = []
    for argv in argvs:
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            rc = main(argv)
        out.append((rc, stdout.getvalue(), stderr.getvalue()))
    return out
