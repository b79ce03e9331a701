"""The training loop of ``gradstep train``: one window -> one ``stepper.step`` -> one metrics
record, then the summary.

The loop is deliberately one linear ``for``: every optimizer-step concern (accumulation,
normalisation by the true token count, precision, clipping, skipping) lives in
:class:`gradstep.Stepper`; the loop only feeds it windows and logs what it returns.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from gradstep import Stepper, StepStats
from gradstep.metrics import FINISHED_FILE, MetricsLogger, jsonable
from gradstep_cli.data.batching import windows_of
from gradstep_cli.data.sources import Batch
from gradstep_cli.run import resume, summary
from gradstep_cli.run.build import Run, say
from gradstep_cli.run.components import loss_for
from gradstep_cli.run.evaluation import evaluate
from gradstep_cli.run.schedule import ramp_windows

__all__ = ["TRAIN_LOSS_WINDOW", "run_loop"]

TRAIN_LOSS_WINDOW = 10  # final train loss = token-weighted mean over the last N steps


def run_loop(run: Run, started: float, callbacks: Sequence[Callable]) -> dict[str, Any]:
    """Say what the setup decided, write the run's config, train, return the summary."""
    for line in run.notes:
        say(run, line)
    if run.finished(run.start):
        say(
            run,
            f"the run already finished: the checkpoint is at step {run.start} and "
            f"max_steps is {run.cfg.max_steps}; nothing to train and nothing was changed "
            "(pass a larger --max-steps to train on)",
        )
        return summary.existing(run.out)
    if run.is_main:
        _write_json(run.out / "config.json", run.cfg.to_dict())
        if run.planned is not None:
            _write_json(run.out / "plan.json", jsonable(run.planned.to_json()))
    return _logged(run, started, callbacks)


def _logged(run: Run, started: float, callbacks: Sequence[Callable]) -> dict[str, Any]:
    """The loop with its logger, then the summary."""
    if run.start and run.is_main:
        resume.cut_metrics(run.out / "metrics.jsonl", run.start)
    # Other ranks run the same loop (collectives) but log their records nowhere.
    main = run.is_main
    logger = MetricsLogger(
        run.out if main else None,
        tensorboard=run.cfg.tensorboard and main,
        callbacks=callbacks if main else (),
        device=run.device,
        append=run.start > 0,
        start_index=run.start,
    )
    if main:
        (run.out / FINISHED_FILE).unlink(missing_ok=True)  # a resumed run is live again
    with logger:
        losses = _loop(run, logger)
        result = summary.build(run, losses, started)
        if main:
            _write_json(run.out / "summary.json", jsonable(result), allow_nan=False)
            logger.finish()
    summary.show(result)
    return result


def _loop(run: Run, logger: MetricsLogger) -> dict[str, Any]:
    """The training loop: one window -> one ``stepper.step`` -> one metrics record."""
    cfg, progress = run.cfg, run.progress
    loss_fn, count = loss_for(cfg, run.device)
    if run.start == 0:
        progress.initial_val_loss = evaluate(run.model, run.val, run.device, loss_fn)
        tqdm.write(f"step 0: val_loss {progress.initial_val_loss:.4f}", file=sys.stderr)
    val_loss = progress.initial_val_loss
    total = None if run.ramp is not None else cfg.max_steps  # a ramp's step count is open
    bar = tqdm(total=total, initial=run.start, unit="step", dynamic_ncols=True, disable=None)
    n = saved = run.start
    for n, window in enumerate(_windows(run), start=run.start + 1):
        k = len(window)
        run.schedule.apply(run.stepper.optimizer, k)
        t0 = time.perf_counter()
        stats = run.stepper.step(window, loss_fn, count=count)
        elapsed = max(time.perf_counter() - t0, 1e-9)
        run.schedule.advance(k, taken=not stats.skipped)
        progress.micro_batches += k
        if run.ramp is not None and run.gns is not None:  # gns: sizes the next window
            run.ramp.observe(n - 1, run.gns.b_simple, stats.items, run.gns.measured_steps)
        progress.tokens += stats.items
        progress.step_time += elapsed
        progress.recent = [*progress.recent[-(TRAIN_LOSS_WINDOW - 1) :], (stats.loss, stats.items)]
        last = run.finished(n)
        measured = None
        if last or (cfg.eval_every and n % cfg.eval_every == 0):
            val_loss = measured = evaluate(run.model, run.val, run.device, loss_fn)
            tqdm.write(f"step {n}: val_loss {val_loss:.4f}", file=sys.stderr)
        logger.log_step(stats, elapsed, val_loss=measured, **_extra(run))
        if cfg.save_every and n % cfg.save_every == 0 and run.checkpointer is not None:
            saved = _save(run, n)
        bar.update(1)
        if n % cfg.log_every == 0 or last:
            postfix = _postfix(stats, progress.tokens / progress.step_time, run.stepper, n)
            _show(bar, f"step {n}/{total or '?'}", postfix)
    bar.close()
    if run.checkpointer is not None and (saved != n or n == run.start):
        _save(run, n)  # the final checkpoint (also when a resume found nothing left to do)
    return summary.final_losses(progress, n, val_loss)


def _windows(run: Run) -> Iterator[list[Batch]]:
    """The run's remaining windows: fixed ones, or a ramp's growing ones."""
    if run.ramp is None:
        todo = max(0, run.cfg.max_steps - run.start)
        return itertools.islice(windows_of(run.train_iter, run.layout), todo)
    left = lambda: run.budget - run.progress.micro_batches  # noqa: E731
    return ramp_windows(run.train_iter, run.ramp, run.start, left)


def _extra(run: Run) -> dict[str, Any]:
    """Record fields beyond StepStats: the plan's prediction, the noise scale."""
    extra: dict[str, Any] = {}
    if run.planned_peak_mb is not None:
        extra["planned_peak_mb"] = run.planned_peak_mb
    if run.gns is not None:
        extra["gns_b_simple"] = run.gns.b_simple
    return extra


def _save(run: Run, step: int) -> int:
    if run.checkpointer is not None:
        run.checkpointer.save(step, **resume.stateful(run))
    return step


def _postfix(stats: StepStats, tokens_per_s: float, stepper: Stepper, steps: int) -> dict:
    return {
        "loss": f"{stats.loss:.3f}",
        "gnorm": f"{stats.grad_norm:.2f}",
        "clip%": f"{100 * stepper.clipped_steps / steps:.0f}",
        "tok/s": f"{tokens_per_s:,.0f}",
    }


def _show(bar: tqdm, where: str, postfix: dict[str, str]) -> None:
    bar.set_postfix(postfix)
    if bar.disable:  # no TTY (CI, pipes): a plain line instead of a bar
        line = " ".join(f"{k} {v}" for k, v in postfix.items())
        print(f"{where} {line}", file=sys.stderr)


def _write_json(path: Path, value: Any, allow_nan: bool = True) -> None:
    path.write_text(json.dumps(value, indent=2, allow_nan=allow_nan) + "\n")
