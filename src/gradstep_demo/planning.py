"""``--micro-batch-size auto`` and ``gradstep plan``: the demo model, probed and planned.

The probe builds a throwaway copy of the run's model (same layout, precision and sharding),
takes a real ``Stepper.step`` of one micro-batch at two or three sizes, and reads the peak
(``gradstep.memory.probe_memory``); the analytic model turns that into a prediction for
every candidate (micro-batch size x checkpointing). Rank 0's plan is every rank's.
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
    checkpoint_blocks,
    parse_size,
    pin_mmap_threshold,
    plan_step,
    probe_memory,
    probe_step_time,
    step_predictor,
)

from .config import ConfigError, TrainConfig
from .model import GPT, GPTConfig

__all__ = ["Planned", "device_budget", "plan_run", "prepare_process", "shape_of"]

_COMPUTE = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


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


def prepare_process(cfg: TrainConfig, device: torch.device) -> None:
    """The process settings a memory budget's prediction relies on, before the run builds
    anything (called by ``gradstep train`` for every run)."""
    if cfg.auto_micro_batch and device.type == "cpu":
        pin_mmap_threshold()


def _probe_model(cfg: TrainConfig, device: torch.device, checkpointing: bool) -> Stepper:
    model = GPT(
        GPTConfig(
            n_layer=cfg.n_layer, n_head=cfg.n_head, d_model=cfg.d_model, max_seq_len=cfg.seq_len
        )
    ).to(device)
    if checkpointing:
        checkpoint_blocks(model)
    model = parallel.prepare_model(model, cfg.strategy, cfg.precision)
    # lr 0: the probe's steps allocate the optimizer state, as the run's will, and change
    # nothing that matters (this model is thrown away).
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    return Stepper(model, opt, clip=None, precision=cfg.precision)


def _agree_min(fits: bool) -> bool:
    flag = torch.tensor([float(fits)], dtype=torch.float64)
    return bool(parallel.all_reduce_sum(flag).item() == parallel.world_size())


def plan_run(cfg: TrainConfig, device: torch.device, probe: bool = True) -> Planned:
    """Plan ``cfg.global_batch`` for this device (collective under torchrun)."""
    if cfg.global_batch is None:
        raise ConfigError("planning needs global_batch: the sequences per optimizer step")
    world = parallel.world_size()
    if device.type == "cpu":
        # Freed activations must leave the process (glibc would keep them), or the run's
        # resident peak would outgrow what was planned: on CPU the budget is the RSS.
        pin_mmap_threshold()
    budget = device_budget(cfg, device)
    per_rank = math.ceil(cfg.global_batch / world)
    shape = shape_of(cfg)
    kwargs = {
        "compute_dtype": _COMPUTE[cfg.precision],
        "world_size": world,
        "sharded": cfg.strategy == "fsdp",
        "optimizer": "adamw",
    }
    result = None
    if probe:
        stepper = _probe_model(cfg, device, False)
        gen = torch.Generator().manual_seed(0)

        def run(b: int) -> None:
            ids = torch.randint(0, shape.vocab_size, (b, cfg.seq_len), generator=gen)
            batch = {"input_ids": ids.to(device), "labels": ids.roll(-1, 1).to(device)}
            stepper.step([batch], _lm_loss)

        sizes = sorted({s for s in (1, 2, 4) if s <= per_rank})
        result = probe_memory(
            run, sizes, device=device, budget_bytes=budget, agree=_agree_min if world > 1 else None
        )
        del stepper, run
        gc.collect()
    predict = step_predictor(shape, probe=result, per_rank_batch=per_rank, **kwargs)
    timer = probe_step_time(result) if result is not None else None
    plan = plan_step(budget, cfg.global_batch, world_size=world, predict=predict, step_time=timer)
    plan = parallel.broadcast_from_rank0(plan)  # one plan for every rank
    return Planned(plan, result)


def _lm_loss(model: torch.nn.Module, batch: dict) -> object:
    from gradstep import token_loss

    return token_loss(model(batch["input_ids"]), batch["labels"])
