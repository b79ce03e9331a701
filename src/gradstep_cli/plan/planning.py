"""``--micro-batch-size auto`` and ``gradstep plan``: the run's model, probed and planned.

The probe builds a throwaway copy of the run's model (the demo GPT, or the Hugging Face
model ``hf:DIR`` as ``hf_model.build_model`` builds it: pretrained weights, LoRA; same
dropout, precision, sharding and optimizer), takes a real ``Stepper.step`` of one
micro-batch at two or three sizes, then at a few more sequence lengths until the kernel
caches are full, and reads the peak (``gradstep.memory.probe_memory``); the analytic model
(``TransformerShape``, or ``HFShape`` from the model's config) turns that into a prediction
for every candidate (micro-batch size x checkpointing). An HF model is probed at its
data's longest row (a micro-batch is padded to its longest row, at most ``--seq-len``) and
its shape sweep runs the data's other lengths. Rank 0's plan is every rank's.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gradstep import Stepper, parallel
from gradstep.memory import (
    BudgetTooSmall,
    Plan,
    ProbeResult,
    available_bytes,
    bound_kernel_caches,
    budget_text,
    checkpoint_blocks,
    current_bytes,
    estimate_step_memory,
    format_bytes,
    needed_budget,
    parse_size,
    peak_bytes,
    pin_mmap_threshold,
    plan_step,
    probe_memory,
    probe_step_time,
    reset_peak,
    runtime_bytes,
    step_predictor,
    sweep_widths,
)
from gradstep_cli.config.settings import ConfigError, TrainConfig
from gradstep_cli.models.gpt import GPTConfig
from gradstep_cli.models.parallel_plan import prepare
from gradstep_cli.plan.estimate import estimate_kwargs, quiet, quiet_hf_config, shape_of

__all__ = [
    "Planned",
    "device_budget",
    "estimate_kwargs",
    "plan_run",
    "predict_fixed",
    "prepare_process",
    "shape_of",
]

MARGIN = 0.1
"""Share of the budget the plan leaves free (prediction error, allocator slack)."""
CPU_KERNEL_CACHE_BYTES = 24 * 2**20
"""CPU, bf16/fp16: what oneDNN's kernel caches, bounded by ``bound_kernel_caches``, hold
beyond one input shape when full (two more shapes of the demo GPT, ~12 MiB each, torch
2.13): the analytic estimate's stand-in for the probe's shape sweep."""
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

    def to_json(self) -> dict:
        out = self.plan.to_json()
        out["width"] = self.width
        if self.probe is not None:
            out["probe"] = {
                "fixed_bytes": self.probe.fixed_bytes,
                "per_item_bytes": self.probe.per_item_bytes,
                "shape_bytes": self.probe.shape_bytes,
                "shapes_run": self.probe.shapes_run,
                "shapes_settled": self.probe.shapes_settled,
                "shapes_unmeasured": self.probe.shapes_unmeasured,
                "one_size": self.probe.one_size,
                "seconds": self.probe.seconds_total,
                "source": self.probe.source,
                "build_peak_bytes": self.build_peak_bytes,
            }
        return out


@dataclass
class _Data:
    """The run's data as the planner sees it: the longest row and the other lengths."""

    width: int
    lengths: list[int] = field(default_factory=list)
    source: Any = None
    """Held while probing, so that the probe's baseline holds the data as the run will."""


def device_budget(cfg: TrainConfig, device: torch.device) -> int:
    """``--memory-budget``, else what this device has free (CUDA: free device memory; CPU:
    available memory plus what this process already holds)."""
    if cfg.memory_budget is not None:
        return parse_size(cfg.memory_budget)
    try:
        return available_bytes(device)
    except (OSError, KeyError, ValueError):
        raise ConfigError(
            "cannot read this machine's free memory: give --memory-budget (e.g. 4GiB)"
        ) from None


def _settle_process(cfg: TrainConfig, device: torch.device) -> None:
    """Pin glibc's mmap threshold (freed activations leave the process) and bound oneDNN's
    kernel caches (new sequence lengths cannot grow it for ever): on CPU the budget is the
    resident set, and both make it follow the live tensors."""
    if device.type == "cpu":
        pin_mmap_threshold()
        bound_kernel_caches()


def _fixed_bytes(cfg: TrainConfig, device: torch.device) -> int:
    """The analytic estimate's fixed cost: the runtime now (+ the first steps' lazy costs)
    and, on CPU in low precision, the full kernel caches."""
    caches = CPU_KERNEL_CACHE_BYTES if device.type == "cpu" and cfg.precision != "fp32" else 0
    return runtime_bytes(device) + caches


def predict_fixed(cfg: TrainConfig, device: torch.device, world: int) -> int:
    """Analytic peak per rank of the run's fixed micro-batch size on ``world`` launched
    ranks (cheap: no model built)."""
    from gradstep_cli.data.batching import layout_for

    layout = layout_for(cfg, world // cfg.tp)  # the batch is split over the data ranks
    est = estimate_step_memory(
        shape_of(cfg),
        layout.micro_batch_size,
        activation_checkpointing=cfg.activation_checkpointing,
        accum_steps=layout.micro_batches,
        fixed_bytes=_fixed_bytes(cfg, device),
        **estimate_kwargs(cfg, device, world),
    )
    return est.total


def prepare_process(cfg: TrainConfig, device: torch.device) -> list[str]:
    """The process settings a memory budget's prediction relies on, before the run builds
    anything (called by ``gradstep train`` for every run); returns lines to print.

    Whenever a budget is given (or planned for), on CPU: the mmap threshold and the kernel
    caches (:func:`_settle_process`). With a fixed ``--micro-batch-size`` the budget is not
    planned for, so the analytic prediction of the fixed choice is said, as a warning
    when it does not fit.
    """
    if cfg.memory_budget is None and not cfg.auto_micro_batch:
        return []
    _settle_process(cfg, device)
    if cfg.auto_micro_batch:
        return []
    budget = parse_size(cfg.memory_budget)  # type: ignore[arg-type]
    try:
        peak = predict_fixed(cfg, device, parallel.world_size())
    except ConfigError:
        raise
    except ValueError as exc:  # a model family the memory model does not know
        return [f"--memory-budget {format_bytes(budget)} is not checked for {cfg.model}: {exc}"]
    rows = f" of --seq-len {cfg.seq_len}" if cfg.is_hf else ""
    said = (
        f"--micro-batch-size {cfg.micro_batch_size} is predicted to peak at "
        f"{format_bytes(peak)} per rank (analytic estimate{rows})"
    )
    usable = budget * (1 - MARGIN)
    if peak <= usable:
        return [f"{said}, within --memory-budget {format_bytes(budget)}"]
    return [
        f"warning: {said}, over --memory-budget {format_bytes(budget)} with its "
        f"{MARGIN:.0%} margin (a budget of {budget_text(needed_budget(peak, MARGIN))} would "
        "hold it); the budget is only planned for with --micro-batch-size auto, or use "
        "--activation-checkpointing / a smaller --micro-batch-size"
    ]


def _probe_model(cfg: TrainConfig, device: torch.device, checkpointing: bool) -> Stepper:
    """A throwaway copy of the run's model, sharding, optimizer kind and precision."""
    from gradstep_cli.models.hf import build_model
    from gradstep_cli.run.components import build_optimizer  # the run's param groups

    with quiet():
        model = build_model(cfg).to(device)
    if checkpointing:
        checkpoint_blocks(model)
    model = prepare(model, cfg)
    return Stepper(model, build_optimizer(model, cfg), clip=None, precision=cfg.precision)


def _every_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on every rank (one all-reduce)."""
    return not parallel.agree(not flag)


def _data(cfg: TrainConfig, source: Any = None) -> _Data:
    """The rows an HF run will train on (its tokenizer and data, loaded here unless
    ``source`` is given); the demo GPT plans for rows of ``--seq-len``."""
    if not cfg.is_hf:
        return _Data(cfg.seq_len)
    if source is None:
        from gradstep_cli.data.sources import load_source
        from gradstep_cli.models.hf import load_tokenizer

        with quiet():
            source = load_source(cfg, load_tokenizer(cfg))
    lengths = [int(n) for n in source.lengths(cfg.seq_len, cfg.seed)]
    return _Data(max(lengths, default=cfg.seq_len), lengths, source)


def _batch_fn(cfg: TrainConfig, device: torch.device) -> tuple[Callable, Callable, Any]:
    """(rows, width) -> a micro-batch of random ids; the run's loss and count."""
    from gradstep_cli.run.components import loss_for

    vocab = quiet_hf_config(cfg).vocab_size if cfg.is_hf else GPTConfig.vocab_size
    gen = torch.Generator().manual_seed(0)

    def batch(rows: int, width: int) -> dict:
        ids = torch.randint(0, vocab, (rows, width), generator=gen)
        return {"input_ids": ids.to(device), "labels": ids.roll(-1, 1).to(device)}

    loss_fn, count = loss_for(cfg, device)
    return batch, loss_fn, count


def _probe(
    cfg: TrainConfig, device: torch.device, budget: int, data: _Data, checkpointing: bool
) -> tuple[ProbeResult, int]:
    """(the probe, the peak of building its model): steps at ``data.width``, then the
    shape sweep over the data's other lengths."""
    reset_peak(device)
    held = [_probe_model(cfg, device, checkpointing)]  # dropped before the run's own
    build_peak = peak_bytes(device)
    batch, loss_fn, count = _batch_fn(cfg, device)

    def step(rows: int, width: int) -> None:
        held[0].step([batch(rows, width)], loss_fn, count=count)

    widths = sweep_widths(cfg.seq_len, SWEEP_SHAPES, data.lengths)
    world = parallel.world_size()
    per_rank = math.ceil(cfg.global_batch / (world // cfg.tp))  # type: ignore[operator]
    try:
        result = probe_memory(
            lambda b: step(b, data.width),
            sorted({s for s in (1, 2, 4) if s <= per_rank}),
            device=device,
            # The plan's own bound: a run that plans itself peaks at least where the probe
            # did, and that too must leave the margin free.
            budget_bytes=int(budget * (1 - MARGIN)),
            agree=_every_rank if world > 1 else None,
            shapes=lambda i: step(1, widths[i % len(widths)]),
            max_shapes=len(widths),
        )
    finally:
        _release(held.pop())
        gc.collect()
    return result, build_peak


def _release(stepper: Stepper) -> None:
    """Let the probe's model go. Under DDP the Stepper's communication hook holds its
    strategy, which holds the model: a cycle through DDP's C++ reducer that Python's
    collector cannot see, so the probe's model, gradients and optimizer state would stay
    for the whole run. Cutting the strategy's reference frees them."""
    strategy = getattr(stepper, "_strategy", None)
    if strategy is not None and hasattr(strategy, "model"):
        strategy.model = None


def _probe_checkpointing(cfg: TrainConfig, device: torch.device, budget: int, width: int) -> bool:
    """Probe with checkpointing when the analytic model says one item does not fit the
    budget's usable part without it (the probe keeps the plan's bound too). Refuse at once,
    naming the budget needed, when the process alone already exceeds the budget or even
    the smallest plan is estimated above it (the probe itself would break it). Every rank
    decides the same (the worst rank's numbers count): they then probe together."""
    kwargs = estimate_kwargs(cfg, device, parallel.world_size())
    shape = shape_of(cfg, width)

    def est(ckpt: bool) -> int:
        fixed = _fixed_bytes(cfg, device)
        one = estimate_step_memory(
            shape, 1, activation_checkpointing=ckpt, fixed_bytes=fixed, **kwargs
        )
        return one.total

    in_use, smallest = current_bytes(device), est(True)
    usable = budget * (1 - MARGIN)  # what the probe may use, as the plan
    if not _every_rank(in_use <= usable and smallest <= budget):
        before = "already exceeded before probing" if in_use > budget else "too small"
        raise ConfigError(
            f"memory budget {format_bytes(budget)} is {before}: this process uses "
            f"{format_bytes(in_use)} before building the model, and the smallest plan "
            f"(micro-batch 1, activation checkpointing on) is estimated at "
            f"{format_bytes(smallest)} per rank: give --memory-budget "
            f"{budget_text(needed_budget(smallest, MARGIN))} or more"
        )
    return not _every_rank(est(False) <= usable)


def plan_run(
    cfg: TrainConfig, device: torch.device, probe: bool = True, source: Any = None
) -> Planned:
    """Plan ``cfg.global_batch`` for this device (collective under torchrun). An HF run's
    data (``source``, else loaded here) gives the rows' lengths."""
    if cfg.global_batch is None:
        raise ConfigError("planning needs --global-batch: the sequences per optimizer step")
    world = parallel.world_size()
    data_ranks = world // cfg.tp  # tensor-parallel peers share their micro-batches
    _settle_process(cfg, device)  # before the probe: it measures the settled process
    data = _data(cfg, source)  # held until planned: the probe's baseline holds it
    budget = device_budget(cfg, device)
    per_rank = math.ceil(cfg.global_batch / data_ranks)
    kwargs = estimate_kwargs(cfg, device, world)
    result, probe_ckpt, build_peak = None, False, 0
    if probe:
        probe_ckpt = _probe_checkpointing(cfg, device, budget, data.width)
        result, build_peak = _probe(cfg, device, budget, data, probe_ckpt)
    else:
        kwargs["fixed_bytes"] = _fixed_bytes(cfg, device)
    step_peak = step_predictor(
        shape_of(cfg, data.width),
        probe=result,
        probe_checkpointing=probe_ckpt,
        per_rank_batch=per_rank,
        **kwargs,
    )

    def predict(mbs: int, checkpointing: bool) -> int:
        return max(step_peak(mbs, checkpointing), build_peak)

    timed = result is not None and not result.one_size
    timer = probe_step_time(result, probe_checkpointing=probe_ckpt) if timed else None
    plan, error = None, None
    try:
        plan = plan_step(
            budget,
            cfg.global_batch,
            world_size=data_ranks,
            predict=predict,
            step_time=timer,
            margin=MARGIN,
        )
        plan.timed, plan.tp = timed, cfg.tp
        plan.probe_peak_bytes = result.highest_bytes if result is not None else 0
    except BudgetTooSmall as exc:
        error = f"--memory-budget: {exc}"
    # One plan (or one refusal) for every rank: rank 0's, from its probe.
    plan, error = parallel.broadcast_from_rank0((plan, error))
    if error is not None:
        raise ConfigError(error)
    return Planned(plan, result, build_peak, data.width)
