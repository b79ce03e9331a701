"""`gradstep report`: the plots hold the logged series, runs overlay, live runs are readable."""

from __future__ import annotations

import base64
import json
import math
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from matplotlib.lines import Line2D

import gradstep
from gradstep.metrics import MetricsLogger
from gradstep_cli.cli import main
from gradstep_cli.report import (
    PLOTS,
    ReportError,
    build_figures,
    latest_records,
    load_run,
    write_report,
)
from tests.support.batches import make_window
from tests.support.models import TinyLM

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def synthetic_records(n: int = 8, scale: float = 1.0) -> list[dict]:
    """Steps with known values: clipped on even steps, skipped at step 5, val every 4."""
    rows = []
    for i in range(1, n + 1):
        skipped = i == 5
        norm = math.inf if skipped else scale * (0.5 + i)
        clipped = not skipped and i % 2 == 0
        coef = min(1.0, 2.0 / norm) if clipped else 1.0
        row = {
            "loss": 3.0 / i, "items": 100 + i, "micro_batches": 4,
            "grad_norm": None if skipped else norm, "clip_coef": coef, "clipped": clipped,
            "skipped": skipped, "lr": 1e-3 * i, "step": i - (i >= 5),
            "skip_reason": "non-finite gradient norm" if skipped else None,
            "clip_threshold": None if skipped else 2.0,
            "post_clip_norm": None if skipped else norm * coef, "loss_scale": None,
            "policies": [], "tokens_per_s": 1000.0 + 10 * i, "step_time_s": 0.1,
            "peak_memory_mb": 300.0 + i, "memory_source": "max_rss", "elapsed_s": 0.1 * i,
        }  # fmt: skip
        if i % 4 == 0:
            row["val_loss"] = 3.5 / i
        rows.append(row)
    return rows


def write_run(path: Path, rows: list[dict], tail: str = "") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (path / "metrics.jsonl").write_text(text + tail)
    return path


def lines_by_label(fig) -> dict[str, Line2D]:
    (ax,) = fig.axes
    return {line.get_label(): line for line in ax.get_lines()}


def ydata(line: Line2D) -> np.ndarray:
    return np.asarray(line.get_ydata(), dtype=float)


@st.composite
def run_logs(draw: st.DrawFn) -> list[dict]:
    """What a Stepper logs: one record per window, ``step`` = steps taken so far (a
    skipped window keeps the step before it). At least one step is taken."""
    skips = draw(st.lists(st.booleans(), min_size=1, max_size=10).filter(lambda s: not all(s)))
    taken, rows = 0, []
    for window, skipped in enumerate(skips, start=1):
        taken += not skipped
        rows.append({"window": window, "step": taken, "skipped": skipped, "attempt": 1})
    return rows


def test_figures_hold_the_logged_series(tmp_path: Path) -> None:
    rows = synthetic_records()
    run = load_run(write_run(tmp_path / "r1", rows))
    figs = build_figures([run])
    assert list(figs) == list(PLOTS)
    xs = np.arange(1, 9)

    loss = lines_by_label(figs["loss"])
    assert set(loss) == {"r1 train", "r1 val"}
    np.testing.assert_array_equal(ydata(loss["r1 train"]), [r["loss"] for r in rows])
    np.testing.assert_array_equal(loss["r1 val"].get_xdata(), [4, 8])
    np.testing.assert_array_equal(ydata(loss["r1 val"]), [3.5 / 4, 3.5 / 8])

    gn = lines_by_label(figs["grad_norm"])
    expected = {"r1 pre-clip", "r1 post-clip", "r1 clip threshold", "r1 clipped", "r1 skipped"}
    assert expected <= set(gn) and figs["grad_norm"].axes[0].get_yscale() == "log"
    pre = ydata(gn["r1 pre-clip"])
    assert np.isnan(pre[4])  # the skipped step's inf norm is not drawn
    np.testing.assert_array_equal(np.delete(pre, 4), [0.5 + i for i in (1, 2, 3, 4, 6, 7, 8)])
    post = ydata(gn["r1 post-clip"])
    np.testing.assert_allclose(post[[1, 3, 5, 7]], 2.0, rtol=1e-12)  # clipped to threshold
    np.testing.assert_array_equal(post[[0, 2, 6]], [1.5, 3.5, 7.5])
    np.testing.assert_array_equal(gn["r1 clipped"].get_xdata(), [2, 4, 6, 8])
    np.testing.assert_array_equal(ydata(gn["r1 clipped"]), [2.5, 4.5, 6.5, 8.5])
    np.testing.assert_array_equal(gn["r1 skipped"].get_xdata(), [5, 5])  # axvline at x=5

    for key, field in (("clip_coef", "clip_coef"), ("lr", "lr"), ("tokens_per_s", None)):
        (line,) = figs[key].axes[0].get_lines()
        field = field or "tokens_per_s"
        np.testing.assert_array_equal(line.get_xdata(), xs)
        np.testing.assert_array_equal(ydata(line), [r[field] for r in rows])

    batch = lines_by_label(figs["batch"])
    assert set(batch) == {"r1 batch (items)"}  # no noise scale logged: no line for it
    np.testing.assert_array_equal(ydata(batch["r1 batch (items)"]), [r["items"] for r in rows])


def test_batch_plot_draws_the_noise_scale_where_it_was_measured(tmp_path: Path) -> None:
    rows = synthetic_records()
    for i, row in enumerate(rows):
        row["gns_b_simple"] = None if i < 2 else 50.0 * i
    figs = build_figures([load_run(write_run(tmp_path / "g", rows))])
    lines = lines_by_label(figs["batch"])
    noise = ydata(lines["g B_simple"])
    assert np.isnan(noise[:2]).all()  # not measurable yet: not drawn
    np.testing.assert_array_equal(noise[2:], [50.0 * i for i in range(2, 8)])
    assert figs["batch"].axes[0].get_yscale() == "log"


def test_report_writes_pngs_and_self_contained_html(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", synthetic_records())
    page = write_report([run])
    assert page == run / "report" / "report.html"
    html = page.read_text()
    for key in PLOTS:
        png = (run / "report" / f"{key}.png").read_bytes()
        assert png.startswith(PNG_MAGIC)
        assert f"data:image/png;base64,{base64.b64encode(png).decode()}" in html
    assert "<img" in html and 'src="http' not in html and "src='http" not in html
    assert ">finished<" not in html  # no summary.json: still being written


def test_two_runs_overlay_on_the_same_axes(tmp_path: Path) -> None:
    a = write_run(tmp_path / "base", synthetic_records())
    b = write_run(tmp_path / "big", synthetic_records(n=6, scale=3.0))
    figs = build_figures([load_run(a), load_run(b)])
    for key, fig in figs.items():
        assert len(fig.axes) == 1, key
        labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        assert any(t.startswith("base") for t in labels), key
        assert any(t.startswith("big") for t in labels), key
    gn = lines_by_label(figs["grad_norm"])
    assert gn["base pre-clip"].get_color() != gn["big pre-clip"].get_color()
    np.testing.assert_array_equal(ydata(gn["big pre-clip"])[:4], [4.5, 7.5, 10.5, 13.5])
    out = tmp_path / "cmp"
    assert main(["report", str(a), str(b), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted([*(f"{k}.png" for k in PLOTS),
                                                            "report.html"])  # fmt: skip
    assert "base" in (out / "report.html").read_text()


def test_same_folder_names_are_told_apart(tmp_path: Path) -> None:
    a = write_run(tmp_path / "x" / "run", synthetic_records())
    b = write_run(tmp_path / "y" / "run", synthetic_records())
    write_report([a, b], tmp_path / "out")
    labels = set(lines_by_label(build_figures([load_run(a, str(a)), load_run(b, str(b))])["lr"]))
    assert labels == {str(a), str(b)}
    assert str(a) in (tmp_path / "out" / "report.html").read_text()


def test_partial_last_line_is_ignored(tmp_path: Path) -> None:
    rows = synthetic_records()
    half = json.dumps(rows[0])[:40]  # a step caught mid-write
    run = write_run(tmp_path / "live", rows[:6], tail=half)
    loaded = load_run(run)
    assert loaded.partial_last_line and len(loaded.records) == 6
    page = write_report([run])
    assert "in progress" in page.read_text()
    (line,) = build_figures([loaded])["lr"].axes[0].get_lines()
    assert len(line.get_xdata()) == 6


def test_corrupt_middle_line_is_an_error_naming_the_line(tmp_path: Path) -> None:
    run = write_run(tmp_path / "bad", synthetic_records(3), tail="")
    text = (run / "metrics.jsonl").read_text().splitlines()
    text[1] = text[1][:10]
    (run / "metrics.jsonl").write_text("\n".join(text) + "\n")
    with pytest.raises(ReportError, match=r"metrics\.jsonl:2"):
        load_run(run)


def test_a_json_array_line_is_named_in_json_terms(tmp_path: Path) -> None:
    """N110: the message said ``got <class 'list'>``."""
    run = write_run(tmp_path / "arr", synthetic_records(2), tail="[1, 2]\n")
    with pytest.raises(
        ReportError, match=r"metrics\.jsonl:3: expected a JSON object, got a JSON array$"
    ):
        load_run(run)


def test_lines_copied_twice_report_each_step_once(tmp_path: Path) -> None:
    """N112: every line duplicated made a 4-step run report 8 steps and 8 clipped."""
    rows = synthetic_records(4)
    run = load_run(write_run(tmp_path / "dup", rows + rows))
    assert run.records == rows and run.replaced == 4
    page = write_report([run.path]).read_text()
    cells = re.findall(r"<td>([^<]*)</td>", page)
    assert cells[1:2] == ["4"] and "4 earlier record(s) replaced" in page
    assert cells[4] == str(sum(r["clipped"] for r in rows))


@given(log=run_logs())
def test_a_log_without_repeats_is_reported_as_written(log: list[dict]) -> None:
    assert latest_records(log) == (log, 0)


@given(log=run_logs())
def test_a_log_written_twice_counts_once_and_the_later_copy_wins(log: list[dict]) -> None:
    later = [{**r, "attempt": 2} for r in log]
    assert latest_records(log + later) == (later, len(log))


@given(log=run_logs(), data=st.data())
def test_a_resume_appended_to_an_uncut_log_replaces_what_it_reran(log: list[dict], data) -> None:  # noqa: ANN001
    """A run resumed from the checkpoint after window ``c``, its log not cut back (the
    library's MetricsLogger(append=True) leaves that to the caller), killed after window
    ``m >= c``: every step is taken once, by the rerun after the checkpoint. Only skipped
    windows at the checkpoint's step are ambiguous (consecutive skips look alike), so the
    claim leaves those out; nothing is lost or invented."""
    n = len(log)
    c = data.draw(st.integers(0, n - 1), label="checkpoint after window")
    m = data.draw(st.integers(c, n), label="killed after window")
    rerun = [{**r, "attempt": 2} for r in log[c:]]
    kept, dropped = latest_records(log[:m] + rerun)
    at_checkpoint = log[c - 1]["step"] if c else 0

    def clear(rows: list[dict]) -> list[dict]:
        return [r for r in rows if not (r["skipped"] and r["step"] == at_checkpoint)]

    assert clear(kept) == clear(log[:c] + rerun)
    assert len(kept) + dropped == m + len(rerun) and kept[-len(rerun) :] == rerun


def test_cli_errors_are_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text('{"loss": 1.0')  # nothing complete
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "no complete step" in capsys.readouterr().err


def test_report_on_a_run_still_being_written(tmp_path: Path) -> None:
    """A live MetricsLogger (file open) and a reader: every flushed step is reported."""
    model = TinyLM()
    stepper = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.2))
    with MetricsLogger(tmp_path) as logger:
        counts = []
        for seed in range(5):
            window, _ = make_window([[4, 7], [2]], seed=seed)
            t0 = time.perf_counter()
            stats = stepper.step(
                window, lambda m, mb: gradstep.token_loss(m(mb["input_ids"]), mb["labels"])
            )
            logger.log_step(stats, time.perf_counter() - t0)
            if seed in (2, 4):
                write_report([tmp_path])
                html = (tmp_path / "report" / "report.html").read_text()
                counts.append(int(re.search(r"<td>(\d+)</td>", html).group(1)))
    assert counts == [3, 5]
    (line,) = build_figures([load_run(tmp_path)])["clip_coef"].axes[0].get_lines()
    assert len(line.get_xdata()) == 5
