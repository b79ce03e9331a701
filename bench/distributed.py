"""Gradient sync across ranks, and the layouts of FSDP2 on 1-D and 2-D meshes.

**Default: sync on the last micro-batch only vs on every micro-batch, time and bytes.**
2 ranks (gloo on CPU, started by the test suite's ``run_ranks``), the demo model (``GPTConfig()``
defaults, 1.27M parameters), k = 8 micro-batches of 4 random variable-length sequences
(-100 label padding, different on each rank) per optimizer step, ClipNorm(1.0) + AdamW,
for DDP and for FSDP2 (``fully_shard`` per block and at the root). For each strategy one
model and one Stepper alternate step by step between ``sync_each_micro_batch=False``
(a: the default, one gradient reduction per step) and ``True`` (b: one per micro-batch),
order alternating, so load on a shared machine hits both alike. Printed per strategy:
gradient collectives and bytes per optimizer step (counted by
``gradstep.parallel.instrumentation.count_gradient_comms``: a DDP comm hook / an FSDP2
reduce-scatter, input buffer sizes), and rank 0's median per-step wall time ratio b / a
with IQR and a bootstrap 95% interval. Never asserts on time.

**``--layouts [NAME ...]``: FSDP2 (1-D, 4 ranks), HSDP (replicate 2 x shard 2) and FSDP2 +
tensor parallel (dp 2 x tp 2)** on the demo GPT, ``Stepper.step`` against a hand-written
loop taking the same exact step (the rank side, and what is measured:
``bench/distributed_2d.py``; the collective census: ``bench/_census.py``). Printed and
written to ``bench/out/distributed_layouts.{md,json}``: every collective of a steady-state
step by issuer, kind and process group with its bytes; parameter, gradient and AdamW bytes
per rank and the process's peak RSS over the first steps; the median per-pair step-time
ratio gradstep / hand loop (the slowest rank's wall time, each step from a barrier; and
all ranks' CPU time). Exit status 1 when the two sides' first steps differ by more than
``distributed_2d.SAME_STEP_TOL``.

    .venv/bin/python bench/distributed.py            # ~2-4 min on 2 shared CPU cores
    .venv/bin/python bench/distributed.py --pairs 3 --seq-len 64   # quicker
    .venv/bin/python bench/distributed.py --layouts  # all three layouts, ~2 min
    .venv/bin/python bench/distributed.py --layouts fsdp_tp --pairs 4   # quicker
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch

import distributed_2d as d2
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
    write_outputs,
)
from gradstep.parallel.instrumentation import count_gradient_comms
from gradstep_cli.models.gpt import GPT, GPTConfig

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


# ----------------------------------------------------------------------------- --layouts

SIDES = ("gradstep", "hand loop")


def _calls(res: dict) -> dict:
    """A layout's census without bytes (activation sizes follow each data rank's rows)."""
    keys = ("issuer", "kind", "group", "small", "hidden", "calls")
    return {
        side: sorted(tuple(r[k] for k in keys) for r in rows)
        for side, rows in res["census"].items()
    }


def aggregate(jobs: list[list[dict]], cfg: d2.LayoutsConfig, machine: dict) -> dict:
    """One report from one job per layout: rank 0's census (and whether every rank issued
    the same calls), the timings (already over every rank), memory as the max over ranks."""
    layouts = []
    for per_rank in jobs:
        res = per_rank[0]
        mem = {k: max(x["memory"][k] for x in per_rank) for k in res["memory"]}
        same = all(_calls(x) == _calls(res) for x in per_rank)
        layouts.append({**res, "memory": mem, "same_calls_on_every_rank": same})
    warnings = sorted(
        {(r["layout"], *w) for job in jobs for r in job for w in r["dtensor_warnings"]}
    )
    return {"config": asdict(cfg), "machine": machine, "layouts": layouts, "warnings": warnings}


def _size(n: int) -> str:
    return f"{n} B" if n < 4096 else f"{n / 2**20:.2f} MiB"


def _census_rows(res: dict) -> list[tuple[tuple, dict[str, dict]]]:
    """(issuer, collective, group) -> each side's row, in the order backend, tp, own."""
    rows: dict[tuple, dict[str, dict]] = {}
    for side, found in res["census"].items():
        for row in found:
            notes = [
                n for n, on in (("small", row["small"]), ("in DTensor op", row["hidden"])) if on
            ]
            kind = row["kind"] + (f" ({', '.join(notes)})" if notes else "")
            rows.setdefault((row["issuer"], kind, row["group"]), {})[side] = row
    order = ("fsdp2", "tp", *SIDES)
    return sorted(rows.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1], kv[0][2]))


def census_table(report: dict) -> list[str]:
    lines = [
        "| layout | issuer | collective | ranks in group | gradstep: calls | bytes "
        "| hand loop: calls | bytes |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for res in report["layouts"]:
        for (issuer, kind, group), sides in _census_rows(res):
            cells = [
                f"{s['calls']} | {_size(s['bytes'])}" if s else "- | -"
                for s in (sides.get(side) for side in SIDES)
            ]
            lead = f"| {res['layout']} | {issuer} | {kind} | {group} | "
            lines.append(lead + " | ".join(cells) + " |")
    return lines


def memory_table(report: dict) -> list[str]:
    lines = [
        "| layout | parameters | gradients | AdamW state | sum | RSS, models built "
        "| peak RSS in 3 steps of each side | peak - built |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for res in report["layouts"]:
        m = res["memory"]
        total = m["params"] + m["grads"] + m["optimizer"]
        lines.append(
            f"| {res['layout']} | {_size(m['params'])} | {_size(m['grads'])} | "
            f"{_size(m['optimizer'])} | {_size(total)} | {_size(m['rss_built'])} | "
            f"{_size(m['peak'])} | {_size(m['peak'] - m['rss_built'])} |"
        )
    return lines


def time_table(report: dict) -> list[str]:
    lines = [
        "| layout | same step: grad / norm rel. diff (norm) | median step ms, gradstep / hand "
        "| time gradstep / hand loop | CPU time, all ranks |",
        "|---|---|---:|---:|---:|",
    ]
    for res in report["layouts"]:
        same = res["same_step"]
        agree = f"{same['grad_rel']:.1e} / {same['norm_rel']:.1e} ({same['norm']:.2f})"
        if "time" not in res:
            lines.append(f"| {res['layout']} | {agree} | - | not timed | - |")
            continue
        t, c = res["time"], res["cpu_time"]
        lines.append(
            f"| {res['layout']} | {agree} | {t['median_a_ms']:.0f} / {t['median_b_ms']:.0f} | "
            f"{t['median_ratio']:.2f} (IQR {t['ratio_q1']:.2f}-{t['ratio_q3']:.2f}, 95% CI "
            f"{t['ci95_low']:.2f}-{t['ci95_high']:.2f}) | {c['median_ratio']:.2f} |"
        )
    return lines


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def render_layouts(report: dict) -> str:
    cfg, m = report["config"], report["machine"]
    same = all(r["same_calls_on_every_rank"] for r in report["layouts"])
    head = (
        f"{d2.WORLD} ranks (gloo, CPU, 1 thread each), demo GPT "
        f"({report['layouts'][0]['memory']['n_params']:,} parameters), k = "
        f"{cfg['micro_batches']} micro-batches of {cfg['micro_batch_size']} x <= "
        f"{cfg['seq_len']} tokens per data rank, ClipNorm({cfg['max_norm']}) + AdamW, "
        f"{cfg['pairs']} timed pairs; load {m['loadavg_start']} -> {m['loadavg_1m']}; "
        f"{m['wall_s']:.0f} s"
    )
    parts = [
        head, "",
        f"Collectives per optimizer step, rank 0 (same calls on every rank: {_yes(same)}):",
        "", *census_table(report), "",
        "Memory per rank (local shards, max over ranks):", "", *memory_table(report), "",
        "Step time (slowest rank, each step from a barrier):", "", *time_table(report), "",
    ]  # fmt: skip
    parts += [f"DTensor warning ({lay}, {side}): {msg}" for lay, side, msg in report["warnings"]]
    return "\n".join(parts)


def layouts_main(argv: list[str]) -> int:
    """``--layouts [NAME ...]``: every layout when no name follows."""
    i = argv.index("--layouts")
    if i + 1 == len(argv) or argv[i + 1].startswith("-"):
        argv = [*argv[: i + 1], *d2.LAYOUTS, *argv[i + 1 :]]
    cfg, _ = d2.LayoutsConfig.parse(argv, d2.LayoutsConfig.parser(__doc__))
    start, t0 = machine_info()["loadavg_1m"], time.perf_counter()
    jobs = [
        run_ranks(d2.layout_ranks, d2.WORLD, cfg, name, timeout=1800, collective_timeout_s=900)
        for name in cfg.layouts
    ]
    machine = {**machine_info(), "loadavg_start": start, "wall_s": time.perf_counter() - t0}
    report = aggregate(jobs, cfg, machine)
    write_outputs("distributed_layouts", render_layouts(report), report)
    tol = d2.SAME_STEP_TOL
    apart = [
        r["layout"]
        for r in report["layouts"]
        if max(r["same_step"]["grad_rel"], r["same_step"]["norm_rel"]) > tol
    ]
    if apart:
        print(f"FAILED: gradstep and the hand loop took different steps on {apart} (> {tol})")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--layouts" in argv:
        return layouts_main(argv)
    cfg, _ = BenchConfig.parse(argv, BenchConfig.parser(__doc__))
    # No time limit to speak of: the default sizes take minutes on 2 shared cores.
    report = run_ranks(_bench_ranks, WORLD, cfg, timeout=3 * 3600, collective_timeout_s=900)[0]
    print_table(report)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
