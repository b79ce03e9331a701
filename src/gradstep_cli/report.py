"""``gradstep report``: PNG plots and one self-contained HTML page from run folders.

Reads ``RUN_DIR/metrics.jsonl`` (one JSON object per optimizer step, as written by
:class:`~gradstep.metrics.MetricsLogger`) and draws, for every run on the same axes:

* ``loss``: train loss per step and validation loss where measured;
* ``val_accuracy``, ``val_entropy``: the evaluations' token accuracy and mean entropy;
* below the plots, each run's ``samples.jsonl`` (``--sample-prompts``) by step;
* ``grad_norm``: pre- and post-clip global gradient norm on a log axis, the clip threshold,
  clipped steps (circles) and skipped steps (vertical lines);
* ``clip_coef``, ``lr`` and ``tokens_per_s``.

A run can be reported while it is still being written: the writer flushes whole lines, so a
reader can only ever catch the *last* line half-written, and an unterminated last line is
ignored. Any other unreadable line is an error naming the file and line number. A step
logged twice (a log appended after a resume without being cut back, lines copied twice)
counts once: the later records win (:func:`latest_records`).

Figures are built with ``matplotlib.figure.Figure`` (no pyplot global state, Agg rendering)
so :func:`build_figures` can be called from tests and notebooks and its lines inspected.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradstep.errors import GradstepError
from gradstep.metrics import FINISHED_FILE
from gradstep_cli.report_samples import samples_html

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "PLOTS",
    "ReportError",
    "RunMetrics",
    "build_figures",
    "latest_records",
    "load_run",
    "write_report",
]

PLOTS = (
    "loss", "val_accuracy", "val_entropy", "grad_norm", "clip_coef", "lr", "tokens_per_s",
    "memory", "batch",
)  # fmt: skip
_TITLES = {
    "loss": "Loss (token-weighted mean per step)",
    "val_accuracy": "Validation token accuracy (argmax = target)",
    "val_entropy": "Validation mean token entropy (nats)",
    "grad_norm": "Global gradient norm (log scale)",
    "clip_coef": "Clip coefficient (1 = not clipped)",
    "lr": "Learning rate",
    "tokens_per_s": "Throughput (tokens/s)",
    "memory": "Peak memory (MiB): measured, and the plan's prediction",
    "batch": "Batch in use (items per step) and the gradient noise scale B_simple",
}


# What a metrics line that is valid JSON but not an object is, in JSON's own words.
_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}
_JSON_KINDS[type(None)] = "null"


class ReportError(GradstepError, ValueError):
    """A run folder cannot be reported; the message names the file."""


@dataclass
class RunMetrics:
    """One run's step records, in file order."""

    name: str
    path: Path
    records: list[dict[str, Any]]
    partial_last_line: bool
    """True when an unterminated last line (a step being written) was ignored."""
    replaced: int = 0
    """Records dropped because a later record took the same step again (see :func:`load_run`)."""

    def series(self, key: str) -> list[float]:
        """``key`` per step as floats; missing, null and non-numeric values become nan."""
        out = []
        for rec in self.records:
            value = rec.get(key)
            ok = isinstance(value, (int, float))
            try:
                out.append(float(value) if ok else math.nan)
            except OverflowError:  # an integer beyond float range: not drawable
                out.append(math.nan)
        return out

    @property
    def steps(self) -> list[int]:
        """x axis: the window index (1-based, over the kept records), which also advances on
        skips."""
        return list(range(1, len(self.records) + 1))


def _position(rec: dict[str, Any]) -> tuple[float, int] | None:
    """Where a record sits in a run: ``(step, 0)`` for the window that took ``step``,
    ``(step, 1)`` for a skipped window (``step`` counts steps taken, so a skip keeps the
    step before it); None without a numeric ``step``."""
    step = rec.get("step")
    if isinstance(step, bool) or not isinstance(step, (int, float)) or step != step:
        return None
    return (step, int(rec.get("skipped") is True))


def latest_records(records: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """``records`` with each rewound stretch replaced by the later one: ``(kept, dropped)``.

    A record that goes back (a step taken again, or a skipped window before the previous
    record's step) means the log was rewound: a run resumed from an older checkpoint and
    appended without cutting its log, or lines copied twice. The later records win, as a
    resumed run's do: every earlier record from that position on is dropped. Consecutive
    skipped windows at one step are normal and stay; records without a numeric ``step``
    never rewind.
    """
    kept: list[dict[str, Any]] = []
    where: list[tuple[float, int] | None] = []  # _position of each kept record
    dropped, last, newest = 0, None, -math.inf  # last position; highest step taken
    for rec in records:
        pos = _position(rec)
        back = pos is not None and (
            (last is not None and pos < last) or (pos[1] == 0 and pos[0] <= newest)
        )
        if back:  # rare: linear work is fine
            cut = next(i for i, w in enumerate(where) if w is not None and w >= pos)
            dropped += len(kept) - cut
            del kept[cut:], where[cut:]
            numbered = [w for w in where if w is not None]
            last = numbered[-1] if numbered else None
            newest = max((w[0] for w in numbered if w[1] == 0), default=-math.inf)
        kept.append(rec)
        where.append(pos)
        if pos is not None:
            last = pos
            newest = newest if pos[1] else max(newest, pos[0])
    return kept, dropped


def load_run(run_dir: str | Path, name: str | None = None) -> RunMetrics:
    """Read ``run_dir/metrics.jsonl``, tolerating a half-written last line.

    A step logged twice counts once: the later records replace a rewound stretch
    (:func:`latest_records`), and :attr:`RunMetrics.replaced` says how many were dropped.
    """
    path = Path(run_dir)
    metrics = path / "metrics.jsonl"
    if not path.is_dir():
        raise ReportError(f"run folder {str(path)!r} does not exist or is not a folder")
    if not metrics.is_file():
        raise ReportError(f"{str(metrics)!r} not found: is {str(path)!r} a gradstep run folder?")
    try:
        data = metrics.read_bytes()
    except OSError as exc:
        raise ReportError(f"cannot read {str(metrics)!r}: {exc.strerror or exc}") from None
    lines = data.split(b"\n")
    partial = lines[-1].strip() != b""  # no trailing newline: the writer is mid-line
    records = []
    for number, raw in enumerate(lines[:-1], start=1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ReportError(f"{metrics}:{number}: not a JSON object ({exc})") from exc
        if not isinstance(rec, dict):
            kind = _JSON_KINDS.get(type(rec), type(rec).__name__)
            raise ReportError(f"{metrics}:{number}: expected a JSON object, got a JSON {kind}")
        records.append(rec)
    if not records:
        raise ReportError(f"{str(metrics)!r} has no complete step yet; try again later")
    records, dropped = latest_records(records)
    return RunMetrics(name or path.resolve().name, path, records, partial, dropped)


def _finite(values: Sequence[float], positive: bool = False) -> list[float]:
    """nan where a value cannot be drawn (non-finite; <= 0 on a log axis)."""
    return [v if math.isfinite(v) and (v > 0 or not positive) else math.nan for v in values]


def _plot_loss(ax: Axes, run: RunMetrics, color: str) -> None:
    ax.plot(run.steps, _finite(run.series("loss")), color=color, label=f"{run.name} train")
    pairs = zip(run.steps, run.series("val_loss"), strict=True)
    val = [(x, v) for x, v in pairs if math.isfinite(v)]
    if val:
        xs, ys = zip(*val, strict=True)
        ax.plot(xs, ys, color=color, ls="--", marker="s", ms=4, label=f"{run.name} val")
    ax.set_ylabel("loss")


def _plot_measured(key: str, ylabel: str) -> Any:
    """A value measured on some steps only (evaluations): markers joined by a line."""

    def plot(ax: Axes, run: RunMetrics, color: str) -> None:
        pairs = [(x, v) for x, v in zip(run.steps, run.series(key), strict=True) if v == v]
        xs, ys = zip(*pairs, strict=True) if pairs else ((), ())
        ax.plot(xs, ys, color=color, ls="--", marker="s", ms=4, label=run.name)
        ax.set_ylabel(ylabel)

    return plot


def _plot_grad_norm(ax: Axes, run: RunMetrics, color: str) -> None:
    xs, pre = run.steps, _finite(run.series("grad_norm"), positive=True)
    ax.plot(xs, pre, color=color, label=f"{run.name} pre-clip")
    post = _finite(run.series("post_clip_norm"), positive=True)
    ax.plot(xs, post, color=color, ls="--", alpha=0.8, label=f"{run.name} post-clip")
    threshold = _finite(run.series("clip_threshold"), positive=True)
    if any(v == v for v in threshold):
        ax.plot(xs, threshold, color=color, ls=":", label=f"{run.name} clip threshold")
    flags = [(x, rec, p) for x, rec, p in zip(xs, run.records, pre, strict=True)]
    clipped = [(x, p) for x, rec, p in flags if rec.get("clipped") is True and p == p]
    if clipped:
        cx, cy = zip(*clipped, strict=True)
        ax.plot(cx, cy, ls="none", marker="o", mfc="none", color=color, label=f"{run.name} clipped")
    skipped = [x for x, rec, _ in flags if rec.get("skipped") is True]
    for i, x in enumerate(skipped):
        label = f"{run.name} skipped" if i == 0 else "_nolegend_"
        ax.axvline(x, color=color, ls="-.", lw=1, alpha=0.7, label=label)
    ax.set_yscale("log")
    ax.set_ylabel("global norm")


def _plot_simple(key: str, ylabel: str, log: bool = False) -> Any:
    def plot(ax: Axes, run: RunMetrics, color: str) -> None:
        ax.plot(run.steps, _finite(run.series(key), positive=log), color=color, label=run.name)
        if log:
            ax.set_yscale("log")
        ax.set_ylabel(ylabel)

    return plot


def _plot_memory(ax: Axes, run: RunMetrics, color: str) -> None:
    ax.plot(run.steps, _finite(run.series("peak_memory_mb")), color=color, label=f"{run.name} peak")
    planned = _finite(run.series("planned_peak_mb"))
    if any(v == v for v in planned):
        ax.plot(run.steps, planned, color=color, ls="--", label=f"{run.name} planned")
    ax.set_ylabel("MiB")


def _plot_batch(ax: Axes, run: RunMetrics, color: str) -> None:
    """Where B_simple lies above the batch, a larger batch would still cut the number of
    steps; below it, more items per step mostly average out noise that is already small."""
    batch = _finite(run.series("items"), positive=True)
    ax.plot(run.steps, batch, color=color, label=f"{run.name} batch (items)")
    noise = _finite(run.series("gns_b_simple"), positive=True)
    if any(v == v for v in noise):
        ax.plot(run.steps, noise, color=color, ls="--", label=f"{run.name} B_simple")
    ax.set_yscale("log")
    ax.set_ylabel("items")


_PLOTTERS = {
    "loss": _plot_loss,
    "val_accuracy": _plot_measured("val_accuracy", "accuracy"),
    "val_entropy": _plot_measured("val_entropy", "nats"),
    "grad_norm": _plot_grad_norm,
    "clip_coef": _plot_simple("clip_coef", "coefficient"),
    "lr": _plot_simple("lr", "learning rate"),
    "tokens_per_s": _plot_simple("tokens_per_s", "tokens/s"),
    "memory": _plot_memory,
    "batch": _plot_batch,
}


def build_figures(runs: Sequence[RunMetrics]) -> dict[str, Figure]:
    """One figure per entry of :data:`PLOTS`; every run overlaid, one colour per run."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:  # matplotlib is an optional extra
        raise ImportError("gradstep report needs matplotlib: pip install 'gradstep[plot]'") from exc
    if not runs:
        raise ReportError("build_figures: runs is empty; give at least one run")
    figures = {}
    for key in PLOTS:
        fig = Figure(figsize=(8, 3.6), layout="constrained")
        ax = fig.add_subplot()
        for i, run in enumerate(runs):
            _PLOTTERS[key](ax, run, f"C{i % 10}")
        ax.set_title(_TITLES[key])
        ax.set_xlabel("step (window)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small", loc="best")
        figures[key] = fig
    return figures


def _names(run_dirs: Sequence[Path]) -> list[str]:
    """Folder names as labels; full paths where two runs share a folder name."""
    names = [p.resolve().name for p in run_dirs]
    if len(set(names)) < len(names):
        return [str(p) for p in run_dirs]
    return names


def _summary_row(run: RunMetrics) -> dict[str, str]:
    def last(key: str) -> str:
        values = [v for v in run.series(key) if math.isfinite(v)]
        return f"{values[-1]:.4g}" if values else "-"

    tps = [v for v in run.series("tokens_per_s") if math.isfinite(v)]
    live = run.partial_last_line or not (run.path / FINISHED_FILE).exists()
    return {
        "run": run.name,
        "steps": str(len(run.records)),
        "last train loss": last("loss"),
        "last val loss": last("val_loss"),
        "clipped": str(sum(r.get("clipped") is True for r in run.records)),
        "skipped": str(sum(r.get("skipped") is True for r in run.records)),
        "median tokens/s": f"{statistics.median(tps):,.0f}" if tps else "-",
        "peak memory MiB": last("peak_memory_mb"),
        "last val accuracy": last("val_accuracy"),
        "status": "in progress" if live else "finished",
    }


def _html(runs: Sequence[RunMetrics], images: dict[str, bytes]) -> str:
    rows = [_summary_row(run) for run in runs]
    head = "".join(f"<th>{html.escape(k)}</th>" for k in rows[0])
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row.values()) + "</tr>"
        for row in rows
    )
    figures = "".join(
        f'<figure><img alt="{key}" src="data:image/png;base64,'
        f'{base64.b64encode(png).decode("ascii")}"><figcaption>{key}.png</figcaption></figure>'
        for key, png in images.items()
    )
    paths = "".join(f"<li>{html.escape(r.name)}: {html.escape(str(r.path))}</li>" for r in runs)
    notes = "".join(
        f"<p>{html.escape(r.name)}: {r.replaced} earlier record(s) replaced by later records "
        "of the same steps (a log appended after a resume, or lines copied twice).</p>"
        for r in runs
        if r.replaced
    )
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    style = (
        "body{font-family:sans-serif;max-width:60em;margin:2em auto}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.2em .6em}"
        "img{max-width:100%}pre{white-space:pre-wrap;margin:0}"
    )
    return (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>gradstep report</title>"
        f"<style>{style}</style></head><body><h1>gradstep report</h1>"
        f"<p>Generated {stamp}. Grad norms are global and pre-clip unless marked post-clip; "
        f"losses are token-weighted means.</p><ul>{paths}</ul>"
        f"<table><tr>{head}</tr>{body}</table>{notes}{figures}"
        f"{samples_html([(r.name, r.path) for r in runs])}</body></html>\n"
    )


def write_report(run_dirs: Sequence[str | Path], out: str | Path | None = None) -> Path:
    """Write ``<plot>.png`` files and ``report.html`` (PNGs inlined); return the HTML path.

    ``out`` defaults to ``<first run>/report``.
    """
    if isinstance(run_dirs, (str, Path)) or not run_dirs:
        raise ReportError("run_dirs must be a non-empty list of run folders")
    paths = [Path(p) for p in run_dirs]
    runs = [load_run(p, name) for p, name in zip(paths, _names(paths), strict=True)]
    out_dir = Path(out) if out is not None else paths[0] / "report"
    figures = build_figures(runs)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        images = {}
        for key, fig in figures.items():
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=100)
            images[key] = buf.getvalue()
            (out_dir / f"{key}.png").write_bytes(images[key])
        page = out_dir / "report.html"
        page.write_text(_html(runs, images), encoding="utf-8")
    except OSError as exc:
        raise ReportError(
            f"cannot write the report to {str(out_dir)!r}: {exc.strerror or exc}"
        ) from None
    return page
