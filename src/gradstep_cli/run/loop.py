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

from gradstep.metrics import FINISHED_FILE, MetricsLogger, jsonable
from gradstep_cli.data.batching import windows_of
from gradstep_cli.data.sources import Batch
from gradstep_cli.run import resume, summary
from gradstep_cli.run.build import Run, say
from gradstep_cli.run.components import describe_optimizer, loss_for, optimizer_line
from gradstep_cli.run.meter import TRAIN_LOSS_WINDOW, Meter, postfix
from gradstep_cli.run.schedule import describe_schedule, ramp_windows, schedule_line
from gradstep_cli.run.tracking import logger_options, remember_trackers
from gradstep_cli.run.validation import Validation, stopped_early

__all__ = ["TRAIN_LOSS_WINDOW", "run_loop"]


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
    if (why := stopped_early(run)) is not None:
        say(run, why)
        return summary.existing(run.out)
    if run.is_main:
        _write_json(run.out / "config.json", run.cfg.to_dict())
        if run.planned is not None:
            _write_json(run.out / "plan.json", jsonable(run.planned.to_json()))
    say(run, optimizer_line(describe_optimizer(run.stepper.optimizer)))
    say(run, schedule_line(run.schedule, _stop(run)))
    return _logged(run, started, callbacks)


def _stop(run: Run) -> int | None:
    """The step this invocation stops after (--stop-after; None: where the run ends)."""
    return None if run.cfg.stop_after is None else run.start + run.cfg.stop_after


def _logged(run: Run, started: float, callbacks: Sequence[Callable]) -> dict[str, Any]:
    """The loop with its logger, then the summary."""
    if run.start and run.is_main:
        resume.cut_metrics(run.out / "metrics.jsonl", run.start)
    # Other ranks run the same loop (collectives) but log their records nowhere.
    main = run.is_main
    logger = MetricsLogger(
        run.out if main else None,
        **logger_options(run),
        callbacks=callbacks if main else (),
        device=run.device,
        append=run.start > 0,
        start_index=run.start,
    )
    if main:
        (run.out / FINISHED_FILE).unlink(missing_ok=True)  # a resumed run is live again
        remember_trackers(run, logger)
    meter = Meter(run)
    with logger:
        losses = _loop(run, logger, meter, started)
        result = summary.build(run, losses, started)
        result.update(_recipe(run, meter, losses["steps"]))
        if main:
            _write_json(run.out / "summary.json", jsonable(result), allow_nan=False)
            logger.finish()
    summary.show(result)
    if result.get("stopped_after") is not None and run.is_main:
        print(_stopped(run, result["steps"]))
    return result


def _stopped(run: Run, step: int) -> str:
    """What a --stop-after stop left, and how to go on."""
    line = (
        f"stopped after {run.cfg.stop_after} steps (--stop-after), at step {step} of the "
        f"schedule's {run.cfg.max_steps}"
    )
    if run.checkpointer is None:
        return f"{line}; no checkpoint was saved (--save-every 0), so it cannot be resumed"
    return f"{line}; gradstep train --out {run.out} --resume continues the same schedule"


def _recipe(run: Run, meter: Meter, steps: int) -> dict[str, Any]:
    """summary.json's optimizer, schedule, length, throughput and memory."""
    stopped = steps < run.cfg.max_steps and _stop(run) == steps
    return {
        "optimizer": describe_optimizer(run.stepper.optimizer),
        "lr_schedule": describe_schedule(run.schedule),
        "max_steps": run.cfg.max_steps,
        "epochs": run.cfg.epochs,
        "stopped_after": run.cfg.stop_after if stopped else None,
        **meter.summary(),
    }


def _loop(run: Run, logger: MetricsLogger, meter: Meter, started: float) -> dict[str, Any]:
    """The training loop: one window -> one ``stepper.step`` -> one metrics record."""
    cfg, progress, stop = run.cfg, run.progress, _stop(run)
    loss_fn, count = loss_for(cfg, run.device)
    validation = Validation(run)
    validation.start()  # a new run: the initial weights' evaluation (and samples)
    val_loss = progress.initial_val_loss
    total = None if run.ramp is not None else cfg.max_steps  # a ramp's step count is open
    bar = tqdm(total=total, initial=run.start, unit="step", dynamic_ncols=True, disable=None)
    n = saved = run.start
    first = None  # seconds from the start of train() to the end of its first step
    for n, window in enumerate(_windows(run), start=run.start + 1):
        k = len(window)
        run.schedule.apply(run.stepper.optimizer, k)
        t0 = time.perf_counter()
        stats = run.stepper.step(window, loss_fn, count=count)
        first = first or _first_step(run, started)
        elapsed = max(time.perf_counter() - t0, 1e-9)
        run.schedule.advance(k, taken=not stats.skipped)
        measures = meter.step(n, window, stats, elapsed)  # the totals, tokens, memory
        if run.ramp is not None and run.gns is not None:  # gns: sizes the next window
            run.ramp.observe(n - 1, run.gns.b_simple, stats.items, run.gns.measured_steps)
        last = run.finished(n) or n == stop
        measured = validation.due(n, last)
        val_loss = val_loss if measured is None else measured.loss
        best = validation.observe(n, measured)  # --keep-best: a new best is saved now
        evaluated = {} if measured is None else measured.metrics()
        logger.log_step(stats, elapsed, **evaluated, **measures, **_extra(run))
        if run.checkpointer is not None and (best or cfg.save_every and n % cfg.save_every == 0):
            saved = _save(run, n)
            validation.saved(n)
        last = last or validation.stop  # --early-stopping-patience
        validation.sample(n, last)
        bar.update(1)
        if n % cfg.log_every == 0 or last:
            shown = postfix(stats, meter.rates(), run.stepper.clipped_steps, n)
            _show(bar, f"step {n}/{total or '?'}", shown)
        if validation.stop or n == stop:
            break
    bar.close()
    if run.checkpointer is not None and (saved != n or n == run.start):
        _save(run, n)  # the final checkpoint (also when a resume found nothing left to do)
    timing = {"time_to_first_step_s": first, "data_prep_s": run.data.seconds}
    return {**summary.final_losses(progress, n, val_loss), **validation.summary(), **timing}


def _first_step(run: Run, started: float) -> float:
    """Seconds from the start to the end of this invocation's first step, said once: what
    the setup cost (the data stage's share said beside it)."""
    seconds = time.perf_counter() - started
    say(run, f"first step after {seconds:.1f}s (data {run.data.seconds:.1f}s)")
    return seconds


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


def _show(bar: tqdm, where: str, postfix: dict[str, str]) -> None:
    bar.set_postfix(postfix)
    if bar.disable:  # no TTY (CI, pipes): a plain line instead of a bar
        line = " ".join(f"{k} {v}" for k, v in postfix.items())
        print(f"{where} {line}", file=sys.stderr)


def _write_json(path: Path, value: Any, allow_nan: bool = True) -> None:
    path.write_text(json.dumps(value, indent=2, allow_nan=allow_nan) + "\n")
