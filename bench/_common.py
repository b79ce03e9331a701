"""Shared pieces of the gradstep benchmarks.

Benchmarks here never assert on time: they print ratios against a baseline measured in the
same process and run, so machine speed and background load cancel out as far as possible.
The helpers below are the parts every such script needs:

* seeded causal-LM micro-batches of variable length with ``-100`` label padding (the case
  where token-weighted normalisation matters), built with the trainer's own ``collate``;
* interleaved timing of two step functions and robust statistics of their ratio;
* each memory case in a fresh subprocess, so that high-water marks of earlier cases cannot
  leak into later ones (the peak itself: ``gradstep.metrics.peak_memory``);
* ``BaseConfig``: a script's settings as a frozen dataclass, every field a ``--flag``;
* re-exported from the test suite's ``tests.support`` (one copy for tests and benchmarks):
  the LM loss ``lm_loss``, the full-batch reference step, ``concat``/``collate``, ``rel_err``,
  ``BF16Linear`` and the multi-process harness ``run_ranks``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch

from gradstep_cli.data.sources import IGNORE_INDEX
from gradstep_cli.data.sources import collate as collate_bytes

# The scripts run as `python bench/x.py` (sys.path[0] = bench/): the repo root makes the test
# suite's helpers (tests.support) importable, so the benchmarks use them instead of copies.
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from tests.support.asserts import flat, rel_err  # noqa: E402
from tests.support.batches import Batch, collate, concat  # noqa: E402
from tests.support.models import BF16Linear  # noqa: E402
from tests.support.multiproc import run_ranks  # noqa: E402
from tests.support.reference import (  # noqa: E402
    lm_loss,
    mean_token_loss,
    reference_grads,
    reference_step,
)

__all__ = [
    "BF16Linear",
    "BaseConfig",
    "Batch",
    "PairedTimes",
    "RatioStats",
    "as_dict",
    "collate",
    "concat",
    "count_items",
    "flat",
    "interleaved_times",
    "lm_loss",
    "lm_window",
    "machine_info",
    "mean_token_loss",
    "random_rows",
    "ratio_stats",
    "reference_grads",
    "reference_step",
    "rel_err",
    "run_in_subprocess",
    "run_ranks",
]


# ----------------------------------------------------------------------------- data


def random_rows(
    n_rows: int, seq_len: int, seed: int, vocab_size: int = 256, min_frac: float = 0.25
) -> list[np.ndarray]:
    """``n_rows`` random token sequences of ``seq_len + 1`` tokens at most, lengths varying.

    Lengths are uniform in ``[min_frac * seq_len, seq_len] + 1`` so micro-batches hold
    different numbers of real target tokens. ``collate`` expects byte chunks, hence uint8
    (the demo model is byte-level: ``vocab_size`` must be <= 256).
    """
    if vocab_size > 256:
        raise ValueError(f"vocab_size must be <= 256 for byte chunks, got {vocab_size}")
    rng = np.random.default_rng(seed)
    lo = max(2, int(min_frac * seq_len))
    lengths = rng.integers(lo, seq_len + 1, size=n_rows) + 1
    return [rng.integers(0, vocab_size, size=int(n), dtype=np.uint8) for n in lengths]


def lm_window(rows: Sequence[np.ndarray], micro_batch_size: int) -> list[Batch]:
    """Split ``rows`` into micro-batches of ``micro_batch_size`` (each padded to its own max)."""
    if micro_batch_size < 1 or len(rows) % micro_batch_size:
        raise ValueError(
            f"micro_batch_size must be >= 1 and divide the {len(rows)} rows, got {micro_batch_size}"
        )
    size = micro_batch_size
    return [collate_bytes(rows[i : i + size]) for i in range(0, len(rows), size)]


def count_items(window: Sequence[Batch]) -> int:
    """Target tokens of a whole window (what a hand-written loop can count up front)."""
    return int(sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in window))


# ----------------------------------------------------------------------------- timing


@dataclass
class RatioStats:
    """Statistics of per-pair time ratios ``a / b`` of two interleaved step functions."""

    pairs: int
    median_a_ms: float
    median_b_ms: float
    median_ratio: float
    """Median over pairs of t_a / t_b (each pair ran back to back: load mostly cancels)."""
    ratio_of_medians: float
    ratio_q1: float
    ratio_q3: float
    ci95_low: float
    """Bootstrap 95% interval of ``median_ratio`` (resampling the pairs)."""
    ci95_high: float
    median_diff_ms: float
    """Median over pairs of t_a - t_b: the absolute per-step overhead."""


@dataclass
class PairedTimes:
    """Per-step seconds of two interleaved step functions, by wall clock and by CPU time."""

    wall_a: list[float] = field(default_factory=list)
    wall_b: list[float] = field(default_factory=list)
    cpu_a: list[float] = field(default_factory=list)
    """Process CPU time: insensitive to being descheduled by other processes on a shared
    machine (cache and memory-bandwidth contention still show)."""
    cpu_b: list[float] = field(default_factory=list)


def interleaved_times(
    run_a: Callable[[int], object],
    run_b: Callable[[int], object],
    warmup: int,
    pairs: int,
) -> PairedTimes:
    """Time ``run_a(i)`` and ``run_b(i)`` back to back for ``i`` in ``range(warmup + pairs)``.

    The order alternates (a b, b a, ...) so neither side systematically runs on a cache
    warmed, or a CPU slowed, by the other. Warm-up steps run both sides untimed, so both
    still see exactly the same sequence of step indices.
    """
    out = PairedTimes()
    sides = ((run_a, out.wall_a, out.cpu_a), (run_b, out.wall_b, out.cpu_b))
    for i in range(warmup + pairs):
        for fn, wall, cpu in sides if i % 2 == 0 else sides[::-1]:
            c0, t0 = time.process_time(), time.perf_counter()
            fn(i)
            t1, c1 = time.perf_counter(), time.process_time()
            if i >= warmup:
                wall.append(t1 - t0)
                cpu.append(c1 - c0)
    return out


def ratio_stats(
    times_a: Sequence[float], times_b: Sequence[float], seed: int = 0, n_boot: int = 4000
) -> RatioStats:
    """Median ratio, ratio of medians, IQR and a bootstrap 95% interval of the median ratio."""
    a = np.asarray(times_a, dtype=np.float64)
    b = np.asarray(times_b, dtype=np.float64)
    if a.shape != b.shape or a.size < 2:
        raise ValueError(f"need >= 2 paired timings of equal count, got {a.size} and {b.size}")
    ratios = a / b
    rng = np.random.default_rng(seed)
    boot = np.median(ratios[rng.integers(0, ratios.size, size=(n_boot, ratios.size))], axis=1)
    q1, q3 = np.percentile(ratios, [25, 75])
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return RatioStats(
        pairs=int(a.size),
        median_a_ms=float(np.median(a) * 1e3),
        median_b_ms=float(np.median(b) * 1e3),
        median_ratio=float(np.median(ratios)),
        ratio_of_medians=float(np.median(a) / np.median(b)),
        ratio_q1=float(q1),
        ratio_q3=float(q3),
        ci95_low=float(lo),
        ci95_high=float(hi),
        median_diff_ms=float(np.median(a - b) * 1e3),
    )


# ----------------------------------------------------------------------------- memory


def run_in_subprocess(script: str, args: Sequence[str]) -> dict:
    """Run ``python script *args`` in a fresh interpreter; it must print one JSON object last."""
    proc = subprocess.run(
        [sys.executable, script, *args], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{os.path.basename(script)} {' '.join(args)} failed "
            f"(exit {proc.returncode}):\n{proc.stderr[-2000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- config


C = TypeVar("C", bound="BaseConfig")


@dataclass(frozen=True)
class BaseConfig:
    """A benchmark's settings: subclass it as a frozen dataclass of plain-typed fields.

    Every field becomes a ``--flag`` (``micro_batch_size`` -> ``--micro-batch-size``) with
    the field's default; a tuple field takes several values. ``POSITIVE`` names the fields
    that must be >= 1; ``HELP`` gives flags a help text; ``check`` adds a script's own rules.
    A bad value is an argparse error that names the flag.
    """

    POSITIVE: ClassVar[tuple[str, ...]] = ()
    HELP: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        for name in self.POSITIVE:
            if getattr(self, name) < 1:
                raise ValueError(f"{flag(name)} must be >= 1, got {getattr(self, name)}")
        self.check()

    def check(self) -> None:
        """The script's own rules beyond POSITIVE: raise ValueError naming the flag."""

    def flags(self) -> list[str]:
        """This config as command-line flags (for a subprocess of the same script)."""
        out = []
        for name, value in asdict(self).items():
            values = value if isinstance(value, tuple) else (value,)
            out += [flag(name), *map(str, values)]
        return out

    @classmethod
    def parser(cls, description: str | None) -> argparse.ArgumentParser:
        ap = argparse.ArgumentParser(
            description=description, formatter_class=argparse.RawTextHelpFormatter
        )
        for f in dataclasses.fields(cls):
            default, help_ = f.default, cls.HELP.get(f.name)
            if isinstance(default, tuple):
                kind = type(default[0])
                ap.add_argument(flag(f.name), type=kind, nargs="+", default=default, help=help_)
            else:
                ap.add_argument(flag(f.name), type=type(default), default=default, help=help_)
        return ap

    @classmethod
    def parse(
        cls: type[C], argv: Sequence[str] | None, ap: argparse.ArgumentParser
    ) -> tuple[C, argparse.Namespace]:
        """Parse ``argv`` with ``ap`` (from :meth:`parser`, plus the script's own flags)."""
        ns = ap.parse_args(argv)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            value = getattr(ns, f.name)
            values[f.name] = tuple(value) if isinstance(f.default, tuple) else value
        try:
            return cls(**values), ns
        except ValueError as exc:
            ap.error(str(exc))


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# ----------------------------------------------------------------------------- context


def machine_info() -> dict:
    """What a reader needs to judge a timing: versions, threads, CPU and current load."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "cpu": _cpu_name(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def as_dict(obj: object) -> dict:
    return asdict(obj)  # type: ignore[call-overload]


# ----------------------------------------------------------------------------- output

OUT = Path(__file__).resolve().parent / "out"


def markdown_table(rows: Sequence[dict], keys: Sequence[str] | None = None) -> str:
    """``rows`` as a markdown table (floats to 4 significant digits, None as "-")."""
    keys = list(keys or rows[0])

    def cell(v: object) -> str:
        return f"{v:.4g}" if isinstance(v, float) else "-" if v is None else str(v)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    return "\n".join(lines + ["| " + " | ".join(cell(r[k]) for k in keys) + " |" for r in rows])


def write_outputs(name: str, text: str, result: dict) -> None:
    """Print ``text`` and write it to ``bench/out/NAME.md``, ``result`` to ``NAME.json``."""
    print(text)
    OUT.mkdir(exist_ok=True)
    (OUT / f"{name}.md").write_text(text)
    (OUT / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
