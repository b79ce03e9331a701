"""The ``gradstep train`` demo: a byte-level GPT trained with the exact accumulate-and-clip step.

Read top to bottom: the entry (:func:`train`), the setup (model, optimizer, Stepper,
data), the loop. The loop is deliberately one linear ``for``: every optimizer-step concern
(accumulation, normalisation by the true token count, precision, clipping, skipping) lives
in :class:`gradstep.Stepper`; this module only wires data, model, optimizer and logging
around it. Starting or resuming a run (the run folder, checkpoints) is
:mod:`gradstep_cli.run.resume`. Outputs in the run folder:

* ``config.json``   the resolved :class:`~gradstep_cli.config.settings.TrainConfig`;
* ``metrics.jsonl`` one JSON object per optimizer step, written by
  :class:`~gradstep.metrics.MetricsLogger` (every ``StepStats`` field, plus ``tokens_per_s``,
  ``step_time_s``, ``peak_memory_mb``, ``elapsed_s`` and ``val_loss`` on evaluation steps);
* ``tensorboard/``  the same scalars as TensorBoard events, with ``--tensorboard``;
* ``summary.json``  effective batch, initial/final losses, clip/skip counts, wall time and
  a generated sample;
* ``checkpoints/``  with ``--save-every N``: ``step-N`` folders (:mod:`gradstep.checkpoint`);
  ``--resume`` continues the newest valid one, ``metrics.jsonl`` cut back to its step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from gradstep import GradientNoiseScale, Stepper, StepStats, parallel
from gradstep.checkpoint import CheckpointInfo
from gradstep.memory import checkpoint_blocks
from gradstep.metrics import FINISHED_FILE, MetricsLogger, jsonable
from gradstep.policies import clip_policies
from gradstep_cli.config import preflight
from gradstep_cli.config.settings import TrainConfig
from gradstep_cli.data.batching import layout_for, rank_batches, windows_of
from gradstep_cli.data.sources import Batch, load_source
from gradstep_cli.models import parallel_plan
from gradstep_cli.models.hf import build_model, load_tokenizer
from gradstep_cli.plan import planning
from gradstep_cli.run import folder as run_folder
from gradstep_cli.run import resume, summary
from gradstep_cli.run.components import build_optimizer, loss_for
from gradstep_cli.run.evaluation import LMLoss, evaluate
from gradstep_cli.run.schedule import BatchRamp, LRSchedule, WarmupCosine, ramp_windows

__all__ = ["LMLoss", "WarmupCosine", "build_optimizer", "evaluate", "loss_for", "train"]

TRAIN_LOSS_WINDOW = 10  # final train loss = token-weighted mean over the last N steps

# --------------------------------------------------------------------------------- entry


def train(
    cfg: TrainConfig,
    callbacks: Sequence[Callable[[dict[str, Any]], Any]] = (),
    given: Iterable[str] | None = None,
) -> dict[str, Any]:
    """Train the demo model as configured; write the run folder and return the summary.

    ``callbacks`` are called (on rank 0) with every step's metrics record, see
    :class:`~gradstep.metrics.MetricsLogger`: e.g. to forward them to another tracker.
    ``given`` names the settings the caller set on purpose (the CLI: flags and config-file
    keys); on a resume those are checked against the checkpoint's, the others take the
    checkpoint's values (see :mod:`gradstep_cli.run.folder`). None: every setting that
    differs from its default counts as given, except automatic ones left as None (e.g. the
    warm-up, which follows max_steps).

    Under torchrun (``--strategy ddp|fsdp``) every rank runs this; the process group is
    created here (unless the caller made one) and closed at the end; only rank 0 prints
    and writes the run folder.
    """
    started = time.perf_counter()
    given = resume.given_fields(cfg) if given is None else frozenset(given)
    with resume.launched(cfg) as env:
        return _train(cfg, env, started, callbacks, given)


def _train(
    cfg: TrainConfig,
    env: parallel.DistEnv,
    started: float,
    callbacks: Sequence[Callable],
    given: frozenset[str],
) -> dict[str, Any]:
    with contextlib.ExitStack() as folder:  # rank 0 holds the run folder's lock until done
        cfg, info, notes = resume.open_run(cfg, env, given, folder)
        notes += planning.prepare_process(cfg, env.device) or []
        planned = _plan(cfg, env) if cfg.auto_micro_batch else None
        if planned is not None:
            cfg = dataclasses.replace(
                cfg,
                micro_batch_size=planned.plan.micro_batch_size,
                activation_checkpointing=planned.plan.activation_checkpointing,
            )
        run = _setup(cfg, env, info, planned)
        gns = preflight.gns_notes(run.cfg, run.layout.micro_batches, run.data_ranks, given)
        for line in [*notes, *gns]:
            _note(run, line)
        if run.finished(run.start):
            _note(
                run,
                f"the run already finished: the checkpoint is at step {run.start} and "
                f"max_steps is {run.cfg.max_steps}; nothing to train and nothing was changed "
                "(pass a larger --max-steps to train on)",
            )
            return summary.existing(run.out)
        if run.is_main:
            _write_json(run.out / "config.json", run.cfg.to_dict())
            if planned is not None:
                _write_json(run.out / "plan.json", jsonable(planned.to_json()))
        return _run_loop(run, started, callbacks)


def _plan(cfg: TrainConfig, env: parallel.DistEnv) -> planning.Planned:
    """--micro-batch-size auto: probe, plan, say what was chosen."""
    planned = planning.plan_run(cfg, env.device)
    if env.is_main:
        if planned.probe is not None:
            tqdm.write(planned.probe.describe(), file=sys.stderr)
        tqdm.write(planned.plan.table(), file=sys.stderr)
    return planned


# --------------------------------------------------------------------------------- setup


def _setup(
    cfg: TrainConfig,
    env: parallel.DistEnv,
    info: CheckpointInfo | None,
    planned: planning.Planned | None,
) -> resume.Run:
    """The run: model, optimizer and Stepper, data, LR schedule; resumed from ``info``."""
    data_rank, world = parallel_plan.data_rank(cfg, env.rank, env.world_size)
    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer(cfg)  # None: the demo GPT reads bytes
    source = load_source(cfg, tokenizer)
    layout = layout_for(cfg, world)
    model, stepper, gns = _model_and_stepper(cfg, env.device, planned is not None)
    train_iter, val = rank_batches(cfg, source, layout, data_rank, world)
    # A resume keeps the checkpoint's horizon (loaded with the schedule's state; older
    # checkpoints: their run's max_steps), however far this invocation trains.
    horizon = run_folder.schedule_horizon(info) if info is not None else None
    shape = WarmupCosine(cfg.warmup, horizon or cfg.max_steps, cfg.min_lr / cfg.lr)
    if cfg.global_batch is not None:  # config.json says how the batch is really split
        cfg = dataclasses.replace(cfg, accum_steps=layout.micro_batches)
    run = resume.Run(
        cfg=cfg,
        out=Path(cfg.out),
        device=env.device,
        world_size=env.world_size,
        data_ranks=world,
        is_main=env.is_main,
        model=model,
        stepper=stepper,
        train_iter=train_iter,
        val=val,
        source=source,
        accum_steps=layout.micro_batches,
        layout=layout,
        schedule=LRSchedule(shape, cfg.lr, layout.micro_batches, cfg.lr_scaling, world),
        planned_peak_mb=None if planned is None else planned.plan.predicted_peak_bytes / 2**20,
        gns=gns,
        tokenizer=tokenizer,
    )
    mesh = parallel_plan.data_ranks_note(cfg, env.world_size)
    if mesh is not None:
        _note(run, mesh)
    _note(run, f"data: {source.describe()}")  # what trains, and every record cut or left out
    if cfg.batch_ramp is not None:
        run.ramp = BatchRamp.from_spec(cfg.batch_ramp, layout.micro_batches, world)
    for line in resume.load(run, info) if info is not None else []:
        _note(run, line)
    if cfg.save_every or info is not None:
        run.checkpointer = resume.checkpointer(run)
    return run


def _model_and_stepper(
    cfg: TrainConfig, device: torch.device, planned: bool
) -> tuple[nn.Module, Stepper, GradientNoiseScale | None]:
    # Same seed on every rank: DDP and FSDP2 both start from identical weights.
    model = build_model(cfg).to(device)
    if cfg.activation_checkpointing:
        checkpoint_blocks(model)  # before sharding, as FSDP2 expects
    model = parallel_plan.prepare(model, cfg)
    optimizer = build_optimizer(model, cfg)  # after sharding: FSDP2 steps its shards
    clip = clip_policies(cfg.clip, cfg.spike_guard, model)  # agc: output layer excluded
    gns = GradientNoiseScale(cfg.gns_beta) if cfg.measures_gns else None
    stepper = Stepper(
        model,
        optimizer,
        clip=clip,
        precision=cfg.precision,
        # A planned micro-batch is a prediction: if it is wrong, split it rather than crash.
        on_oom="split" if planned else "raise",
        hooks=[gns] if gns is not None else None,
    )
    return model, stepper, gns


# ---------------------------------------------------------------------------------- loop


def _run_loop(run: resume.Run, started: float, callbacks: Sequence[Callable]) -> dict[str, Any]:
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


def _loop(run: resume.Run, logger: MetricsLogger) -> dict[str, Any]:
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


def _windows(run: resume.Run) -> Iterator[list[Batch]]:
    """The run's remaining windows: fixed ones, or a ramp's growing ones."""
    if run.ramp is None:
        todo = max(0, run.cfg.max_steps - run.start)
        return itertools.islice(windows_of(run.train_iter, run.layout), todo)
    left = lambda: run.budget - run.progress.micro_batches  # noqa: E731
    return ramp_windows(run.train_iter, run.ramp, run.start, left)


def _extra(run: resume.Run) -> dict[str, Any]:
    """Record fields beyond StepStats: the plan's prediction, the noise scale."""
    extra: dict[str, Any] = {}
    if run.planned_peak_mb is not None:
        extra["planned_peak_mb"] = run.planned_peak_mb
    if run.gns is not None:
        extra["gns_b_simple"] = run.gns.b_simple
    return extra


def _save(run: resume.Run, step: int) -> int:
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


# ------------------------------------------------------------------------------ plumbing


def _note(run: resume.Run, line: str) -> None:
    if run.is_main:
        tqdm.write(line, file=sys.stderr)


def _write_json(path: Path, value: Any, allow_nan: bool = True) -> None:
    path.write_text(json.dumps(value, indent=2, allow_nan=allow_nan) + "\n")
