"""What the training loop does around its evaluations: score the validation set, keep the
best checkpoint (``--keep-best``), stop early (``--early-stopping-patience``) and sample the
``--sample-prompts`` (:mod:`.samples`).

The best evaluation is the one whose ``--keep-best`` metric is lowest (``val_loss``) or
highest (``val_accuracy``), strictly better than every earlier one; the step-0 evaluation of
the initial weights does not count (no checkpoint holds them). An evaluation that improves
on the best saves a checkpoint at its step (if the run would not save one anyway), names it
in ``OUT/checkpoints/best.json`` and protects it from ``--keep-checkpoints`` pruning. The
best so far and the evaluations since it are part of the checkpoint (its ``progress``), so a
resumed run still knows which checkpoint is best and how patient it has been.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from gradstep_cli.config.evaluation import EVAL_METRICS
from gradstep_cli.run import samples
from gradstep_cli.run.evaluation import Evaluation, Logits, evaluate_metrics

__all__ = ["BEST_FILE", "Validation", "best_checkpoint", "stopped_early"]

BEST_FILE = "best.json"
"""In ``OUT/checkpoints``: the best checkpoint's step, metric and value."""


def better(metric: str, value: float, best: float) -> bool:
    """Whether ``value`` improves on ``best`` (nan: no best yet) for ``metric``."""
    if not math.isfinite(value):
        return False
    if math.isnan(best):
        return True
    return value < best if EVAL_METRICS[metric] == "min" else value > best


def stopped_early(run: Any) -> str | None:
    """Why a resumed run has nothing to train: it stopped early (None: it did not)."""
    cfg, progress = run.cfg, run.progress
    if not (cfg.early_stopping_patience and progress.stale_evals >= cfg.early_stopping_patience):
        return None
    return (
        f"the run stopped early: {progress.stale_evals} evaluations without improving "
        f"{cfg.keep_best} on its best ({progress.best_value:.4f} at step {progress.best_step}); "
        "nothing to train and nothing was changed (pass a larger --early-stopping-patience to "
        "train on)"
    )


def best_checkpoint(where: Path) -> dict[str, Any] | None:
    """``best.json`` of a checkpoints folder (None: none, or unreadable)."""
    try:
        best = json.loads((where / BEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    return best if isinstance(best, dict) and isinstance(best.get("step"), int) else None


class Validation:
    """The run's evaluations, best checkpoint, early stop and samples, step by step."""

    def __init__(self, run: Any) -> None:
        self.run, cfg = run, run.cfg
        self.logits = Logits(run.device, hf=cfg.is_hf, chunk_tokens=cfg.loss_chunk_tokens)
        self.last: Evaluation | None = None
        self.stop = False
        self.prompts = (
            samples.read_prompts(cfg.sample_prompts, run.tokenizer) if cfg.sample_prompts else []
        )
        if run.is_main and run.start:
            samples.cut_samples(run.out / samples.SAMPLES_FILE, run.start)
        if cfg.keep_best is not None:
            self._protect()

    def measure(self, step: int) -> Evaluation:
        """Score the validation batches, say so, and remember it."""
        run = self.run
        self.last = evaluate_metrics(run.model, run.val, run.device, self.logits)
        tqdm.write(f"step {step}: {self.last.describe()}", file=sys.stderr)
        return self.last

    def start(self) -> None:
        """Before the first step of a new run: the initial weights' evaluation and samples."""
        if self.run.start == 0:
            self.run.progress.initial_val_loss = self.measure(0).loss
            self.sample(0, last=True)

    def due(self, step: int, last: bool) -> Evaluation | None:
        """The evaluation of ``step`` when one is due (every --eval-every, and the last)."""
        every = self.run.cfg.eval_every
        return self.measure(step) if last or (every and step % every == 0) else None

    def observe(self, step: int, evaluation: Evaluation | None) -> bool:
        """Track the --keep-best metric; True when ``step`` is the new best (to be saved)."""
        cfg, progress = self.run.cfg, self.run.progress
        if evaluation is None or cfg.keep_best is None:
            return False
        value = evaluation.metrics()[cfg.keep_best]
        if better(cfg.keep_best, value, progress.best_value):
            progress.best_step, progress.best_value, progress.stale_evals = step, value, 0
            if self.run.checkpointer is not None:  # its save prunes the older best
                self.run.checkpointer.protected = {step}
            return True
        progress.stale_evals += 1
        patience = cfg.early_stopping_patience
        if patience and progress.stale_evals >= patience:
            self.stop = True
            tqdm.write(
                f"step {step}: {progress.stale_evals} evaluations without improving "
                f"{cfg.keep_best} (best {progress.best_value:.4f} at step {progress.best_step}):"
                " stopping early",
                file=sys.stderr,
            )
        return False

    def saved(self, step: int) -> None:
        """After the checkpoint of ``step``: best.json names it when it is the best (only
        once it is saved: best.json never names a checkpoint that is not there)."""
        if self.run.cfg.keep_best is not None and self.run.progress.best_step == step:
            self._protect()

    def _protect(self) -> None:
        """The best checkpoint outlives pruning, and best.json names it."""
        run, progress = self.run, self.run.progress
        if run.checkpointer is None:
            return
        run.checkpointer.protected = set() if progress.best_step is None else {progress.best_step}
        if run.is_main:
            path = run.checkpointer.directory / BEST_FILE
            if progress.best_step is None:
                path.unlink(missing_ok=True)
                return
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.best()) + "\n")

    def best(self) -> dict[str, Any]:
        """The best evaluation so far (summary.json and best.json)."""
        progress = self.run.progress
        step = progress.best_step
        return {
            "metric": self.run.cfg.keep_best,
            "value": None if step is None else progress.best_value,
            "step": step,
            "checkpoint": None if step is None else f"step-{step:06d}",
        }

    def sample(self, step: int, last: bool) -> None:
        """Sample the prompts at ``step`` when due (every --sample-every, and the last)."""
        every = self.run.cfg.sample_every
        if self.prompts and (last or (every and step % every == 0)):
            samples.sample(self.run, step, self.prompts)

    def summary(self) -> dict[str, Any]:
        """The summary's evaluation fields."""
        last, cfg = self.last, self.run.cfg
        out: dict[str, Any] = {}
        if last is not None:
            out.update(
                final_val_accuracy=last.accuracy, final_val_entropy=last.entropy,
                val_items=last.items, val_records=last.records,
            )  # fmt: skip
        if cfg.keep_best is not None:
            out["best"] = self.best()
        out["stopped_early"] = self.stop
        return out
