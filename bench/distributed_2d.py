"""Rank side of ``bench/distributed.py --layouts``: FSDP2 on 1-D and 2-D meshes.

4 ranks (gloo on CPU, started by the test suite's ``run_ranks``), the demo GPT
(``GPTConfig`` defaults but ``max_seq_len``: 4 blocks, d_model 160, 4 heads, tied head,
1.27M parameters), laid out by ``gradstep.parallel.prepare_model(model, "fsdp", ...)``:

- ``fsdp``: FSDP2 over all 4 ranks (a 1-D mesh);
- ``hsdp``: HSDP, ``layout=Layout(dp_replicate=2)`` (dp_replicate 2 x dp_shard 2);
- ``fsdp_tp``: FSDP2 + tensor parallel, ``layout=Layout(tp=2)`` with
  ``gradstep_cli.models.parallel_plan.gpt_tp_plan()`` (dp_shard 2 x tp 2; the tp peers of a
  data rank read the same micro-batches).

Each data rank steps k micro-batches of random variable-length rows (-100 label padding,
different token counts per data rank), ClipNorm + AdamW. Per layout two models from one
seed take the same steps on the same windows: ``Stepper.step`` (a) and a hand-written loop
(b) doing the same exact step (no gradient sync but on the last micro-batch; loss sum x
dp size / the token count all-reduced over dp before the window; the norm computed the
torch way, ``get_total_norm`` per device mesh, made whole and combined; the clip;
``opt.step``). On every rank:

1. the first step's applied gradients and pre-clip norms of both sides, compared;
2. every collective of one steady-state step of each side (``_census.Census``);
3. this rank's parameter, gradient (when the optimizer steps) and AdamW state bytes (local
   shards); the process's RSS once both sides' models are built, and its peak (VmHWM)
   over the first 3 steps of each side (each layout runs in a fresh job: the peak holds
   the interpreter and torch, both models, AdamW state, FSDP2's unsharded parameters,
   activations, and what the allocator keeps);
4. for the layouts in ``--timed``: ``--pairs`` step pairs after ``--warmup``, each step
   from a barrier, order alternating; the slowest rank's wall time and all ranks' CPU time.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gradstep
import gradstep.parallel as gd
from _census import Census, DTensorWarnings, census_rows
from _common import (
    BaseConfig,
    Batch,
    PairedTimes,
    count_items,
    lm_loss,
    lm_window,
    random_rows,
    ratio_stats,
)
from gradstep.memory import current_bytes, peak_bytes, reset_peak
from gradstep_cli.data.sources import IGNORE_INDEX
from gradstep_cli.models.gpt import GPT, GPTConfig

WORLD = 4
LAYOUTS = ("fsdp", "hsdp", "fsdp_tp")
SAME_STEP_TOL = 1e-5
"""float32: the two sides' applied gradients (max abs difference over max abs) and
pre-clip norms (relative) must agree this closely, or the bench reports a failure."""
# The step's own collectives, told apart by the first frame outside torch.
OWN = {os.path.dirname(gradstep.__file__) + os.sep: "gradstep", __file__: "hand loop"}


@dataclass(frozen=True)
class LayoutsConfig(BaseConfig):
    micro_batches: int = 4
    micro_batch_size: int = 2
    seq_len: int = 64
    pairs: int = 12
    warmup: int = 1
    max_norm: float = 0.5
    lr: float = 1e-3
    seed: int = 0
    layouts: tuple[str, ...] = LAYOUTS
    timed: tuple[str, ...] = LAYOUTS

    POSITIVE = ("micro_batches", "micro_batch_size", "seq_len", "pairs")
    HELP = {
        "micro_batches": "k per data rank",
        "pairs": "timed step pairs per layout",
        "warmup": "untimed step pairs before them",
        "max_norm": "ClipNorm's threshold (below every norm here: the clip acts)",
        "layouts": f"the layouts measured: {', '.join(LAYOUTS)}",
        "timed": "of those, the layouts also timed against the hand loop",
    }

    def check(self) -> None:
        if self.warmup < 0 or self.pairs < 2 or self.max_norm <= 0:
            raise ValueError("--warmup must be >= 0, --pairs >= 2 and --max-norm > 0")
        for flag_, names in (("--layouts", self.layouts), ("--timed", self.timed)):
            bad = [n for n in names if n not in LAYOUTS]
            if bad:
                raise ValueError(f"{flag_}: unknown {bad}; choose from {', '.join(LAYOUTS)}")
        if not 2 <= self.seq_len <= GPTConfig().max_seq_len:
            raise ValueError(f"--seq-len must be in [2, {GPTConfig().max_seq_len}]")


# ----------------------------------------------------------------------------- the two steps


def build(layout: str, cfg: LayoutsConfig) -> nn.Module:
    from gradstep_cli.models.parallel_plan import gpt_tp_plan

    torch.manual_seed(cfg.seed)
    kw: dict[str, Any] = {
        "hsdp": {"layout": gd.Layout(dp_replicate=2)},
        "fsdp_tp": {"layout": gd.Layout(tp=2), "tp_plan": gpt_tp_plan()},
    }
    return gd.prepare_model(GPT(GPTConfig(max_seq_len=cfg.seq_len)), "fsdp", **kw.get(layout, {}))


def dp_of(model: nn.Module) -> tuple[Any, int]:
    """(the data-parallel group, its size): the world, or the dp dim of a (dp_shard, tp)
    mesh."""
    for p in model.parameters():
        names = getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or ()
        if "tp" in names:
            dp = p.device_mesh["dp_shard"]
            return dp.get_group(), dp.size()
    return None, dist.get_world_size()


def hand_norm(grads: list[torch.Tensor]) -> float:
    """The global 2-norm the way a user writes it: torch's norm per device mesh (DTensors on
    different meshes cannot be stacked), each made whole, combined."""
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(getattr(g, "device_mesh", None), []).append(g)
    total = 0.0
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, 2.0)
        total += float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm) ** 2
    return total**0.5


def hand_step(model: nn.Module, opt: Any, window: list[Batch], max_norm: float) -> float:
    """One exact step without gradstep; returns the pre-clip norm."""
    group, dp_size = dp_of(model)
    items = torch.tensor([float(count_items(window))], dtype=torch.float64)
    dist.all_reduce(items, group=group)
    scale = dp_size / float(items)  # FSDP2 averages over dp: undo it, divide by the count
    for i, mb in enumerate(window):
        model.set_requires_gradient_sync(i == len(window) - 1)  # type: ignore[operator]
        logits = model(mb["input_ids"])
        loss = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)), mb["labels"].reshape(-1),
            ignore_index=IGNORE_INDEX, reduction="sum",
        )  # fmt: skip
        (loss * scale).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = hand_norm(grads)
    coef = min(1.0, max_norm / (norm + 1e-6))
    if coef < 1.0:
        torch._foreach_mul_(grads, coef)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return norm


def local_bytes(tensors: Any) -> int:
    return sum(gd.dtensor.to_local(t).numel() * t.element_size() for t in tensors)


class Applied:
    """The gradients an optimizer is about to apply, and their bytes on this rank."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.grads: list[torch.Tensor] | None = None
        self.bytes = 0
        self._handle = opt.register_step_pre_hook(self._record)

    def _record(self, opt: torch.optim.Optimizer, *_: object) -> None:
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        self.grads = [gd.dtensor.to_local(g).detach().clone() for g in grads]
        self.bytes = local_bytes(grads)
        self._handle.remove()


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def same_step(a: Applied, b: Applied, norms: tuple[float, float]) -> dict[str, float]:
    """How far apart the two sides' first steps are (max over ranks)."""
    diff = max(float((x - y).abs().max()) for x, y in zip(a.grads, b.grads, strict=True))
    scale = max(float(x.abs().max()) for x in a.grads)
    return {
        "grad_rel": _max_over_ranks(diff) / _max_over_ranks(scale),
        "norm_rel": _max_over_ranks(abs(norms[0] - norms[1]) / norms[1]),
        "norm": norms[0],
    }


# ----------------------------------------------------------------------------- one layout


def windows(cfg: LayoutsConfig, data_rank: int, n: int = 4) -> list[list[Batch]]:
    """``n`` windows of ``data_rank`` (the tp peers of a data rank read the same rows)."""
    rows = cfg.micro_batches * cfg.micro_batch_size
    return [
        lm_window(
            random_rows(rows, cfg.seq_len, seed=cfg.seed + 1000 * i + data_rank),
            cfg.micro_batch_size,
        )
        for i in range(n)
    ]


def _timed(run: Callable[[int], object], i: int) -> tuple[float, float]:
    """One step from a barrier: (the slowest rank's wall seconds, CPU seconds of all ranks)."""
    dist.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    run(i)
    wall = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu)
    return float(wall), float(cpu)


def paired_times(
    run_a: Callable[[int], object], run_b: Callable[[int], object], warmup: int, pairs: int
) -> PairedTimes:
    """``_common.interleaved_times`` on every rank at once: each step starts from a barrier
    (a rank still finishing the previous step's last collective or descheduled by the
    machine's load does not count against the next step), order alternating."""
    out = PairedTimes()
    sides = ((run_a, out.wall_a, out.cpu_a), (run_b, out.wall_b, out.cpu_b))
    for i in range(warmup + pairs):
        for run, wall, cpu in sides if i % 2 == 0 else sides[::-1]:
            w, c = _timed(run, i)
            if i >= warmup:
                wall.append(w)
                cpu.append(c)
    return out


def run_layout(layout: str, cfg: LayoutsConfig, rank: int, warned: DTensorWarnings) -> dict:
    """Both sides of one layout on this rank: same step, census, memory, (time)."""
    models = [build(layout, cfg) for _ in range(2)]
    opts = [torch.optim.AdamW(m.parameters(), lr=cfg.lr) for m in models]
    stepper = gradstep.Stepper(models[0], opts[0], clip=gradstep.ClipNorm(cfg.max_norm))
    pool = windows(cfg, rank // (2 if layout == "fsdp_tp" else 1))

    def side_a(i: int) -> float:
        warned.side = "gradstep"
        return stepper.step(pool[i % len(pool)], lm_loss).grad_norm

    def side_b(i: int) -> float:
        warned.side = "hand loop"
        return hand_step(models[1], opts[1], pool[i % len(pool)], cfg.max_norm)

    gc.collect()
    built = current_bytes()
    reset_peak()
    applied = [Applied(o) for o in opts]
    out: dict[str, Any] = {"layout": layout, "census": {}}
    out["same_step"] = same_step(*applied, (side_a(0), side_b(0)))
    for name, side in (("gradstep", side_a), ("hand loop", side_b)):
        with Census(OWN) as census:
            side(1)
        out["census"][name] = census_rows(census.calls)
    side_a(2)
    side_b(2)
    out["memory"] = {
        "params": local_bytes(models[0].parameters()),
        "grads": applied[0].bytes,
        "optimizer": local_bytes(t for s in opts[0].state.values() for t in s.values()),
        "rss_built": built,
        "peak": peak_bytes(),
        "n_params": sum(p.numel() for p in models[0].parameters()),
    }
    if layout in cfg.timed:  # windows 3, 4, ...: the same on both sides
        times = paired_times(
            lambda i: side_a(3 + i), lambda i: side_b(3 + i), cfg.warmup, cfg.pairs
        )
        out["time"] = asdict(ratio_stats(times.wall_a, times.wall_b))
        out["cpu_time"] = asdict(ratio_stats(times.cpu_a, times.cpu_b))
    return out


def layout_ranks(rank: int, world: int, cfg: LayoutsConfig, layout: str) -> dict:
    """On each rank of a fresh job (the process group is up): one layout, so that the
    process's peak RSS and DTensor's once-per-mesh warnings are that layout's own."""
    torch.set_num_threads(1)
    warned = DTensorWarnings()
    result = run_layout(layout, cfg, rank, warned)
    return {**result, "rank": rank, "dtensor_warnings": sorted(set(warned.seen))}
