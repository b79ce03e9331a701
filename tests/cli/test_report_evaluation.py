"""`gradstep report` shows the evaluations' accuracy and entropy (a plot of each) and the
run's --sample-prompts samples by step."""

from __future__ import annotations

import json
from pathlib import Path

from gradstep_cli.report import PLOTS, build_figures, load_run, write_report
from gradstep_cli.report_samples import load_samples


def _run(tmp_path: Path) -> Path:
    rows = [{"step": s, "loss": 3.0 - s / 10} for s in range(1, 5)]
    for row in rows[1::2]:
        row.update(val_loss=2.5, val_accuracy=0.1 * row["step"], val_entropy=4.0, val_items=9)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples = [
        {"step": 0, "index": 0, "prompt": "def f(", "completion": "x):<b>", "tokens": 3,
         "stop": "eos"},
        {"step": 2, "index": 0, "prompt": [{"role": "user", "content": "hi"}],
         "completion": "hello", "tokens": 2, "stop": "length"},
    ]  # fmt: skip
    lines = "".join(json.dumps(s) + "\n" for s in samples) + '{"step": 4, "comp'
    (tmp_path / "samples.jsonl").write_text(lines)
    return tmp_path


def test_val_accuracy_and_entropy_are_plotted_where_measured(tmp_path: Path) -> None:
    assert {"val_accuracy", "val_entropy"} <= set(PLOTS)
    figures = build_figures([load_run(_run(tmp_path))])
    (line,) = figures["val_accuracy"].axes[0].get_lines()
    assert list(line.get_xdata()) == [2, 4]
    assert list(line.get_ydata()) == [0.2, 0.4]


def test_the_page_shows_the_samples_by_step(tmp_path: Path) -> None:
    run = _run(tmp_path)
    assert [s["step"] for s in load_samples(run)] == [0, 2]  # the half line is left out
    page = write_report([run], tmp_path / "out").read_text()
    assert "Samples: " in page and "x):&lt;b&gt;" in page and "[1 messages] user: hi" in page
    assert (tmp_path / "out" / "val_accuracy.png").is_file()
