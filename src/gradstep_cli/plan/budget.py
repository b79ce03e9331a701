"""The memory budget of a run: what the device has, the process settings a prediction
relies on, and the analytic prediction of a fixed ``--micro-batch-size`` (no model built).

``--micro-batch-size auto`` plans against the same budget (:mod:`.planning`).
"""

from __future__ import annotations

import torch

from gradstep.memory import (
    available_bytes,
    bound_kernel_caches,
    budget_text,
    estimate_step_memory,
    format_bytes,
    needed_budget,
    parse_size,
    pin_mmap_threshold,
    runtime_bytes,
)
from gradstep_cli.config.settings import ConfigError, TrainConfig
from gradstep_cli.data.batching import Layout
from gradstep_cli.models.spec import ModelSpec
from gradstep_cli.plan.estimate import estimate_kwargs, model_shape

__all__ = [
    "MARGIN",
    "analytic_fixed_bytes",
    "budget_notes",
    "device_budget",
    "predict_fixed",
    "settle_process",
]

MARGIN = 0.1
"""Share of the budget the plan leaves free (prediction error, allocator slack)."""
CPU_KERNEL_CACHE_BYTES = 24 * 2**20
"""CPU, bf16/fp16: what oneDNN's kernel caches, bounded by ``bound_kernel_caches``, hold
beyond one input shape when full (two more shapes of the toy GPT, ~12 MiB each, torch
2.13): the analytic estimate's stand-in for the probe's shape sweep."""


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


def settle_process(cfg: TrainConfig, device: torch.device, planning: bool = False) -> None:
    """The process settings a memory budget's prediction relies on, before the run loads or
    builds anything: whenever a budget is given or planned for (``planning``: ``gradstep
    plan``), on CPU, pin glibc's mmap threshold (freed activations leave the process) and
    bound oneDNN's kernel caches (new sequence lengths cannot grow it for ever): on CPU the
    budget is the resident set, and both make it follow the live tensors."""
    budgeted = planning or cfg.memory_budget is not None or cfg.auto_micro_batch
    if budgeted and device.type == "cpu":
        pin_mmap_threshold()
        bound_kernel_caches()


def analytic_fixed_bytes(cfg: TrainConfig, device: torch.device) -> int:
    """The analytic estimate's fixed cost: the runtime now (+ the first steps' lazy costs)
    and, on CPU in low precision, the full kernel caches."""
    caches = CPU_KERNEL_CACHE_BYTES if device.type == "cpu" and cfg.precision != "fp32" else 0
    return runtime_bytes(device) + caches


def predict_fixed(model: ModelSpec, device: torch.device, world: int, layout: Layout) -> int:
    """Analytic peak per rank of the run's fixed micro-batch size (``layout``'s) on
    ``world`` launched ranks (cheap: no model built)."""
    cfg = model.cfg
    est = estimate_step_memory(
        model_shape(model),
        layout.micro_batch_size,
        activation_checkpointing=cfg.activation_checkpointing,
        accum_steps=layout.micro_batches,
        fixed_bytes=analytic_fixed_bytes(cfg, device),
        **estimate_kwargs(cfg, device, world),
    )
    return est.total


def budget_notes(model: ModelSpec, device: torch.device, world: int, layout: Layout) -> list[str]:
    """With a fixed ``--micro-batch-size`` the budget is not planned for, so the analytic
    prediction of the fixed choice is said, as a warning when it does not fit (``layout``:
    the run's, on ``world`` launched ranks); lines to print."""
    cfg = model.cfg
    if cfg.memory_budget is None or cfg.auto_micro_batch:
        return []
    budget = parse_size(cfg.memory_budget)
    try:
        peak = predict_fixed(model, device, world, layout)
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
