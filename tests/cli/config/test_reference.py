"""The flag reference (gradstep_cli.config.reference): ``docs/reference/flags.md`` is what
``python -m gradstep_cli.config.reference`` writes from ``TrainConfig``, one table per
section."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from gradstep_cli.config.reference import PATH, render
from gradstep_cli.config.settings import SECTIONS, TrainConfig

ROOT = Path(__file__).resolve().parents[3]


def test_the_committed_reference_is_not_stale():
    committed = (ROOT / PATH).read_text()
    assert committed == render(), (
        f"{PATH} is stale: run python -m gradstep_cli.config.reference from the repository root"
    )


def test_every_flag_has_a_row_in_its_sections_table():
    text = render()
    tables = text.split("\n## ")[1:]
    assert [table.split("\n", 1)[0] for table in tables] == list(SECTIONS)
    for f in dataclasses.fields(TrainConfig):
        (table,) = [t for t in tables if t.startswith(f.metadata["section"] + "\n")]
        rows = [line for line in table.splitlines() if f"| `{f.name}` |" in line]
        assert len(rows) == 1 and "`--" + f.name.replace("_", "-") in rows[0], f.name
