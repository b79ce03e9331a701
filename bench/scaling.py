"""How ``Stepper.step``'s cost over a hand-written loop grows with k, model size and world size.

For every configuration (model size x k micro-batches x world size) one model is built, deep
copied, and two steps alternate on the copies, order alternating (``interleaved_times``):
``Stepper.step`` (a) and the hand loop of ``bench/step_overhead.py`` (b: token-loss sum,
backward per micro-batch, divide by the window's token count, ``clip_grad_norm_``, AdamW).
Both see the same pre-built windows of k micro-batches of ``--micro-batch-size`` random
variable-length sequences (<= ``--seq-len`` tokens, -100 label padding). Sequences and
micro-batches are tiny on purpose: the step's fixed and per-micro-batch costs are what is
measured, and k = 256 stays affordable on 2 CPU cores.

World size 2: two gloo ranks on this machine (``run_ranks``, one start for all its
configurations), DDP (``gradstep.parallel.prepare_model``); the hand loop then skips the
gradient all-reduce on all but the last micro-batch (``no_sync``) and divides by the global
token count (one all-reduce up front); rank 0's times are reported.

Printed and written to ``bench/out/scaling.{md,json,png}``: per configuration the median
per-step ratio a / b with a bootstrap 95% interval (``ratio_stats``), by wall clock and by
process CPU time, and the per-micro-batch overhead (median of t_a - t_b) / k in us. The PNG
plots the wall-clock ratio against k, one line per model size and world size. Never asserts
on time.

    .venv/bin/python bench/scaling.py --quick 1     # small grid, < 2 min on 2 cores
    .venv/bin/python bench/scaling.py               # full grid, ~6-8 min on 2 cores
    .venv/bin/python bench/scaling.py --sizes 1m 10m --ks 1 16 256 --worlds 1
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gradstep
import gradstep.parallel as gd
from _common import (
    BaseConfig,
    Batch,
    count_items,
    interleaved_times,
    lm_loss,
    lm_window,
    machine_info,
    random_rows,
    ratio_stats,
    run_ranks,
)
from gradstep_cli.data.sources import IGNORE_INDEX
from gradstep_cli.models.gpt import GPT, GPTConfig
from step_overhead import hand_step, make_optimizer

OUT = Path(__file__).resolve().parent / "out"
WINDOW_POOL = 2  # distinct pre-built windows per k, cycled (batch building is not timed)

# Shapes giving ~1M, ~10M and ~100M parameters (byte vocabulary, tied head).
SIZES: dict[str, GPTConfig] = {
    "1m": GPTConfig(n_layer=4, n_head=4, d_model=144),
    "10m": GPTConfig(n_layer=6, n_head=6, d_model=384),
    "100m": GPTConfig(n_layer=12, n_head=8, d_model=832),
}


@dataclass(frozen=True)
class ScalingConfig(BaseConfig):
    quick: int = 0
    sizes: tuple[str, ...] = ("1m", "10m", "100m")
    ks: tuple[int, ...] = (1, 4, 16, 64, 256)
    worlds: tuple[int, ...] = (1, 2)
    max_work: float = 3e9
    pairs: int = 7
    warmup: int = 1
    micro_batch_size: int = 1
    seq_len: int = 8
    lr: float = 3e-3
    weight_decay: float = 0.1
    max_norm: float = 1.0
    seed: int = 0

    POSITIVE = ("pairs", "micro_batch_size", "seq_len", "max_work")
    HELP = {
        "quick": "1: a small grid (1m and 10m, k in 1 4 16, worlds 1 2; < 2 min)",
        "sizes": f"model sizes, of {', '.join(SIZES)}",
        "ks": "micro-batches per step",
        "worlds": "world sizes, of 1 2",
        "max_work": "skip configurations with parameters x k above this (the 100M model "
        "at large k takes minutes per step on 2 cores)",
        "pairs": "timed step pairs per configuration",
        "warmup": "untimed step pairs first",
    }

    def check(self) -> None:
        if self.pairs < 2 or self.warmup < 0:
            raise ValueError(f"--pairs must be >= 2 and --warmup >= 0, got {self.pairs}")
        if bad := [s for s in self.sizes if s not in SIZES]:
            raise ValueError(f"--sizes must be of {', '.join(SIZES)}, got {bad}")
        if bad_w := [w for w in self.worlds if w not in (1, 2)]:
            raise ValueError(f"--worlds must be 1 or 2, got {bad_w}")
        if min(self.ks) < 1:
            raise ValueError(f"--ks must be >= 1, got {self.ks}")
        if not 2 <= self.seq_len <= GPTConfig().max_seq_len:
            raise ValueError(f"--seq-len must be in [2, {GPTConfig().max_seq_len}]")

    def grid(self) -> list[tuple[str, int, int]]:
        """(size, k, world) to run, cheapest model first; skipped: params x k > max_work."""
        out = []
        for world in self.worlds:
            for size in self.sizes:
                for k in self.ks:
                    if n_params(size) * k <= self.max_work:
                        out.append((size, k, world))
        return out


def quick_config(cfg: ScalingConfig) -> ScalingConfig:
    return replace(cfg, sizes=("1m", "10m"), ks=(1, 4, 16), worlds=(1, 2), pairs=5, warmup=1)


_PARAMS: dict[str, int] = {}


def n_params(size: str) -> int:
    if size not in _PARAMS:
        with torch.device("meta"):
            _PARAMS[size] = sum(p.numel() for p in GPT(SIZES[size]).parameters())
    return _PARAMS[size]


# ----------------------------------------------------------------------------- the two steps


def hand_step_ddp(
    model: nn.Module, opt: torch.optim.Optimizer, window: list[Batch], max_norm: float
) -> None:
    """The hand loop under DDP: global token count up front, all-reduce on the last only.

    DDP averages gradients over ranks, so each rank scales its token-loss sum by
    ``world / global_items``: the applied gradient is the global token-mean's.
    """
    opt.zero_grad(set_to_none=True)
    items = torch.tensor([float(count_items(window))], dtype=torch.float64)
    dist.all_reduce(items)
    scale = dist.get_world_size() / float(items)
    for i, mb in enumerate(window):
        ctx = model.no_sync() if i < len(window) - 1 else contextlib.nullcontext()
        with ctx:
            logits = model(mb["input_ids"])
            loss = F.cross_entropy(
                logits.reshape(-1, logits.size(-1)),
                mb["labels"].reshape(-1),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
            (loss * scale).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()


def bench_one(size: str, k: int, cfg: ScalingConfig, rank: int, world: int) -> dict:
    """One configuration: build once, copy, interleave Stepper and hand-loop steps."""
    torch.manual_seed(cfg.seed)
    base = GPT(replace(SIZES[size], max_seq_len=max(cfg.seq_len, 16)))
    params = sum(p.numel() for p in base.parameters())
    model_a, model_b = base, copy.deepcopy(base)
    if world > 1:
        model_a, model_b = gd.prepare_model(model_a, "ddp"), gd.prepare_model(model_b, "ddp")
    opt_a, opt_b = make_optimizer(model_a, cfg), make_optimizer(model_b, cfg)  # type: ignore[arg-type]
    stepper = gradstep.Stepper(model_a, opt_a, clip=gradstep.ClipNorm(cfg.max_norm))
    rows = k * cfg.micro_batch_size
    pool = [
        lm_window(
            random_rows(rows, cfg.seq_len, seed=cfg.seed + 1 + i + 1000 * rank),
            cfg.micro_batch_size,
        )
        for i in range(WINDOW_POOL)
    ]
    hand = hand_step if world == 1 else hand_step_ddp

    def run_a(i: int) -> None:
        stepper.step(pool[i % WINDOW_POOL], lm_loss)

    def run_b(i: int) -> None:
        hand(model_b, opt_b, pool[i % WINDOW_POOL], cfg.max_norm)

    t0 = time.perf_counter()
    times = interleaved_times(run_a, run_b, cfg.warmup, cfg.pairs)
    wall = ratio_stats(times.wall_a, times.wall_b, seed=cfg.seed)
    cpu = ratio_stats(times.cpu_a, times.cpu_b, seed=cfg.seed)
    return {
        "size": size,
        "params": params,
        "k": k,
        "world": world,
        "threads": torch.get_num_threads(),
        "tokens_per_step": count_items(pool[0]),
        "wall": asdict(wall),
        "cpu": asdict(cpu),
        "overhead_us_per_micro_batch": wall.median_diff_ms * 1e3 / k,
        "cpu_overhead_us_per_micro_batch": cpu.median_diff_ms * 1e3 / k,
        "times": asdict(times),
        "seconds": time.perf_counter() - t0,
    }


def _threads(world: int) -> int:
    return max(1, (os.cpu_count() or 2) // world)


def ddp_same_math(rank: int, cfg: ScalingConfig, steps: int = 3) -> float:
    """Largest relative parameter difference, Stepper vs ``hand_step_ddp``, after ``steps``
    float64 steps of the 1m model on k = 4: the two sides do the same math (~1e-15)."""
    torch.manual_seed(cfg.seed)
    base = GPT(replace(SIZES["1m"], max_seq_len=max(cfg.seq_len, 16))).double()
    a = gd.prepare_model(copy.deepcopy(base), "ddp")
    b = gd.prepare_model(copy.deepcopy(base), "ddp")
    opt_a, opt_b = make_optimizer(a, cfg), make_optimizer(b, cfg)  # type: ignore[arg-type]
    stepper = gradstep.Stepper(a, opt_a, clip=gradstep.ClipNorm(cfg.max_norm))
    for i in range(steps):
        rows = random_rows(
            4 * cfg.micro_batch_size, cfg.seq_len, seed=cfg.seed + 50 + i + 1000 * rank
        )
        window = lm_window(rows, cfg.micro_batch_size)
        stepper.step(window, lm_loss)
        hand_step_ddp(b, opt_b, window, cfg.max_norm)
    return max(
        float((pa - pb).detach().norm() / pb.detach().norm())
        for pa, pb in zip(a.parameters(), b.parameters(), strict=True)
    )


def _bench_ranks(rank: int, world: int, cfg: ScalingConfig, grid: list) -> list[dict] | None:
    """On each rank (process group up): every world-size-2 configuration; rank 0 reports."""
    torch.set_num_threads(_threads(world))
    diff = ddp_same_math(rank, cfg)
    if rank == 0:
        print(f"  same math under DDP: max rel. parameter difference {diff:.1e}", file=sys.stderr)
    results = []
    for size, k, _ in grid:
        results.append(bench_one(size, k, cfg, rank, world))
        if rank == 0:
            _progress(results[-1])
    return results if rank == 0 else None


def _progress(r: dict) -> None:
    print(
        f"  {r['size']:>4} k={r['k']:<3} world={r['world']}: ratio {r['wall']['median_ratio']:.3f}"
        f" ({r['seconds']:.0f} s)",
        file=sys.stderr,
        flush=True,
    )


def run_grid(cfg: ScalingConfig) -> list[dict]:
    grid = cfg.grid()
    results = []
    torch.set_num_threads(_threads(1))
    for size, k, world in grid:
        if world == 1:
            results.append(bench_one(size, k, cfg, 0, 1))
            _progress(results[-1])
    multi = [g for g in grid if g[2] == 2]
    if multi:
        results += run_ranks(
            _bench_ranks, 2, cfg, multi, timeout=3 * 3600, collective_timeout_s=900
        )[0]
    return results


# ----------------------------------------------------------------------------- report


def table(results: list[dict], cfg: ScalingConfig, machine: dict) -> str:
    lines = [
        "## Stepper.step vs hand-written loop: scaling with k, model size, world size\n",
        f"micro-batches of {cfg.micro_batch_size} x <= {cfg.seq_len} tokens, ClipNorm("
        f"{cfg.max_norm}) + AdamW, fp32, {cfg.pairs} interleaved pairs after {cfg.warmup} "
        f"warm-up per configuration; world 2 = 2 gloo ranks (DDP), rank 0's times; "
        f"{machine['cpus']} CPUs, load avg 1m {machine['loadavg_1m']}\n",
        "| config | params | k | world | Stepper (ms) | hand (ms) | ratio (wall) | 95% CI "
        "| overhead (us / micro-batch) | ratio (CPU) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        w, c = r["wall"], r["cpu"]
        lines.append(
            f"| {r['size']} | {r['params'] / 1e6:.1f}M | {r['k']} | {r['world']} "
            f"| {w['median_a_ms']:.1f} | {w['median_b_ms']:.1f} | **{w['median_ratio']:.3f}** "
            f"| {w['ci95_low']:.3f}-{w['ci95_high']:.3f} "
            f"| {r['overhead_us_per_micro_batch']:+.0f} | {c['median_ratio']:.3f} |"
        )
    skipped = [f"{s} k={k}" for s in cfg.sizes for k in cfg.ks if n_params(s) * k > cfg.max_work]
    if skipped:
        lines.append(f"\nskipped (params x k > --max-work {cfg.max_work:g}): {', '.join(skipped)}")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = sorted(
        {(r["size"], r["world"]) for r in results}, key=lambda t: (t[1], n_params(t[0]))
    )
    for size, world in series:
        rs = sorted(
            (r for r in results if (r["size"], r["world"]) == (size, world)), key=lambda r: r["k"]
        )
        ks = [r["k"] for r in rs]
        med = [r["wall"]["median_ratio"] for r in rs]
        err = [
            [m - r["wall"]["ci95_low"] for m, r in zip(med, rs, strict=True)],
            [r["wall"]["ci95_high"] - m for m, r in zip(med, rs, strict=True)],
        ]
        ax.errorbar(
            ks,
            med,
            yerr=err,
            marker="o" if world == 1 else "s",
            linestyle="-" if world == 1 else "--",
            capsize=3,
            label=f"{size} ({n_params(size) / 1e6:.1f}M), world {world}",
        )
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k (micro-batches per step)")
    ax.set_ylabel("median step time ratio Stepper / hand loop (wall)")
    ax.set_title("Stepper.step overhead vs k (bootstrap 95% CI)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    cfg, _ = ScalingConfig.parse(argv, ScalingConfig.parser(__doc__))
    if cfg.quick:
        cfg = quick_config(cfg)
    machine = machine_info()
    print("machine:", machine, file=sys.stderr)
    t0 = time.perf_counter()
    results = run_grid(cfg)
    machine["loadavg_1m_after"] = machine_info()["loadavg_1m"]
    md = table(results, cfg, machine)
    print(md)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "scaling.md").write_text(md + "\n")
    report = {"config": asdict(cfg), "machine": machine, "results": results}
    (OUT / "scaling.json").write_text(json.dumps(report, indent=2))
    plot(results, OUT / "scaling.png")
    print(f"wrote {OUT / 'scaling.md'}, scaling.json, scaling.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
