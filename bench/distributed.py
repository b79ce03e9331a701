"""Gradient sync on the last micro-batch only vs on every micro-batch: time and bytes.

2 ranks (gloo on CPU, started by the test suite's ``run_ranks``), the demo model (``GPTConfig()``
defaults, 1.8M parameters), k = 8 micro-batches of 4 random variable-length sequences
(-100 label padding, different on each rank) per optimizer step, ClipNorm(1.0) + AdamW,
for DDP and for FSDP2 (``fully_shard`` per block and at the root). For each strategy one
model and one Stepper alternate step by step between ``sync_each_micro_batch=False``
(a: the default, one gradient reduction per step) and ``True`` (b: one per micro-batch),
order alternating, so load on a shared machine hits both alike. Printed per strategy:
gradient collectives and bytes per optimizer step (counted by
``gradstep.parallel.instrumentation.count_gradient_comms``: a DDP comm hook / an FSDP2
reduce-scatter, input buffer sizes), and rank 0's median per-step wall time ratio b / a
with IQR and a bootstrap 95% interval. Never asserts on time.

    .venv/bin/python bench/distributed.py            # ~2-4 min on 2 shared CPU cores
    .venv/bin/python bench/distributed.py --pairs 3 --seq-len 64   # quicker
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import torch

import gradstep
import gradstep.parallel as gd
from _common import (
    BaseConfig,
    interleaved_times,
    lm_loss,
    lm_window,
    machine_info,
    random_rows,
    ratio_stats,
    run_ranks,
)
from gradstep.parallel.instrumentation import count_gradient_comms
from gradstep_demo.model import GPT, GPTConfig

WORLD = 2


@dataclass(frozen=True)
class BenchConfig(BaseConfig):
    micro_batches: int = 8
    micro_batch_size: int = 4
    seq_len: int = 128
    pairs: int = 5
    warmup: int = 1
    seed: int = 0

    POSITIVE = ("micro_batches", "micro_batch_size", "seq_len", "pairs")
    HELP = {
        "micro_batches": "k per rank",
        "pairs": "timed step pairs",
        "warmup": "untimed step pairs first",
    }

    def check(self) -> None:
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")


def _bench_strategy(strategy: str, cfg: BenchConfig, rank: int) -> dict:
    """One model, one Stepper; steps alternate between sync-last (a) and sync-each (b)."""
    torch.manual_seed(cfg.seed)
    model = gd.prepare_model(GPT(GPTConfig(max_seq_len=cfg.seq_len)), strategy)
    counter = count_gradient_comms(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stepper = gradstep.Stepper(model, opt, clip=gradstep.ClipNorm(1.0))
    comms: dict[bool, tuple[int, int]] = {}
    rows_per_window = cfg.micro_batches * cfg.micro_batch_size

    def run(sync_each: bool, i: int) -> None:
        rows = random_rows(rows_per_window, cfg.seq_len, seed=cfg.seed + 1000 * i + rank)
        stepper.sync_each_micro_batch = sync_each
        counter.reset()
        stepper.step(lm_window(rows, cfg.micro_batch_size), lm_loss)
        comms[sync_each] = (counter.calls, counter.bytes)

    times = interleaved_times(
        lambda i: run(False, i), lambda i: run(True, i), cfg.warmup, cfg.pairs
    )
    stats = ratio_stats(times.wall_b, times.wall_a)  # a = every micro-batch, b = last only
    return {
        "strategy": strategy,
        "params": sum(p.numel() for p in model.parameters()),
        "last": {"calls": comms[False][0], "bytes": comms[False][1]},
        "each": {"calls": comms[True][0], "bytes": comms[True][1]},
        "each_over_last": asdict(stats),
    }


def _bench_ranks(rank: int, world: int, cfg: BenchConfig) -> dict | None:
    """On each rank (the process group is up): both strategies; rank 0 returns the report."""
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    results = [_bench_strategy(s, cfg, rank) for s in ("ddp", "fsdp")]
    if rank != 0:
        return None
    info = {**machine_info(), "threads_per_rank": torch.get_num_threads()}
    return {"config": asdict(cfg), "machine": info, "results": results}


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def print_table(report: dict) -> None:
    cfg = report["config"]
    k = cfg["micro_batches"]
    print(
        f"\n2 ranks (gloo, CPU), k = {k} micro-batches of {cfg['micro_batch_size']} x <= "
        f"{cfg['seq_len']} tokens per rank, {report['results'][0]['params']:,} parameters, "
        f"{cfg['pairs']} timed step pairs, {report['machine']['threads_per_rank']} thread(s) "
        f"per rank, load {report['machine']['loadavg_1m']}\n"
    )
    print(
        "| strategy | gradient sync | collectives / step | bytes / step "
        "| median step (ms) | time vs sync on last |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for res in report["results"]:
        r = res["each_over_last"]
        kind = "all-reduce" if res["strategy"] == "ddp" else "reduce-scatter"
        last, each = res["last"], res["each"]
        print(
            f"| {res['strategy']} | last micro-batch (default) | {last['calls']} {kind} "
            f"| {_mib(last['bytes'])} | {r['median_b_ms']:.0f} | 1.00 |"
        )
        print(
            f"| {res['strategy']} | every micro-batch | {each['calls']} {kind} "
            f"| {_mib(each['bytes'])} | {r['median_a_ms']:.0f} | {r['median_ratio']:.2f} "
            f"(IQR {r['ratio_q1']:.2f}-{r['ratio_q3']:.2f}, 95% CI {r['ci95_low']:.2f}-"
            f"{r['ci95_high']:.2f}) |"
        )


def main(argv: list[str] | None = None) -> None:
    cfg, _ = BenchConfig.parse(argv, BenchConfig.parser(__doc__))
    # No time limit to speak of: the default sizes take minutes on 2 shared cores.
    report = run_ranks(_bench_ranks, WORLD, cfg, timeout=3 * 3600, collective_timeout_s=900)[0]
    print_table(report)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
