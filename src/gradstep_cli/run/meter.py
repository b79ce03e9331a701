"""What each step of ``gradstep train`` processed and what the process holds, measured every
step (:class:`Meter`), for ``metrics.jsonl``, the progress line and ``summary.json``.

* Tokens: ``items`` (StepStats) are the trained ones, the targets; ``processed_tokens`` are
  every position the model computed, prompt and padding included (rows x padded width of
  every micro-batch, summed over the data ranks). An SFT run trains on a fraction of what
  it processes: both rates are shown, labelled ``trained`` and ``processed``.
* Memory: ``rss_mb`` is rank 0's resident set after the step (CPU; on CUDA the allocator's
  bytes in use), beside ``peak_memory_mb``, the process's peak so far. With
  ``--memory-budget`` the run says once, with the step, when its peak passes
  :data:`BUDGET_WARNING` of the budget. Reading them costs two reads of
  ``/proc/self/status`` a step.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from gradstep import StepStats, parallel
from gradstep.memory import current_bytes, format_bytes, parse_size, peak_bytes
from gradstep_cli.models.compile import compile_seconds

__all__ = ["BUDGET_WARNING", "Meter"]

COMPILE_STEPS = 100
"""Later steps whose median --compile's time is measured against."""

BUDGET_WARNING = 0.9
"""Share of --memory-budget whose crossing the run reports (once)."""
TRAIN_LOSS_WINDOW = 10  # final train loss = token-weighted mean over the last N steps
MIB = 2**20


@dataclass
class Meter:
    """Per-step measures of one run (every rank makes the same collective calls)."""

    run: Any
    budget: int | None = None
    warned_at: int | None = None
    """The step the budget warning was said at (None: never)."""
    first_rss: int | None = None
    last_rss: int | None = None
    step_seconds: list[float] = field(default_factory=list)
    """This invocation's first step times (--compile: the first one's excess over the
    median of the others is the compile)."""

    def __post_init__(self) -> None:
        if self.run.cfg.memory_budget is not None:
            self.budget = parse_size(self.run.cfg.memory_budget)

    def processed(self, window: list[dict[str, torch.Tensor]]) -> int:
        """Positions the model computed for ``window`` over every data rank (tensor-parallel
        peers compute the same positions: counted once)."""
        mine = sum(int(mb["input_ids"].numel()) for mb in window)
        run = self.run
        if run.world_size == 1:
            return mine
        total = torch.tensor([float(mine)], dtype=torch.float64, device=parallel.comm_device())
        copies = run.world_size // run.data_ranks
        return round(float(parallel.all_reduce_sum(total).item()) / copies)

    def step(self, n: int, window: list, stats: StepStats, elapsed: float) -> dict[str, Any]:
        """After step ``n``: the progress totals, and the record's fields beyond StepStats."""
        progress = self.run.progress
        positions = self.processed(window)
        progress.micro_batches += len(window)
        progress.tokens += stats.items
        progress.positions += positions
        progress.step_time += elapsed
        if len(self.step_seconds) <= COMPILE_STEPS:  # enough for the median, bounded
            self.step_seconds.append(elapsed)
        progress.recent = [*progress.recent[-(TRAIN_LOSS_WINDOW - 1) :], (stats.loss, stats.items)]
        rss = current_bytes(self.run.device)
        self.first_rss = rss if self.first_rss is None else self.first_rss
        self.last_rss = rss
        self._budget(n)
        return {
            "window": n,
            "processed_tokens": positions,
            "processed_tokens_per_s": positions / elapsed,
            "rss_mb": rss / MIB,
        }

    def _budget(self, n: int) -> None:
        """Say once when the peak passes BUDGET_WARNING of --memory-budget."""
        if self.budget is None or self.warned_at is not None:
            return
        peak = peak_bytes(self.run.device)
        if peak <= BUDGET_WARNING * self.budget:
            return
        self.warned_at = n
        over = "over" if peak > self.budget else f"{peak / self.budget:.0%} of"
        if self.run.is_main:
            tqdm.write(
                f"warning: step {n}: peak memory {format_bytes(peak)} is {over} "
                f"--memory-budget {format_bytes(self.budget)} (rank 0's process; rss_mb and "
                "peak_memory_mb in metrics.jsonl say how it grew)",
                file=sys.stderr,
            )

    def rates(self) -> dict[str, float]:
        """Trained and processed tokens per second of stepping, so far."""
        progress = self.run.progress
        seconds = max(progress.step_time, 1e-9)
        return {"trained": progress.tokens / seconds, "processed": progress.positions / seconds}

    def summary(self) -> dict[str, Any]:
        """summary.json's throughput and memory figures."""
        progress, device = self.run.progress, self.run.device
        rss = {
            "rss_first_step_mb": None if self.first_rss is None else self.first_rss / MIB,
            "rss_last_step_mb": None if self.last_rss is None else self.last_rss / MIB,
        }
        return {
            "processed_tokens": progress.positions,
            "processed_tokens_per_s": self.rates()["processed"],
            **rss,
            "peak_memory_mb": peak_bytes(device) / MIB,
            "memory_budget_mb": None if self.budget is None else self.budget / MIB,
            "memory_budget_warning_step": self.warned_at,
            "compile_seconds": compile_seconds(self.step_seconds) if self.run.cfg.compile else None,
        }


def postfix(stats: StepStats, rates: dict[str, float], clipped: int, steps: int) -> dict:
    """The progress bar's (and plain line's) fields."""
    return {
        "loss": f"{stats.loss:.3f}",
        "gnorm": f"{stats.grad_norm:.2f}",
        "clip%": f"{100 * clipped / max(steps, 1):.0f}",
        "trained tok/s": f"{rates['trained']:,.0f}",
        "processed tok/s": f"{rates['processed']:,.0f}",
    }
