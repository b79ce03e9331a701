"""The ``gradstep train`` demo: a byte-level GPT trained with the exact accumulate-and-clip step.

The loop is deliberately one linear ``for``: every optimizer-step concern (accumulation,
normalisation by the true token count, precision, clipping, skipping) lives in
:class:`gradstep.Stepper`; this module only wires data, model, optimizer and logging
around it. Outputs in the run folder:

* ``config.json``   the resolved :class:`~gradstep.config.TrainConfig`;
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
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from gradstep import GradientNoiseScale, Stepper, StepStats, parallel
from gradstep.checkpoint import Checkpointer, CheckpointInfo
from gradstep.memory import checkpoint_blocks
from gradstep.metrics import FINISHED_FILE, MetricsLogger
from gradstep.metrics import jsonable as _jsonable
from gradstep.policies import clip_policies

from . import planning, preflight, run_folder, summary
from .batching import Layout, layout_for, windows_of
from .config import ConfigError, TrainConfig
from .data import Batch, DataError, TextSource, TrainBatches, load_source
from .evaluation import LMLoss, evaluate
from .hf_model import HFLoss, build_model, count_batch, load_tokenizer
from .schedule import BatchRamp, LRSchedule, WarmupCosine, ramp_windows

__all__ = ["LMLoss", "WarmupCosine", "evaluate", "train"]

TRAIN_LOSS_WINDOW = 10  # final train loss = token-weighted mean over the last N steps


def loss_for(cfg: TrainConfig, device: torch.device) -> tuple[Callable, Callable | None]:
    """(loss_fn, count) of the run's model: an HF model's may hold a router aux term."""
    return (HFLoss(device), count_batch) if cfg.is_hf else (LMLoss(device), None)


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """``cfg.optimizer`` with decay on matrices/embeddings only: decaying norm gains just
    hurts, and LARS/LAMB do not adapt them either (gradstep.optim.param_groups)."""
    from gradstep import optim

    groups = optim.param_groups(model, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "lars":
        return optim.LARS(groups, lr=cfg.lr, momentum=0.9)
    if cfg.optimizer == "lamb":
        return optim.LAMB(groups, lr=cfg.lr)  # no internal clip: the Stepper clips
    # torch's optimizers: the same two groups, without the LARS/LAMB-only key.
    groups = [{k: v for k, v in g.items() if k != "always_adapt"} for g in groups]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=0.9)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


@dataclass
class _Run:
    """Everything the loop touches, built once by :func:`_setup`."""

    cfg: TrainConfig
    out: Path
    device: torch.device
    world_size: int
    is_main: bool
    """Rank 0: the only process that prints and writes files."""
    model: nn.Module
    stepper: Stepper
    train_iter: TrainBatches
    val: list[Batch]
    source: TextSource
    accum_steps: int
    """Micro-batches per window on each rank."""
    layout: Layout
    progress: _Progress = field(default_factory=lambda: _Progress())
    planned_peak_mb: float | None = None
    """The plan's predicted peak (--micro-batch-size auto), logged next to the measured one."""
    start: int = 0
    """Steps already taken: the step of the checkpoint resumed from."""
    checkpointer: Checkpointer | None = None
    schedule: LRSchedule | None = None
    ramp: BatchRamp | None = None
    gns: GradientNoiseScale | None = None
    tokenizer: Any = None
    """The HF model's tokenizer (None: the demo GPT's bytes)."""

    @property
    def budget(self) -> int:
        """Micro-batches per rank the run trains on (ramped runs end on it)."""
        return self.cfg.max_steps * self.accum_steps

    def finished(self, steps: int) -> bool:
        if self.ramp is None:
            return steps >= self.cfg.max_steps
        return self.progress.micro_batches >= self.budget


@dataclass
class _Progress:
    """Loop totals a resume carries on, so the summary reads as one uninterrupted run."""

    initial_val_loss: float = math.nan
    tokens: int = 0
    micro_batches: int = 0
    """Micro-batches per rank consumed by the steps so far (skipped ones included)."""
    step_time: float = 0.0
    recent: list[tuple[float, int]] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, [tuple(r) for r in value] if key == "recent" else value)


def _setup(
    cfg: TrainConfig, env: parallel.DistEnv, info: CheckpointInfo | None, planned: bool = False
) -> _Run:
    rank, world, device = env.rank, env.world_size, env.device
    out = Path(cfg.out)
    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer(cfg)  # None: the demo GPT reads bytes
    source = load_source(cfg, tokenizer)
    layout = layout_for(cfg, world)
    # Same seed on every rank: DDP and FSDP2 both start from identical weights.
    model = build_model(cfg).to(device)
    if cfg.activation_checkpointing:
        checkpoint_blocks(model)  # before sharding, as FSDP2 expects
    model = parallel.prepare_model(model, cfg.strategy, cfg.precision)
    optimizer = build_optimizer(model, cfg)  # after sharding: FSDP2 steps its shards
    # A resume keeps the checkpoint's horizon (loaded with the schedule's state; older
    # checkpoints: their run's max_steps), however far this invocation trains.
    horizon = run_folder.schedule_horizon(info) if info is not None else None
    shape = WarmupCosine(cfg.warmup, horizon or cfg.max_steps, cfg.min_lr / cfg.lr)
    schedule = LRSchedule(shape, cfg.lr, layout.micro_batches, cfg.lr_scaling, world)
    clip = clip_policies(cfg.clip, cfg.spike_guard, model)  # agc: output layer excluded
    gns = GradientNoiseScale(cfg.gns_beta) if cfg.measures_gns else None
    # A planned micro-batch is a prediction: if it is wrong, split it rather than crash.
    on_oom = "split" if planned else "raise"
    stepper = Stepper(
        model,
        optimizer,
        clip=clip,
        precision=cfg.precision,
        on_oom=on_oom,
        hooks=[gns] if gns is not None else None,
    )
    train_iter = source.train_batches(cfg.seq_len, layout.stream_rows, cfg.seed, rank, world)
    val = source.validation_batches(
        cfg.seq_len, layout.micro_batch_size, cfg.eval_batches, rank, world
    )
    # FSDP2 all-gathers in every forward: all ranks must evaluate as many batches.
    val = val[: parallel.min_over_ranks(len(val))]
    if not val:
        raise DataError(
            "the validation data gives some rank no batch of "
            f"{cfg.micro_batch_size} sequences of --seq-len {cfg.seq_len}; give more (--val-data,"
            " --val-fraction) or a smaller --micro-batch-size / --seq-len"
        )
    run = _Run(
        cfg,
        out,
        device,
        world,
        env.is_main,
        model,
        stepper,
        train_iter,
        val,
        source,
        layout.micro_batches,
        layout,
        schedule=schedule,
        gns=gns,
        tokenizer=tokenizer,
    )
    _note(run, f"data: {source.describe()}")  # what trains, and every record cut or left out
    if cfg.batch_ramp is not None:
        run.ramp = BatchRamp.from_spec(cfg.batch_ramp, layout.micro_batches, world)
    if info is not None:
        _resume(run, info)
    if cfg.save_every or info is not None:
        run.checkpointer = Checkpointer(
            out / "checkpoints",
            cfg.keep_checkpoints,
            accum_steps=layout.stream_items_per_window,
            micro_batch_size=layout.stream_rows,
            trainable_only=cfg.lora > 0,  # the frozen base is rebuilt from the seed
        )
    return run


@dataclass
class _Settings:
    """The run's settings in its checkpoints, so a resume runs what the run ran. Where the
    run ran (folder, device, launch) is not the run's: it is left out."""

    cfg: TrainConfig

    def state_dict(self) -> dict[str, Any]:
        settings = self.cfg.to_dict()
        return {k: v for k, v in settings.items() if k not in run_folder.ENVIRONMENT}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass  # read from the manifest before the run is built (run_folder.saved_settings)


def _stateful(run: _Run) -> dict[str, Any]:
    """Everything a checkpoint holds, by name (the names are keys in the checkpoint)."""
    stepper = run.stepper
    return {
        "config": _Settings(run.cfg),
        "model": run.model,
        "optimizer": stepper.optimizer,
        "scheduler": run.schedule,
        "stepper": stepper,
        "data": run.train_iter,
        "progress": run.progress,
        **({"ramp": run.ramp} if run.ramp is not None else {}),
    }


def _resume(run: _Run, info: CheckpointInfo) -> None:
    """Load ``info`` into the run: model, optimizer, schedule, stepper, data position."""
    stateful = _stateful(run)
    if "config" not in info.manifest["objects"]:
        del stateful["config"]  # a checkpoint from before the settings were saved
    Checkpointer(info.path.parent, trainable_only=run.cfg.lora > 0).load(info, **stateful)
    run.start = info.step
    _note(run, f"resumed from {info.path} (step {info.step})")
    if info.accum_steps is not None and info.world_size != run.world_size:
        rows = run.layout.rows_per_rank
        what = "accum_steps" if rows is None else "sequences per step"
        now = run.accum_steps if rows is None else rows
        _note(
            run,
            f"the checkpoint ran {info.world_size} rank(s) x {what} {info.accum_steps}: "
            f"using {what} {now} on {run.world_size} to keep the global batch",
        )


def _note(run: _Run, line: str) -> None:
    if run.is_main:
        tqdm.write(line, file=sys.stderr)


def _save(run: _Run, step: int) -> int:
    if run.checkpointer is not None:
        run.checkpointer.save(step, **_stateful(run))
    return step


def _cut_metrics(path: Path, steps: int) -> None:
    """Keep the metrics of the first ``steps`` steps: the later ones will be run again."""
    if path.exists():
        lines = path.read_text().splitlines(keepends=True)[:steps]
        path.write_text("".join(line for line in lines if line.endswith("\n")))


def _progress(stats: StepStats, tokens_per_s: float, stepper: Stepper, steps: int) -> dict:
    return {
        "loss": f"{stats.loss:.3f}",
        "gnorm": f"{stats.grad_norm:.2f}",
        "clip%": f"{100 * stepper.clipped_steps / steps:.0f}",
        "tok/s": f"{tokens_per_s:,.0f}",
    }


def _windows(run: _Run) -> Iterator[list[Batch]]:
    """The run's remaining windows: fixed ones, or a ramp's growing ones."""
    if run.ramp is None:
        todo = max(0, run.cfg.max_steps - run.start)
        return itertools.islice(windows_of(run.train_iter, run.layout), todo)
    left = lambda: run.budget - run.progress.micro_batches  # noqa: E731
    return ramp_windows(run.train_iter, run.ramp, run.start, left)


def _extra(run: _Run) -> dict[str, Any]:
    """Record fields beyond StepStats: the plan's prediction, the noise scale."""
    extra: dict[str, Any] = {}
    if run.planned_peak_mb is not None:
        extra["planned_peak_mb"] = run.planned_peak_mb
    if run.gns is not None:
        extra["gns_b_simple"] = run.gns.b_simple
    return extra


def _loop(run: _Run, logger: MetricsLogger) -> dict[str, Any]:
    """The training loop: one window -> one ``stepper.step`` -> one metrics record."""
    cfg, done = run.cfg, run.progress
    loss_fn, count = loss_for(cfg, run.device)
    if run.start == 0:
        done.initial_val_loss = evaluate(run.model, run.val, run.device, loss_fn)
        tqdm.write(f"step 0: val_loss {done.initial_val_loss:.4f}", file=sys.stderr)
    val_loss = done.initial_val_loss
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
        done.micro_batches += k
        if run.ramp is not None and run.gns is not None:  # gns: sizes the next window
            run.ramp.observe(n - 1, run.gns.b_simple, stats.items, run.gns.measured_steps)
        done.tokens, done.step_time = done.tokens + stats.items, done.step_time + elapsed
        done.recent = [*done.recent[-(TRAIN_LOSS_WINDOW - 1) :], (stats.loss, stats.items)]
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
            progress = _progress(stats, done.tokens / done.step_time, run.stepper, n)
            bar.set_postfix(progress)
            if bar.disable:  # no TTY (CI, pipes): a plain line instead of a bar
                line = " ".join(f"{k} {v}" for k, v in progress.items())
                print(f"step {n}/{total or '?'} {line}", file=sys.stderr)
    bar.close()
    if run.checkpointer is not None and (saved != n or n == run.start):
        _save(run, n)  # the final checkpoint (also when a resume found nothing left to do)
    finite = [(loss, items) for loss, items in done.recent if math.isfinite(loss)]
    recent_tokens = sum(items for _, items in finite)
    final_train = sum(lo * it for lo, it in finite) / recent_tokens if recent_tokens else math.nan
    return {
        "steps": n,
        "initial_val_loss": done.initial_val_loss,
        "final_val_loss": val_loss,
        "final_train_loss": final_train,
        "train_tokens": done.tokens,
        "train_tokens_per_s": done.tokens / max(done.step_time, 1e-9),
    }


@contextlib.contextmanager
def _cpu_threads(threads: int) -> Iterator[None]:
    """Run with ``threads`` intra-op CPU threads (0: leave torch's setting), then restore:
    ``train()`` called from a test or a notebook must not change the caller's process."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


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
    checkpoint's values (see :mod:`gradstep_demo.run_folder`). None: every setting that
    differs from its default counts as given, except automatic ones left as None (e.g. the
    warm-up, which follows max_steps).

    Under torchrun (``--strategy ddp|fsdp``) every rank runs this; the process group is
    created here (unless the caller made one) and closed at the end; only rank 0 prints
    and writes the run folder.
    """
    started = time.perf_counter()
    if given is None:
        defaults = TrainConfig()
        given = [
            f.name
            for f in dataclasses.fields(cfg)
            if f.name not in cfg.auto_fields and getattr(cfg, f.name) != getattr(defaults, f.name)
        ]
    owns_group = not parallel.is_initialized()
    env = parallel.init(cfg.device, timeout_s=cfg.collective_timeout)
    try:
        with parallel.quiet_unless_main(), _cpu_threads(cfg.threads):
            summary = _train(cfg, env, started, callbacks, frozenset(given))
    except BaseException:
        if owns_group:
            parallel.shutdown(barrier=False)  # the other ranks may never reach a barrier
        raise
    if owns_group:
        parallel.shutdown()
    return summary


def _on_rank0(action: Callable[[], Any]) -> Any:
    """Run ``action`` on rank 0 only; every rank returns its result or raises its error, so
    a refusal on rank 0 never leaves the other ranks waiting in a collective."""
    result, error = None, None
    if parallel.is_main():
        try:
            result = action()
        except (ConfigError, DataError) as exc:
            error = exc
    result, error = parallel.broadcast_from_rank0((result, error))
    if error is not None:
        raise error
    return result


def _train(
    cfg: TrainConfig,
    env: parallel.DistEnv,
    started: float,
    callbacks: Sequence[Callable],
    given: frozenset[str],
) -> dict[str, Any]:
    preflight.check_run(cfg, env)  # before the run folder is touched
    with contextlib.ExitStack() as folder:
        claims: list[Callable[[], None]] = []
        _on_rank0(lambda: claims.append(folder.enter_context(run_folder.locked(Path(cfg.out)))))
        info = run_folder.find_checkpoint(cfg)
        _on_rank0(lambda: run_folder.prepare(cfg, info))
        cfg, notes = run_folder.resumed_settings(cfg, info, given, env.world_size)
        preflight.check_run(cfg, env)  # the resumed settings, before anything is planned
        _on_rank0(lambda: claims[0]())  # accepted: the lock file names this process
        notes += planning.prepare_process(cfg, env.device) or []
        planned = None
        if cfg.auto_micro_batch:
            planned = _plan(cfg, env)
            cfg = dataclasses.replace(
                cfg,
                micro_batch_size=planned.plan.micro_batch_size,
                activation_checkpointing=planned.plan.activation_checkpointing,
            )
        run = _setup(cfg, env, info, planned=planned is not None)
        if cfg.global_batch is not None:  # config.json says how the batch is really split
            cfg = run.cfg = dataclasses.replace(cfg, accum_steps=run.layout.micro_batches)
        if planned is not None:
            run.planned_peak_mb = planned.plan.predicted_peak_bytes / 2**20
        for line in [*notes, *_gns_notes(run, given)]:
            _note(run, line)
        if run.finished(run.start):
            _note(
                run,
                f"the run already finished: the checkpoint is at step {run.start} and "
                f"max_steps is {cfg.max_steps}; nothing to train and nothing was changed "
                "(pass a larger --max-steps to train on)",
            )
            return summary.existing(run.out)
        if run.is_main:
            (run.out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
            if planned is not None:
                plan_json = json.dumps(_jsonable(planned.to_json()), indent=2)
                (run.out / "plan.json").write_text(plan_json + "\n")
        return _run_loop(run, started, callbacks)


def _gns_notes(run: _Run, given: frozenset[str]) -> list[str]:
    """Noise-scale settings that would silently do nothing."""
    if run.gns is None:
        if "gns_beta" in given:
            return ["note: --gns-beta has no effect without --gns or --batch-ramp gns"]
        return []
    if run.layout.micro_batches * run.world_size < 2:
        what = "--global-batch" if run.layout.rows_per_rank is not None else "--accum-steps"
        return [
            "note: --gns compares the micro-batches of a step with their sum and needs at "
            f"least 2 per step over all ranks; with 1, gns_b_simple stays null: raise {what}"
        ]
    return []


def _plan(cfg: TrainConfig, env: parallel.DistEnv) -> planning.Planned:
    """--micro-batch-size auto: probe, plan, say what was chosen."""
    planned = planning.plan_run(cfg, env.device)
    if env.is_main:
        if planned.probe is not None:
            tqdm.write(planned.probe.describe(), file=sys.stderr)
        tqdm.write(planned.plan.table(), file=sys.stderr)
    return planned


def _run_loop(run: _Run, started: float, callbacks: Sequence[Callable]) -> dict[str, Any]:
    if run.start and run.is_main:
        _cut_metrics(run.out / "metrics.jsonl", run.start)
    # Other ranks run the same loop (collectives) but log their records nowhere.
    main, cfg = run.is_main, run.cfg
    logger = MetricsLogger(
        run.out if main else None,
        tensorboard=cfg.tensorboard and main,
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
            (run.out / "summary.json").write_text(
                json.dumps(_jsonable(result), indent=2, allow_nan=False) + "\n"
            )
            logger.finish()
    summary.show(result)
    return result
