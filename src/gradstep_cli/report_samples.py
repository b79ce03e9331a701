"""The samples section of ``gradstep report``: a run's ``samples.jsonl`` (written by
``--sample-prompts``, :mod:`gradstep_cli.run.samples`) as one table per run, by step and
prompt, so what the model writes can be read beside its curves."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

__all__ = ["load_samples", "samples_html"]

SHOWN = 600  # characters of a prompt or completion shown in a cell


def load_samples(run_dir: Path) -> list[dict[str, Any]]:
    """The complete sample records of ``run_dir/samples.jsonl`` (none: an empty list); a
    half-written last line, or a line that is no sample, is left out. A step sampled twice
    (a resumed run) keeps its later samples."""
    try:
        text = (run_dir / "samples.jsonl").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    rows: dict[tuple[Any, Any], dict[str, Any]] = {}
    for line in text.splitlines(keepends=True):
        try:
            row = json.loads(line) if line.endswith("\n") else None
        except ValueError:
            row = None
        if isinstance(row, dict) and "step" in row and "completion" in row:
            rows[(row["step"], row.get("index"))] = row
    return sorted(rows.values(), key=lambda r: (r["step"], r.get("index") or 0))


def _prompt(source: Any) -> str:
    """A prompt as given: its text, or the last message of a conversation."""
    if isinstance(source, list) and source and isinstance(source[-1], dict):
        last = source[-1]
        return f"[{len(source)} messages] {last.get('role', '?')}: {last.get('content', '')}"
    return str(source)


def _cell(text: str) -> str:
    cut = text if len(text) <= SHOWN else text[:SHOWN] + "..."
    return f"<td><pre>{html.escape(cut)}</pre></td>"


def samples_html(runs: list[tuple[str, Path]]) -> str:
    """One table per run that has samples (empty when none has)."""
    parts = []
    for name, path in runs:
        rows = load_samples(path)
        if not rows:
            continue
        body = "".join(
            f"<tr><td>{html.escape(str(r['step']))}</td>{_cell(_prompt(r.get('prompt')))}"
            f"{_cell(str(r['completion']))}<td>{html.escape(str(r.get('tokens', '')))} "
            f"{html.escape(str(r.get('stop', '')))}</td></tr>"
            for r in rows
        )
        parts.append(
            f"<h2>Samples: {html.escape(name)}</h2><table><tr><th>step</th><th>prompt</th>"
            f"<th>completion (greedy)</th><th>tokens, stop</th></tr>{body}</table>"
        )
    return "".join(parts)
