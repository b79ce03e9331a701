"""``--micro-batch-size auto`` and ``gradstep plan``: the run's model, probed and planned.

The probe builds a throwaway instance of the run's model (the toy GPT, or the Hugging Face
model ``hf:DIR`` as :class:`~gradstep_cli.models.spec.ModelSpec` builds it: pretrained
weights, LoRA; same dropout, precision, sharding and optimizer), takes a real
``Stepper.step`` of one micro-batch at two or three sizes, then at a few more sequence
lengths until the kernel caches are full, and reads the peak
(``gradstep.memory.probe_memory``); the analytic model
(``TransformerShape``, or ``HFShape`` from the model's config) turns that into a prediction
for every candidate (micro-batch size x checkpointing x, unless ``--loss-chunk-tokens`` is
given, the loss chunked or from the whole logits). The probe runs the data's longest row (a
micro-batch is padded to its longest row, at most ``--seq-len``) and its shape sweep the
data's other lengths (the data stage's: never read again); packed rows (``--packing``) are
all ``--seq-len`` long, one shape, no sweep (:mod:`.rows`). Candidates are ranked by a count
of their step's work, padding included (:mod:`gradstep.memory.speed`), never by the probe's
timings: the same flags give the same plan in every process. Rank 0's plan is every rank's.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from gradstep import Stepper, parallel
from gradstep.memory import (
    BudgetTooSmall,
    Plan,
    ProbeResult,
    budget_text,
    checkpoint_blocks,
    current_bytes,
    estimate_step_memory,
    format_bytes,
    peak_bytes,
    plan_step,
    probe_memory,
    reset_peak,
    step_predictor,
    step_time_model,
    sweep_widths,
)
from gradstep_cli.config.settings import ConfigError, TrainConfig
from gradstep_cli.models.parallel_plan import prepare
from gradstep_cli.models.spec import ModelSpec
from gradstep_cli.plan.budget import MARGIN, analytic_fixed_bytes, device_budget
from gradstep_cli.plan.estimate import (
    estimate_kwargs,
    head_chunks,
    loss_chunks,
    model_shape,
    quiet,
    quiet_hf_config,
)
from gradstep_cli.plan.quote import needed, quote, room
from gradstep_cli.plan.rows import Rows, probe_batches, rows_of
from gradstep_cli.run.launch import Launch

__all__ = ["PLAN_SECONDS", "Planned", "plan_for", "plan_run", "timing_line"]

SWEEP_SHAPES = 6


@dataclass
class Planned:
    plan: Plan
    probe: ProbeResult | None
    build_peak_bytes: int = 0
    """The peak of building the probe's model (loading pretrained weights): a run's process
    peaks there when that is above its step (every candidate's prediction includes it)."""
    width: int = 0
    """The longest row the probe and the analytic model planned for (HF: the data's)."""
    data_peak_bytes: int = 0
    """The process's peak while it prepared the data (CPU, under a budget): every
    candidate's prediction includes it too."""

    def to_json(self) -> dict:
        out = self.plan.to_json()
        out["width"] = self.width
        out["data_peak_bytes"] = self.data_peak_bytes
        if self.probe is not None:
            out["probe"] = {
                "fixed_bytes": self.probe.fixed_bytes,
                "per_item_bytes": self.probe.per_item_bytes,
                "shape_bytes": self.probe.shape_bytes,
                "shapes_run": self.probe.shapes_run,
                "shapes_settled": self.probe.shapes_settled,
                "shapes_unmeasured": self.probe.shapes_unmeasured,
                "one_size": self.probe.one_size,
                "per_item_source": self.probe.per_item_source,
                "seconds": self.probe.seconds_total,
                "source": self.probe.source,
                "build_peak_bytes": self.build_peak_bytes,
            }
        return out


def _probe_model(model: ModelSpec, device: torch.device, checkpointing: bool) -> Stepper:
    """A throwaway instance of the run's model, sharding, optimizer kind and precision."""
    from gradstep_cli.run.components import build_optimizer  # the run's param groups

    cfg = model.cfg
    with quiet():
        module = model.build().to(device)
    if checkpointing:
        checkpoint_blocks(module)
    module = prepare(module, cfg)
    return Stepper(module, build_optimizer(module, cfg), clip=None, precision=cfg.precision)


def _every_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on every rank (one all-reduce)."""
    return not parallel.agree(not flag)


@dataclass(frozen=True)
class _Inputs:
    """What one plan is made for, derived once by :func:`plan_for`."""

    cfg: TrainConfig
    device: torch.device
    world: int
    """Launched ranks."""
    per_rank: int
    """Sequences of the global batch on each data rank."""
    budget: int
    data: Rows
    shape: Any
    """The analytic model's shape at the data's longest row."""
    estimate: dict
    """The analytic model's other arguments (:func:`estimate_kwargs`)."""
    speed: Callable[..., float]
    """Each candidate's step time (:func:`step_time_model` of the data's rows)."""
    chunk: int
    """The run's own loss, as it will run: ``--loss-chunk-tokens``, 0 (the whole logits)
    where the head cannot be chunked (:func:`head_chunks`)."""


def _probe(model: ModelSpec, run: _Inputs, checkpointing: bool) -> tuple[ProbeResult, int]:
    """(the probe, the peak of building its model): steps at ``data.width``, then the
    shape sweep over the data's other lengths."""
    cfg, device, data = run.cfg, run.device, run.data
    reset_peak(device)
    held = [_probe_model(model, device, checkpointing)]  # dropped before the run's own
    build_peak = peak_bytes(device)
    batch, loss_fn, count = probe_batches(cfg, device, model.vocab_size, data.packed)

    def step(rows: int, width: int) -> None:
        held[0].step([batch(rows, width)], loss_fn, count=count)

    # Packed rows have one shape: nothing to sweep.
    widths = [] if data.packed else sweep_widths(cfg.seq_len, SWEEP_SHAPES, data.lengths.tolist())
    try:
        result = probe_memory(
            lambda b: step(b, data.width),
            _probe_sizes(run),
            device=device,
            # The plan's own bound: a run that plans itself peaks at least where the probe
            # did, and that too must leave the margin free.
            budget_bytes=int(run.budget * (1 - MARGIN)),
            agree=_every_rank if run.world > 1 else None,
            shapes=(lambda i: step(1, widths[i % len(widths)])) if widths else None,
            max_shapes=len(widths),
            per_item_bytes=_per_item(run, checkpointing),
        )
    finally:
        _release(held.pop())
        gc.collect()
    return result, build_peak


def _probe_sizes(run: _Inputs) -> list[int]:
    """The sizes the probe measures: 1, 2 and 4 (a line through three points, and what each
    new size's kernels add), but no size above the fastest micro-batch the speed model
    knows of (when it is 1 or 2: two sizes still make a measured line). Unpacked
    variable-length rows usually make micro-batch 1 the fastest (no padding)."""
    sizes = [s for s in (1, 2, 4, 8, 16) if s <= run.per_rank]
    fastest = max(sizes, key=lambda m: (m / run.speed(m, False, run.chunk), m))
    return [s for s in (1, 2, 4) if s <= min(run.per_rank, max(2, fastest))]


def _release(stepper: Stepper) -> None:
    """Let the probe's model go. Under DDP the Stepper's communication hook holds its
    strategy, which holds the model: a cycle through DDP's C++ reducer that Python's
    collector cannot see, so the probe's model, gradients and optimizer state would stay
    for the whole run. Cutting the strategy's reference frees them."""
    strategy = getattr(stepper, "_strategy", None)
    if strategy is not None and hasattr(strategy, "model"):
        strategy.model = None


def _estimate(run: _Inputs, mbs: int, checkpointing: bool) -> int:
    """The analytic total of one step of ``mbs`` rows (one micro-batch, the run's runtime)."""
    fixed = analytic_fixed_bytes(run.cfg, run.device)
    return estimate_step_memory(
        run.shape, mbs, activation_checkpointing=checkpointing, fixed_bytes=fixed, **run.estimate
    ).total


def _per_item(run: _Inputs, checkpointing: bool) -> float:
    """The analytic model's cost of one more row in the probe's step (its slope)."""
    return float(_estimate(run, 2, checkpointing) - _estimate(run, 1, checkpointing))


def _probe_checkpointing(run: _Inputs) -> bool:
    """Probe with checkpointing when the analytic model says one item, and room for the
    data's other shapes, do not fit the budget's usable part without it (the probe keeps
    the plan's bound too). Refuse at once, naming the budget needed, when the process alone
    already exceeds the budget or even the smallest plan is estimated above it (the probe
    itself would break it). Every rank decides the same (the worst rank's numbers count):
    they then probe together."""
    budget = run.budget
    in_use, smallest = current_bytes(run.device), _estimate(run, 1, True)
    spare = room(run.device, run.data.packed)
    usable = budget * (1 - MARGIN)  # what the probe may use, as the plan
    if not _every_rank(in_use <= usable and smallest <= budget):
        before = "already exceeded before probing" if in_use > budget else "too small"
        raise ConfigError(
            f"memory budget {format_bytes(budget)} is {before}: this process uses "
            f"{format_bytes(in_use)} before building the model, and the smallest plan "
            f"(micro-batch 1, activation checkpointing on) is estimated at "
            f"{format_bytes(smallest)} per rank: give --memory-budget "
            f"{budget_text(quote(max(smallest, in_use) + spare))} or more"
        )
    return not _every_rank(_estimate(run, 1, False) + spare <= usable)


def plan_run(
    cfg: TrainConfig, device: torch.device, probe: bool = True, source: Any = None
) -> Planned:
    """:func:`plan_for` this process, for a caller outside ``gradstep train`` and ``gradstep
    plan``: the launch is read from the process group, an hf: model's config and (unless
    ``source`` is given) its data are loaded here."""
    env = parallel.DistEnv(parallel.rank(), parallel.world_size(), 0, device, None)
    hf_config = quiet_hf_config(cfg) if cfg.is_hf else None
    if cfg.is_hf and source is None:
        from gradstep_cli.data.sources import load_source
        from gradstep_cli.models.hf import load_tokenizer

        with quiet():
            source = load_source(cfg, load_tokenizer(cfg, hf_config))
    return plan_for(cfg, Launch.of(cfg, env), ModelSpec.of(cfg, hf_config), source, probe)


def plan_for(
    cfg: TrainConfig,
    launch: Launch,
    model: ModelSpec,
    source: Any,
    probe: bool = True,
    given: frozenset[str] | None = None,
) -> Planned:
    """Plan ``cfg.global_batch`` for this device (collective under torchrun): probe
    ``model`` (unless not ``probe``) on the rows of ``source`` (the data stage's).
    ``given``: the settings the caller set on purpose (``Checked.given``; None: those that
    differ from their defaults); ``--loss-chunk-tokens`` among them is kept, else the loss
    is planned chunked or whole. The caller settles the process first
    (:func:`settle_process`)."""
    if cfg.global_batch is None:
        raise ConfigError("planning needs --global-batch: the sequences per optimizer step")
    with _threads(cfg.threads):
        return _plan(cfg, launch, model, source, probe, given)


@contextlib.contextmanager
def _threads(threads: int) -> Iterator[None]:
    """``--threads`` intra-op threads while planning, as the run has them
    (``run.launch.launched``): ``gradstep plan`` probed with torch's default (every core),
    so its probe measured other thread pools than ``train``'s and, on a shared 2-core
    machine, spun its threads against the other processes' (the fine-tuning walk's plan:
    42 s with 2 threads, 7 s with 1, under the same load)."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _plan(
    cfg: TrainConfig,
    launch: Launch,
    model: ModelSpec,
    source: Any,
    probe: bool,
    given: frozenset[str] | None,
) -> Planned:
    """:func:`plan_for`'s work, with the run's threads."""
    device, world = launch.device, launch.world_size
    data = rows_of(cfg, source)  # held until planned: the probe's baseline holds it
    kwargs = estimate_kwargs(cfg, device, world)
    shape = model_shape(model, data.width)
    lengths, counts = data.distribution()
    run = _Inputs(
        cfg,
        device,
        world,
        per_rank=math.ceil(cfg.global_batch / launch.data_ranks),
        budget=device_budget(cfg, device),
        data=data,
        shape=shape,
        estimate=kwargs,
        speed=step_time_model(shape, data.width, lengths, counts, device.type, data.trained),
        chunk=cfg.loss_chunk_tokens if head_chunks(model) else 0,
    )
    result, probe_ckpt, build_peak = None, False, 0
    if probe:
        probe_ckpt = _probe_checkpointing(run)
        result, build_peak = _probe(model, run, probe_ckpt)
    else:
        kwargs = {**kwargs, "fixed_bytes": analytic_fixed_bytes(cfg, device)}
    step_peak = step_predictor(
        run.shape,
        probe=result,
        probe_checkpointing=probe_ckpt,
        per_rank_batch=run.per_rank,
        **kwargs,
    )
    data_peak = getattr(getattr(source, "prepared", None), "peak_bytes", 0)

    def predict(mbs: int, checkpointing: bool, chunk: int | None = None) -> int:
        return max(step_peak(mbs, checkpointing, chunk), build_peak, data_peak)

    plan = _choose(run, launch.data_ranks, predict, result, loss_chunks(cfg, model, given))
    return Planned(plan, result, build_peak, data.width, data_peak)


def _choose(
    run: _Inputs,
    data_ranks: int,
    predict: Callable[..., int],
    result: ProbeResult | None,
    chunks: list | None,
) -> Plan:
    """The fastest candidate that fits, by the count of its step's work; one plan, or one
    refusal, for every rank: rank 0's, from its probe."""
    speed = run.speed
    plan, error = None, None
    try:
        plan = plan_step(
            run.budget,
            run.cfg.global_batch,
            world_size=data_ranks,
            predict=predict if chunks else (lambda m, c: predict(m, c)),
            step_time=speed if chunks else (lambda m, c: speed(m, c, run.chunk)),
            margin=MARGIN,
            loss_chunks=chunks,
            budget_for=lambda c: needed(c, result, room(run.device, run.data.packed)),
        )
        plan.tp = run.cfg.tp
        plan.probe_peak_bytes = result.highest_bytes if result is not None else 0
        if plan.loss_chunk_tokens is None:
            plan.loss_chunk_tokens = run.cfg.loss_chunk_tokens
    except BudgetTooSmall as exc:
        error = f"--memory-budget: {exc}"
    plan, error = parallel.broadcast_from_rank0((plan, error))
    if error is not None:
        raise ConfigError(error)
    return plan


PLAN_SECONDS = 30.0
"""What ``gradstep plan`` should take at most; when it takes longer it says why."""


def timing_line(planned: Planned, total: float, setup: float) -> str:
    """How long the plan took, and where; past :data:`PLAN_SECONDS`, why. ``setup``: the
    seconds before planning (reading the data and the model)."""
    probe = planned.probe
    line = f"planned in {total:.1f}s: reading the data and the model {setup:.1f}s, "
    if probe is None:
        return line + "the analytic estimate (no probe)"
    steps = len(probe.points) + (probe.warmup is not None) + probe.shapes_run
    line += (
        f"probing {probe.seconds_total:.1f}s ({steps} training steps of the model: "
        f"{len({b for b, _, _ in probe.points})} sizes, {probe.shapes_run} more input shapes)"
    )
    if total <= PLAN_SECONDS:
        return line
    why = []
    if probe.seconds_total >= setup:
        why.append(f"a probe step took {probe.seconds_total / max(steps, 1):.1f}s here")
    else:
        why.append(f"reading the data and the model took {setup:.1f}s")
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    if load > cpus:
        why.append(f"the machine is loaded ({load:.1f} runnable processes on {cpus} CPUs)")
    return (
        f"{line}; over {PLAN_SECONDS:.0f}s: {', and '.join(why)}. --no-probe plans from the "
        "analytic estimate alone, without running a step"
    )
