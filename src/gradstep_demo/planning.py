"""``--micro-batch-size auto`` and ``gradstep plan``: the demo model, probed and planned.

The probe builds a throwaway copy of the run's model (same layout, dropout, precision,
sharding and optimizer), takes a real ``Stepper.step`` of one micro-batch at two or three
sizes, then at a few more sequence lengths until the kernel caches are full, and reads the
peak (``gradstep.memory.probe_memory``); the analytic model turns that into a prediction
for every candidate (micro-batch size x checkpointing). Rank 0's plan is every rank's.
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from gradstep import Stepper, parallel
from gradstep.memory import (
    Plan,
    ProbeResult,
    TransformerShape,
    bound_kernel_caches,
    checkpoint_blocks,
    current_bytes,
    estimate_step_memory,
    format_bytes,
    parse_size,
    pin_mmap_threshold,
    plan_step,
    probe_memory,
    probe_step_time,
    runtime_bytes,
    step_predictor,
)
from gradstep.memory.plan import BudgetTooSmall, budget_text, needed_budget

from .config import ConfigError, TrainConfig
from .model import GPT, GPTConfig

__all__ = [
    "Planned",
    "device_budget",
    "estimate_kwargs",
    "plan_run",
    "predict_fixed",
    "prepare_process",
    "shape_of",
]

_COMPUTE = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
_OPTIMIZER = {"adamw": "adamw", "sgd": "sgd_momentum", "lars": "lars", "lamb": "lamb"}
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

    def to_json(self) -> dict:
        out = self.plan.to_json()
        if self.probe is not None:
            out["probe"] = {
                "fixed_bytes": self.probe.fixed_bytes,
                "per_item_bytes": self.probe.per_item_bytes,
                "shape_bytes": self.probe.shape_bytes,
                "one_size": self.probe.one_size,
                "seconds": self.probe.seconds_total,
                "source": self.probe.source,
            }
        return out


def shape_of(cfg: TrainConfig) -> TransformerShape:
    return TransformerShape(
        n_layer=cfg.n_layer,
        d_model=cfg.d_model,
        n_head=cfg.n_head,
        vocab_size=GPTConfig.vocab_size,
        seq_len=cfg.seq_len,
    )


def estimate_kwargs(cfg: TrainConfig, device: torch.device, world: int) -> dict:
    """What the analytic model needs besides the shape: precision, sharding, optimizer,
    dropout (on CPU with dropout torch's attention takes the math path: s^2 matrices)."""
    return {
        "compute_dtype": _COMPUTE[cfg.precision],
        "world_size": world,
        "sharded": cfg.strategy == "fsdp",
        "optimizer": _OPTIMIZER.get(cfg.optimizer, "adamw"),
        "dropout": cfg.dropout,
        "attention": "math" if cfg.dropout > 0 and device.type == "cpu" else "fused",
    }


def device_budget(cfg: TrainConfig, device: torch.device) -> int:
    """``--memory-budget``, else what this device has free (CUDA: free device memory; CPU:
    available memory plus what this process already holds)."""
    if cfg.memory_budget is not None:
        return parse_size(cfg.memory_budget)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_allocated(device))
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        status = dict(
            line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines()
        )
        available = int(fields["MemAvailable"].split()[0]) + int(status["VmRSS"].split()[0])
        return available * 1024
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
    """Analytic peak per rank of the run's fixed micro-batch size (cheap: no model built)."""
    from .batching import layout_for

    layout = layout_for(cfg, world)
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
    if cfg.is_hf:
        return [
            f"--memory-budget {format_bytes(budget)} is not checked for {cfg.model}: the "
            "memory model covers the demo GPT only"
        ]
    peak = predict_fixed(cfg, device, parallel.world_size())
    said = (
        f"--micro-batch-size {cfg.micro_batch_size} is predicted to peak at "
        f"{format_bytes(peak)} per rank (analytic estimate)"
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
    from .train import build_optimizer  # the run's param groups; train imports this module

    model = GPT(
        GPTConfig(
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            d_model=cfg.d_model,
            max_seq_len=cfg.seq_len,
            dropout=cfg.dropout,
        )
    ).to(device)
    if checkpointing:
        checkpoint_blocks(model)
    model = parallel.prepare_model(model, cfg.strategy, cfg.precision)
    return Stepper(model, build_optimizer(model, cfg), clip=None, precision=cfg.precision)


def _agree_min(fits: bool) -> bool:
    flag = torch.tensor([float(fits)], dtype=torch.float64)
    return bool(parallel.all_reduce_sum(flag).item() == parallel.world_size())


def _sweep_widths(seq_len: int, n: int) -> list[int]:
    """``n`` distinct sequence lengths below ``seq_len``, spread over its range (the data
    yields any length from 1 to ``seq_len``)."""
    widths = sorted({max(1, seq_len * (k + 1) // (n + 1)) for k in range(n)} - {seq_len})
    return widths or [seq_len]


def _probe(
    cfg: TrainConfig, device: torch.device, budget: int, per_rank: int, checkpointing: bool
) -> ProbeResult:
    held = [_probe_model(cfg, device, checkpointing)]  # dropped before the run builds its own
    gen = torch.Generator().manual_seed(0)
    vocab = GPTConfig.vocab_size

    def step(rows: int, width: int) -> None:
        ids = torch.randint(0, vocab, (rows, width), generator=gen)
        batch = {"input_ids": ids.to(device), "labels": ids.roll(-1, 1).to(device)}
        held[0].step([batch], _lm_loss)

    widths = _sweep_widths(cfg.seq_len, SWEEP_SHAPES)
    world = parallel.world_size()
    try:
        return probe_memory(
            lambda b: step(b, cfg.seq_len),
            sorted({s for s in (1, 2, 4) if s <= per_rank}),
            device=device,
            budget_bytes=budget,
            agree=_agree_min if world > 1 else None,
            shapes=lambda i: step(1, widths[i % len(widths)]),
            max_shapes=len(widths),
        )
    finally:
        held.clear()
        gc.collect()


def _probe_checkpointing(cfg: TrainConfig, device: torch.device, budget: int) -> bool:
    """Probe with checkpointing when the analytic model says one item does not fit the
    budget without it but does with it (the probe keeps the budget too). Refuse at once,
    naming the budget needed, when the process alone already exceeds the budget or even
    the smallest plan is estimated above it (the probe itself would break it). Every rank
    decides the same (the worst rank's numbers count): they then probe together."""
    world = parallel.world_size()
    kwargs = estimate_kwargs(cfg, device, world)
    every = _agree_min if world > 1 else (lambda flag: flag)

    def est(ckpt: bool) -> int:
        fixed = _fixed_bytes(cfg, device)
        one = estimate_step_memory(
            shape_of(cfg), 1, activation_checkpointing=ckpt, fixed_bytes=fixed, **kwargs
        )
        return one.total

    in_use, smallest = current_bytes(device), est(True)
    if not every(in_use <= budget and smallest <= budget):
        before = "already exceeded before probing" if in_use > budget else "too small"
        raise ConfigError(
            f"memory budget {format_bytes(budget)} is {before}: this process uses "
            f"{format_bytes(in_use)} before building the model, and the smallest plan "
            f"(micro-batch 1, activation checkpointing on) is estimated at "
            f"{format_bytes(smallest)} per rank: give --memory-budget "
            f"{budget_text(needed_budget(smallest, MARGIN))} or more"
        )
    return not every(est(False) <= budget)


def plan_run(cfg: TrainConfig, device: torch.device, probe: bool = True) -> Planned:
    """Plan ``cfg.global_batch`` for this device (collective under torchrun)."""
    if cfg.global_batch is None:
        raise ConfigError("planning needs --global-batch: the sequences per optimizer step")
    world = parallel.world_size()
    _settle_process(cfg, device)  # before the probe: it measures the settled process
    budget = device_budget(cfg, device)
    per_rank = math.ceil(cfg.global_batch / world)
    kwargs = estimate_kwargs(cfg, device, world)
    result, probe_ckpt = None, False
    if probe:
        probe_ckpt = _probe_checkpointing(cfg, device, budget)
        result = _probe(cfg, device, budget, per_rank, probe_ckpt)
    else:
        kwargs["fixed_bytes"] = _fixed_bytes(cfg, device)
    predict = step_predictor(
        shape_of(cfg),
        probe=result,
        probe_checkpointing=probe_ckpt,
        per_rank_batch=per_rank,
        **kwargs,
    )
    timed = result is not None and not result.one_size
    timer = probe_step_time(result, probe_checkpointing=probe_ckpt) if timed else None
    plan, error = None, None
    try:
        plan = plan_step(
            budget,
            cfg.global_batch,
            world_size=world,
            predict=predict,
            step_time=timer,
            margin=MARGIN,
        )
        plan.timed = timed
    except BudgetTooSmall as exc:
        error = f"--memory-budget: {exc}"
    # One plan (or one refusal) for every rank: rank 0's, from its probe.
    plan, error = parallel.broadcast_from_rank0((plan, error))
    if error is not None:
        raise ConfigError(error)
    return Planned(plan, result)


def _lm_loss(model: torch.nn.Module, batch: dict) -> object:
    from gradstep import token_loss

    return token_loss(model(batch["input_ids"]), batch["labels"])
