"""Predicted vs measured peak memory of a full ``Stepper.step`` of the demo GPT, on CPU.

For every configuration (precision, sequence length, micro-batch size, checkpointing, 1
process or FSDP2 on 2 gloo ranks) a FRESH process builds the model, takes ``--steps``
optimizer steps of ``accum`` micro-batches of random full-length token rows, and reports
its peak RSS (VmHWM, reset after the model is built; FSDP2: the larger of the two ranks).
Each peak is compared with two predictions:

* analytic: ``estimate_step_memory`` from the shapes, plus ``runtime_bytes()`` read in that
  process after its imports and before the model exists (RSS so far + the calibrated
  cost of the first steps' code pages and caches);
* probe: ``probe_memory`` in another fresh process (one ``Stepper.step`` of one micro-batch
  at sizes 1, 2, 4, checkpointing off), turned into a prediction for the configuration by
  ``step_predictor`` (analytic difference for checkpointing and accumulation).

Every process pins glibc's mmap threshold (``pin_mmap_threshold``) so RSS follows the live
tensors; ``--default-malloc 1`` measures every configuration once more without it, to show
what glibc's arena retention adds. Then: the probe's cost in seconds, activation
checkpointing's step-time ratio (interleaved on/off steps in one process, median of
pairs), and a planner check: ``plan_step`` for budgets derived from the probe, the chosen
plan run in a fresh process, measured peak <= budget asserted (exit status 1 otherwise).

``--part held-out`` (``memory_held_out.py``) runs ``gradstep train --micro-batch-size auto``
on ten configurations nobody tuned for (bf16 at micro-batch 1 on variable-length data,
dropout, LAMB, DDP and FSDP2 on 2 ranks), and each plan again by hand, under an independent
sampler of the resident memory: predicted vs measured, and whether the budget held.

    .venv/bin/python bench/memory.py              # everything (~12 min on 2 cores)
    .venv/bin/python bench/memory.py --part held-out   # the held-out table (~7 min)
    .venv/bin/python bench/memory.py --part hf   # HF models (bench/memory_hf.py, ~20 min)
    .venv/bin/python bench/memory.py --part model --quick 1  # 5 configurations, no extras
    .venv/bin/python bench/memory.py --plot-only 1  # redraw docs/memory.png from the JSON
Outputs: markdown tables on stdout, bench/out/memory.json, bench/out/memory_held_out.json,
docs/memory.png (quick runs: bench/out/memory_quick.json and .png, so that only a full run
documents the results). Exit status 1 when a run went over its budget.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

import gradstep
from _common import (
    BaseConfig,
    interleaved_times,
    lm_loss,
    machine_info,
    ratio_stats,
    run_in_subprocess,
    run_ranks,
)
from gradstep import memory as gm
from gradstep.memory import checkpoint_blocks
from gradstep_cli.models.gpt import GPT, GPTConfig
from gradstep_cli.plan.estimate import gpt_shape
from memory_held_out import held_out, print_held_out

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out" / "memory.json"
PNG = ROOT / "docs" / "memory.png"
QUICK_OUT = ROOT / "bench" / "out" / "memory_quick.json"
HELD_OUT_JSON = ROOT / "bench" / "out" / "memory_held_out.json"
GOAL = 0.15
MiB = 2**20
DTYPES = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, torch.bfloat16)}
DTYPES["amp"] = (torch.float32, torch.bfloat16)  # fp32 parameters, bf16 autocast


@dataclass(frozen=True)
class Case:
    name: str
    precision: str
    """fp32; bf16 (bf16 parameters, fp32 accumulation buffers); amp (fp32 + bf16 autocast)."""
    seq_len: int
    mbs: int
    items: int
    """Items per rank per optimizer step: accum = ceil(items / mbs), last one shorter."""
    ckpt: bool = False
    world: int = 1

    @property
    def accum(self) -> int:
        return math.ceil(self.items / self.mbs)

    @property
    def group(self) -> str:
        """Configurations that share one probe (it runs with checkpointing off)."""
        return f"{self.precision}-s{self.seq_len}-w{self.world}"


CASES = [
    Case("fp32 s256 b4x2", "fp32", 256, 4, 8),
    Case("fp32 s256 b16x2", "fp32", 256, 16, 32),
    Case("fp32 s256 b32x2", "fp32", 256, 32, 64),
    Case("fp32 s128 b16x2", "fp32", 128, 16, 32),
    Case("fp32 s256 b8x2 ckpt", "fp32", 256, 8, 16, ckpt=True),
    Case("fp32 s256 b32x2 ckpt", "fp32", 256, 32, 64, ckpt=True),
    Case("bf16 s128 b8x2", "bf16", 128, 8, 16),
    Case("bf16 s128 b16x2 ckpt", "bf16", 128, 16, 32, ckpt=True),
    Case("amp s128 b8x2", "amp", 128, 8, 16),
    Case("fsdp2x2 fp32 s256 b8x2", "fp32", 256, 8, 16, world=2),
    Case("fsdp2x2 fp32 s256 b16x2 ckpt", "fp32", 256, 16, 32, ckpt=True, world=2),
]
QUICK = {"fp32 s256 b4x2", "fp32 s256 b32x2", "fp32 s256 b8x2 ckpt", "bf16 s128 b8x2"}
QUICK |= {"fsdp2x2 fp32 s256 b8x2"}


@dataclass(frozen=True)
class BenchConfig(BaseConfig):
    quick: int = 0
    steps: int = 2
    threads: int = 2
    probe_sizes: tuple[int, ...] = (1, 2, 4)
    default_malloc: int = 1
    pairs: int = 7
    timing_threads: int = 1
    plan_global_batch: int = 64
    plan_headroom: tuple[int, ...] = (12, 2)
    margin: float = 0.1
    seed: int = 0
    plot_only: int = 0
    part: str = "all"
    only: str = ""
    by_hand: int = 1
    calibrate: int = 0
    sample_ms: float = 2.0

    POSITIVE = ("steps", "threads", "pairs", "plan_global_batch", "timing_threads")
    HELP = {
        "quick": "1: 5 configurations, no default-malloc column, 3 timing pairs",
        "steps": "optimizer steps per measured configuration",
        "default_malloc": "1: also measure every configuration with glibc's default malloc",
        "pairs": "interleaved checkpointing on/off step pairs",
        "timing_threads": "torch threads of the timing process (1: no OpenMP barrier waits "
        "on a shared machine)",
        "plot_only": "1: only redraw docs/memory.png from bench/out/memory.json",
        "plan_headroom": "planner budgets: (probe fixed + N items) / (1 - margin), for each N",
        "part": "all; model (the Stepper-level table, probe cost, planner check); held-out "
        "(gradstep train --micro-batch-size auto on configurations nobody tuned for); hf "
        "(the same for Hugging Face models, bench/memory_hf.py; not part of all)",
        "only": "held-out, hf: run only these, comma-separated first words (e.g. C4,C6)",
        "by_hand": "held-out: 1 also runs each plan's choice given by hand (same budget)",
        "calibrate": "held-out: 1 derives each budget from a plan first (else the stored ones)",
        "sample_ms": "held-out: the RSS sampler's interval",
    }

    def check(self) -> None:
        if self.part not in ("all", "model", "held-out", "hf"):
            raise ValueError(f"--part must be all, model, held-out or hf, got {self.part!r}")


# ----------------------------------------------------------------------------- in a process


def _estimate_kwargs(case: Case) -> dict:
    param, compute = DTYPES[case.precision]
    sharded = case.world > 1
    return {
        "param_dtype": param,
        "compute_dtype": compute,
        "world_size": case.world,
        "sharded": sharded,
    }


def _build(case: Case, seed: int, fsdp: bool) -> gradstep.Stepper:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(max_seq_len=case.seq_len)).to(DTYPES[case.precision][0])
    if case.ckpt:
        checkpoint_blocks(model)
    if fsdp:
        import gradstep.parallel as gd

        model = gd.prepare_model(model, "fsdp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return gradstep.Stepper(model, opt, precision="fp32" if case.precision == "fp32" else "bf16")


def _window(case: Case, sizes: list[int], seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, 256, (m, case.seq_len + 1), generator=gen) for m in sizes]
    return [{"input_ids": r[:, :-1], "labels": r[:, 1:]} for r in rows]


def _sizes(case: Case) -> list[int]:
    return [case.mbs] * (case.accum - 1) + [case.items - (case.accum - 1) * case.mbs]


def _measure(case: Case, cfg: dict, rank: int = 0) -> dict:
    """Peak RSS of ``steps`` full steps in this (fresh) process, and the runtime before it."""
    pinned = gm.pin_mmap_threshold() if cfg["pinned"] else False
    runtime = gm.runtime_bytes()
    stepper = _build(case, cfg["seed"], case.world > 1)
    window = _window(case, _sizes(case), cfg["seed"] + 1 + rank)
    source = gm.reset_peak()
    times = []
    for _ in range(cfg["steps"]):
        start = time.perf_counter()
        stepper.step(window, lm_loss)
        times.append(time.perf_counter() - start)
    return {
        "peak": gm.peak_bytes(),
        "runtime": runtime,
        "source": source,
        "pinned": pinned,
        "step_s": times,
    }


def _probe(case: Case, cfg: dict, rank: int = 0) -> dict:
    gm.pin_mmap_threshold()
    stepper = _build(case, cfg["seed"], case.world > 1)
    windows = {b: _window(case, [b], cfg["seed"] + 10 * b + rank) for b in cfg["sizes"]}
    res = gm.probe_memory(lambda b: stepper.step(windows[b], lm_loss), cfg["sizes"], device="cpu")
    return asdict(res)


def _ranks(rank: int, world: int, kind: str, case: Case, cfg: dict) -> dict:
    return (_measure if kind == "measure" else _probe)(case, cfg, rank)


def child(kind: str, payload: dict) -> dict:
    """Entry point of a fresh process: one measurement, one probe, or the timing."""
    cfg = payload["cfg"]
    torch.set_num_threads(cfg["threads"])
    if kind == "timing":
        return _timing(Case(**payload["case"]), cfg)
    case = Case(**payload["case"])
    if case.world == 1:
        return (_measure if kind == "measure" else _probe)(case, cfg)
    results = run_ranks(_ranks, case.world, kind, case, cfg, timeout=900)
    if kind == "probe":
        return results[0]
    worst = max(results, key=lambda r: r["peak"])
    return {**worst, "ranks": [r["peak"] for r in results]}


def _timing(case: Case, cfg: dict) -> dict:
    """Checkpointing on vs off: two models from one init, interleaved steps, same window."""
    steppers = {ck: _build(replace(case, ckpt=ck), cfg["seed"], False) for ck in (True, False)}
    window = _window(case, _sizes(case), cfg["seed"] + 1)
    times = interleaved_times(
        lambda i: steppers[True].step(window, lm_loss),
        lambda i: steppers[False].step(window, lm_loss),
        warmup=1,
        pairs=cfg["pairs"],
    )
    return {
        "wall": asdict(ratio_stats(times.wall_a, times.wall_b)),
        "cpu": asdict(ratio_stats(times.cpu_a, times.cpu_b)),
    }


# ----------------------------------------------------------------------------- orchestration


def run_child(kind: str, case: Case, cfg: dict) -> dict:
    payload = json.dumps({"case": asdict(case), "cfg": cfg})
    return run_in_subprocess(__file__, ["--child", kind, payload])


def predictions(case: Case, measured: dict, probe: dict | None) -> dict:
    shape = gpt_shape(GPTConfig(), case.seq_len)
    kwargs = _estimate_kwargs(case)
    est = gm.estimate_step_memory(
        shape,
        case.mbs,
        activation_checkpointing=case.ckpt,
        accum_steps=case.accum,
        fixed_bytes=measured["runtime"],
        **kwargs,
    )
    out = {"analytic": est.total, "estimate": est.as_dict()}
    if probe is not None:
        res = gm.ProbeResult(**{**probe, "points": [tuple(p) for p in probe["points"]]})
        predict = gm.step_predictor(shape, probe=res, per_rank_batch=case.items, **kwargs)
        out["probe"] = predict(case.mbs, case.ckpt)
    return out


def measure_all(cases: list[Case], bench: BenchConfig) -> tuple[list[dict], dict]:
    cfg = _cfg(bench)
    probes: dict[str, dict] = {}
    for case in cases:
        if case.group not in probes:
            probes[case.group] = run_child("probe", replace(case, ckpt=False), cfg)
            print(f"probe {case.group}: {_probe_line(probes[case.group])}", file=sys.stderr)
    rows = []
    for case in cases:
        measured = run_child("measure", case, cfg)
        row = {
            "case": asdict(case),
            "name": case.name,
            "measured": measured["peak"],
            "runtime": measured["runtime"],
            "step_s": measured["step_s"],
        }
        row.update(predictions(case, measured, probes[case.group]))
        if bench.default_malloc and not bench.quick:
            row["measured_default_malloc"] = run_child("measure", case, {**cfg, "pinned": False})[
                "peak"
            ]
        print(f"{case.name}: {_row_line(row)}", file=sys.stderr)
        rows.append(row)
    return rows, probes


def _probe_line(p: dict) -> str:
    pts = ", ".join(f"b={b}: {gm.format_bytes(pk)}" for b, pk, _ in p["points"])
    return (
        f"fixed {gm.format_bytes(p['fixed_bytes'])} + {gm.format_bytes(p['per_item_bytes'])}"
        f"/item [{pts}] in {p['seconds_total']:.1f}s"
    )


def _err(pred: float, meas: float) -> float:
    return pred / meas - 1


def _row_line(r: dict) -> str:
    return (
        f"measured {gm.format_bytes(r['measured'])}, analytic {gm.format_bytes(r['analytic'])} "
        f"({_err(r['analytic'], r['measured']):+.1%}), probe {gm.format_bytes(r['probe'])} "
        f"({_err(r['probe'], r['measured']):+.1%})"
    )


def planner_check(bench: BenchConfig, probes: dict, ckpt_ratio: float) -> list[dict]:
    """Plan for budgets derived from the fp32 s256 probe; run each chosen plan; check it."""
    base = Case("plan", "fp32", 256, 1, bench.plan_global_batch)
    probe = probes.get(base.group) or run_child("probe", base, _cfg(bench))
    res = gm.ProbeResult(**{**probe, "points": [tuple(p) for p in probe["points"]]})
    shape = gpt_shape(GPTConfig(), base.seq_len)
    predict = gm.step_predictor(shape, probe=res, per_rank_batch=base.items)
    timer = gm.probe_step_time(res, checkpoint_factor=ckpt_ratio)
    checks = []
    for headroom in bench.plan_headroom:
        # Usable (after the margin) = probe's fixed cost + ``headroom`` items' worth.
        usable = res.fixed_bytes + headroom * res.per_item_bytes
        budget = math.ceil(usable / (1 - bench.margin) / MiB) * MiB
        plan = gm.plan_step(
            budget, base.items, predict=predict, step_time=timer, margin=bench.margin
        )
        case = replace(
            base,
            name=f"plan {headroom}",
            mbs=plan.micro_batch_size,
            ckpt=plan.activation_checkpointing,
        )
        measured = run_child("measure", case, _cfg(bench))["peak"]
        checks.append(
            {
                "budget": budget,
                "plan": plan.to_json(),
                "table": plan.table(),
                "measured": measured,
                "ok": measured <= budget,
            }
        )
    return checks


def _cfg(bench: BenchConfig) -> dict:
    return {
        "steps": bench.steps,
        "threads": bench.threads,
        "seed": bench.seed,
        "pinned": True,
        "sizes": list(bench.probe_sizes),
        "pairs": bench.pairs,
    }


# ----------------------------------------------------------------------------- report


def print_report(rows: list[dict], probes: dict, timing: dict, checks: list[dict]) -> None:
    extra = any("measured_default_malloc" in r for r in rows)
    print("\n## Peak memory of a full Stepper.step: predicted vs measured (CPU RSS)\n")
    head = "| configuration | accum | measured | analytic | error | probe | error |"
    print(head + (" default glibc | retention |" if extra else ""))
    print("|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if extra else ""))
    for r in rows:
        m = r["measured"]
        line = (
            f"| {r['name']} | {r['case']['items'] // r['case']['mbs']} | {gm.format_bytes(m)} "
            f"| {gm.format_bytes(r['analytic'])} | {_err(r['analytic'], m):+.1%} "
            f"| {gm.format_bytes(r['probe'])} | {_err(r['probe'], m):+.1%} |"
        )
        if extra:
            d = r["measured_default_malloc"]
            line += f" {gm.format_bytes(d)} | {d / m - 1:+.0%} |"
        print(line)
    worst_a = max(abs(_err(r["analytic"], r["measured"])) for r in rows)
    worst_p = max(abs(_err(r["probe"], r["measured"])) for r in rows)
    print(
        f"\nworst |error|: analytic {worst_a:.1%}, probe {worst_p:.1%} (goal {GOAL:.0%}: "
        f"{'met' if max(worst_a, worst_p) <= GOAL else 'MISSED'})"
    )
    print("\n## Probe cost (1 Stepper.step per size, each size warmed up once first)\n")
    print("| probe | sizes | fixed | per item | seconds |\n|---|---|---:|---:|---:|")
    for group, p in probes.items():
        sizes = ",".join(str(b) for b, _, _ in p["points"])
        print(
            f"| {group} | {sizes} | {gm.format_bytes(p['fixed_bytes'])} "
            f"| {gm.format_bytes(p['per_item_bytes'])} | {p['seconds_total']:.2f} |"
        )
    for clock in ("wall", "cpu"):
        t = timing[clock]
        print(
            f"\nactivation checkpointing step time / off ({clock}, {t['pairs']} interleaved "
            f"pairs): median {t['median_ratio']:.3f} (IQR {t['ratio_q1']:.3f}-{t['ratio_q3']:.3f},"
            f" 95% CI {t['ci95_low']:.3f}-{t['ci95_high']:.3f}; {t['median_b_ms']:.0f} ms off)"
        )
    print(
        f"\nplanner's checkpointing time factor: {timing['factor_used']:.3f} (the wall median "
        "ratio, or the default when below 1)"
    )
    print("\n## Planner check\n")
    for c in checks:
        verdict = "OK" if c["ok"] else "OVER BUDGET"
        print(c["table"])
        print(
            f"measured peak of the chosen plan: {gm.format_bytes(c['measured'])} <= budget "
            f"{gm.format_bytes(c['budget'])}: {verdict}\n"
        )


def plot(rows: list[dict], path: Path) -> None:
    """Left: predicted vs measured with the ±15% band; right: the error of every row."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 5.5))
    ax, ax_err = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.1]})
    meas = [r["measured"] / MiB for r in rows]
    line = [min(meas) * 0.85, max(meas) * 1.15]
    ax.plot(line, line, color="black", lw=1, label="predicted = measured")
    band = ([x * (1 - GOAL) for x in line], [x * (1 + GOAL) for x in line])
    ax.fill_between(line, *band, color="tab:green", alpha=0.15, label=f"±{GOAL:.0%}")
    for key, marker in (("analytic", "o"), ("probe", "x")):
        ax.scatter(meas, [r[key] / MiB for r in rows], marker=marker, s=40, label=key)
    ax.set(
        xlim=line,
        ylim=line,
        xlabel="measured peak per device (MiB, CPU VmHWM)",
        ylabel="predicted peak (MiB)",
        title="demo GPT, full Stepper.step, fresh process each",
    )
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    ys = list(range(len(rows)))[::-1]
    ax_err.axvspan(-GOAL * 100, GOAL * 100, color="tab:green", alpha=0.15)
    ax_err.axvline(0, color="black", lw=1)
    for key, marker in (("analytic", "o"), ("probe", "x")):
        errs = [_err(r[key], r["measured"]) * 100 for r in rows]
        ax_err.scatter(errs, ys, marker=marker, s=40, label=key)
    ax_err.set_yticks(ys, [r["name"] for r in rows], fontsize=8)
    ax_err.set(xlabel="prediction error vs measured (%)", title="error per configuration")
    ax_err.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = BenchConfig.parser(__doc__)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    bench, ns = BenchConfig.parse(argv, ap)
    if ns.child:
        print(json.dumps(child(ns.child[0], json.loads(ns.child[1]))))
        return 0
    if bench.plot_only:
        plot(json.loads(OUT.read_text())["rows"], PNG)
        return 0
    if bench.quick:
        bench = replace(bench, pairs=min(bench.pairs, 3), default_malloc=0)
    # Children inherit it: OpenMP threads that spin while waiting distort timings (and CPU
    # times) on a shared machine, as in the test suite's command line.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    start = time.perf_counter()
    ok = True
    if bench.part == "hf":
        from memory_hf import main as hf_main

        hf_args = ["--only", bench.only, "--calibrate", str(bench.calibrate)]
        hf_args += ["--by-hand", str(bench.by_hand), "--sample-ms", str(bench.sample_ms)]
        return hf_main(hf_args)
    if bench.part in ("all", "held-out"):
        rows = held_out(bench.only, bool(bench.calibrate), bool(bench.by_hand), bench.sample_ms)
        print_held_out(rows)
        ok = all("error" not in r and r["measured"] <= r["budget"] for r in rows)
        out = (
            HELD_OUT_JSON
            if not bench.only
            else HELD_OUT_JSON.with_name("memory_held_out_some.json")
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"config": asdict(bench), "machine": machine_info(), "rows": rows,
                                   "seconds": time.perf_counter() - start}, indent=1))  # fmt: skip
        print(f"held-out: {time.perf_counter() - start:.0f}s; wrote {out.relative_to(ROOT)}")
    if bench.part in ("all", "model"):
        ok = model_part(bench) and ok
    return 0 if ok else 1


def model_part(bench: BenchConfig) -> bool:
    """The Stepper-level table (predicted vs measured), the probe's cost, checkpointing's
    time ratio and the planner check."""
    cases = [c for c in CASES if not bench.quick or c.name in QUICK]
    start = time.perf_counter()
    rows, probes = measure_all(cases, bench)
    timing_cfg = {**_cfg(bench), "threads": bench.timing_threads}
    timing = run_child("timing", Case("timing", "fp32", 256, 8, 16), timing_cfg)
    # Checkpointing does strictly more work: a ratio below 1 is a disturbed measurement.
    ratio = timing["wall"]["median_ratio"]
    factor = ratio if ratio >= 1 else gm.plan.CHECKPOINT_FACTOR
    timing["factor_used"] = factor
    checks = planner_check(bench, probes, factor)
    print_report(rows, probes, timing, checks)
    out = {
        "config": asdict(bench),
        "machine": machine_info(),
        "rows": rows,
        "probes": probes,
        "timing": timing,
        "planner": checks,
        "seconds": time.perf_counter() - start,
    }
    # Only a full run documents the results; a quick one stays under bench/out/.
    out_json, png = (OUT, PNG) if not bench.quick else (QUICK_OUT, QUICK_OUT.with_suffix(".png"))
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(out, indent=1))
    plot(rows, png)
    wrote = " and ".join(str(p.relative_to(ROOT)) for p in (out_json, png))
    print(f"total {out['seconds']:.0f}s; wrote {wrote}")
    return all(c["ok"] for c in checks)


if __name__ == "__main__":
    sys.exit(main())
