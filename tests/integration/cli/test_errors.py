"""`gradstep report` on a number it cannot draw and an --out it cannot write: one clear
message, never a traceback (rows 87 and 89 of the robustness probe,
shared/reviews/robustness.md). The other user mistakes are tested beside the module that
refuses them, and the one-line error contract in test_cli.py."""

from __future__ import annotations

import json

import pytest

from gradstep_cli.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def test_report_errors_and_overflowing_numbers(tmp_path, capsys):
    runs = tmp_path / "run"
    runs.mkdir()
    rows = [{"step": 1, "loss": 10**400, "grad_norm": 1.0}, {"step": 2, "loss": 1.0}]
    (runs / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, _ = run(capsys, "report", str(runs))  # row 87: a huge integer is not drawable
    assert code == 0 and (runs / "report" / "report.html").exists()
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, err = run(capsys, "report", str(runs), "--out", str(afile))  # row 89
    assert code == 2 and "cannot write the report" in err
