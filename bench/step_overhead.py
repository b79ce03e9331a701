"""What ``gradstep.Stepper.step`` costs over a hand-written PyTorch loop, and peak memory.

Timing: the demo model (``GPTConfig()`` defaults, 1.8M parameters), one optimizer step =
8 micro-batches of 4 random variable-length sequences (-100 label padding) + ClipNorm(1.0)
+ AdamW, through ``Stepper.step`` (a) and through a minimal hand-written loop doing the same
math (b). Both run on deep copies of one initialisation, interleaved step by step in one
process (order alternating), on the same pre-built batches. Printed: median per-step ratio
a / b, ratio of medians, IQR, bootstrap 95% interval of the median, by wall clock and by
process CPU time (robust to other processes on a shared machine). A same-math check runs
first: in fp64 both sides must agree on the applied gradient, loss, norm and parameters to
1e-10 (exit status 1 otherwise).

Memory: peak RSS (VmHWM) of a fresh subprocess per case after a few steps: 8 x micro-batch
4 accumulated, one micro-batch of 4, one batch of 32 (the same 32 seeded rows), the same
8 x 4 through the hand-written loop, a 16-token step (fixed cost of training) and a
baseline process that only imports torch and builds the model.

    .venv/bin/python bench/step_overhead.py                # everything (~4 min, 2 cores)
    .venv/bin/python bench/step_overhead.py --skip-memory  # timing only
    .venv/bin/python bench/step_overhead.py --profile 10   # + op-level diff of both sides
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import json
import pstats
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import gradstep
from _common import (
    BaseConfig,
    Batch,
    RatioStats,
    count_items,
    interleaved_times,
    lm_loss,
    lm_window,
    machine_info,
    random_rows,
    ratio_stats,
    rel_err,
    run_in_subprocess,
)
from gradstep.metrics import peak_memory
from gradstep_cli.data.sources import IGNORE_INDEX
from gradstep_cli.models.gpt import GPT, GPTConfig

TARGET_RATIO = 1.03
# Same-math check: fp64 agreement (gradient, loss, norm, parameters) and fp32 gradient.
FP64_TOL = 1e-10
FP32_GRAD_TOL = 1e-5
WINDOW_POOL = 4  # distinct pre-built windows, cycled (batch building is not timed)


@dataclass(frozen=True)
class MemoryCase:
    micro_batches: int
    micro_batch_size: int
    what: str
    seq_len: int | None = None
    """Cap on the sequence length (None: --memory-seq-len)."""
    hand: bool = False
    """Run the hand-written loop instead of the Stepper."""


# The same 32 seeded rows feed every case (mb4 = the first 4, batch32 = all of them).
MEMORY_CASES: dict[str, MemoryCase] = {
    "baseline": MemoryCase(0, 0, "import torch, build model and data; no step"),
    "floor": MemoryCase(1, 1, "1 sequence of 16 tokens: grads, AdamW state, runtime", 16),
    "mb4": MemoryCase(1, 4, "1 micro-batch of 4"),
    "accum8x4": MemoryCase(8, 4, "8 micro-batches of 4 accumulated"),
    "accum8x4-hand": MemoryCase(8, 4, "same, hand-written loop instead of Stepper", hand=True),
    "batch32": MemoryCase(1, 32, "1 batch of 32"),
}


@dataclass(frozen=True)
class BenchConfig(BaseConfig):
    pairs: int = 30
    warmup: int = 3
    micro_batches: int = 8
    micro_batch_size: int = 4
    seq_len: int = 128
    memory_seq_len: int = 256
    memory_steps: int = 3
    threads: int = 1
    lr: float = 3e-3
    weight_decay: float = 0.1
    max_norm: float = 1.0
    seed: int = 0
    profile: int = 0

    POSITIVE = ("pairs", "micro_batches", "micro_batch_size", "threads")
    HELP = {
        "pairs": "timed step pairs",
        "warmup": "untimed step pairs first",
        "seq_len": "max tokens, timing",
        "threads": "torch.set_num_threads",
        "profile": "profile N steps each",
    }

    def check(self) -> None:
        if self.pairs < 5:
            raise ValueError(f"--pairs must be >= 5 for a meaningful median, got {self.pairs}")
        if self.warmup < 0 or self.memory_steps < 1 or self.profile < 0:
            raise ValueError("--warmup and --profile must be >= 0, --memory-steps >= 1")
        limit = GPTConfig().max_seq_len
        for name in ("seq_len", "memory_seq_len"):
            if not 2 <= getattr(self, name) <= limit:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be in [2, {limit}] (the demo model's "
                    f"max_seq_len), got {getattr(self, name)}"
                )


# ----------------------------------------------------------------------------- the two steps


def build_model(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig())


def make_optimizer(model: nn.Module, cfg: BenchConfig) -> torch.optim.AdamW:
    # Same settings on both sides; foreach left at its default.
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


def stepper_step(stepper: gradstep.Stepper, window: list[Batch]) -> tuple[float, float]:
    stats = stepper.step(window, lm_loss)
    return stats.loss, stats.grad_norm


def hand_step(
    model: nn.Module, opt: torch.optim.Optimizer, window: list[Batch], max_norm: float
) -> tuple[float, float]:
    """The minimal correct loop: token-sum loss / window token count, clip, AdamW."""
    opt.zero_grad(set_to_none=True)
    items = count_items(window)
    loss_sum = torch.zeros((), dtype=torch.float64)
    for mb in window:
        logits = model(mb["input_ids"])
        loss = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)),
            mb["labels"].reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        loss_sum += loss.detach()
        (loss / items).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()
    return float(loss_sum) / items, float(norm)


@torch.no_grad()
def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    return max(
        float((pa - pb).abs().max()) for pa, pb in zip(a.parameters(), b.parameters(), strict=True)
    )


# ----------------------------------------------------------------------------- timing


def build_pool(cfg: BenchConfig) -> list[list[Batch]]:
    n_rows = cfg.micro_batches * cfg.micro_batch_size
    return [
        lm_window(random_rows(n_rows, cfg.seq_len, seed=cfg.seed + 1 + i), cfg.micro_batch_size)
        for i in range(WINDOW_POOL)
    ]


def _capture_grads(opt: torch.optim.Optimizer, into: list[list[torch.Tensor]]) -> None:
    """Record the gradient the optimizer is about to apply (normalised and clipped)."""

    def hook(optimizer: torch.optim.Optimizer, *_: object) -> None:
        into.append([p.grad.detach().clone() for g in optimizer.param_groups for p in g["params"]])

    opt.register_step_pre_hook(hook)


def parity(base: GPT, pool: list[list[Batch]], cfg: BenchConfig, dtype: torch.dtype) -> dict:
    """``len(pool)`` steps on both sides from one init in ``dtype``: the same math?

    Compared: the applied (normalised, clipped) gradient, the reported loss and pre-clip
    norm, and the parameters. In fp64 all agree to ~1e-13. In fp32 the parameters can
    differ by up to ~lr in a few elements: the Stepper divides by the token count after
    backward, the hand loop before it, so rounding differs by ~1e-7 relative, and AdamW's
    first steps turn a gradient element of size ~eps (1e-8) into an update of size ~lr
    whatever its rounding; the gradient comparison is the meaningful one there.
    """
    ma, mb = copy.deepcopy(base).to(dtype), copy.deepcopy(base).to(dtype)
    opt_a, opt_b = make_optimizer(ma, cfg), make_optimizer(mb, cfg)
    grads_a: list[list[torch.Tensor]] = []
    grads_b: list[list[torch.Tensor]] = []
    _capture_grads(opt_a, grads_a)
    _capture_grads(opt_b, grads_b)
    stepper = gradstep.Stepper(ma, opt_a, clip=gradstep.ClipNorm(cfg.max_norm))
    trace_a = [stepper_step(stepper, w) for w in pool]
    trace_b = [hand_step(mb, opt_b, w, cfg.max_norm) for w in pool]
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "steps": len(pool),
        "grad_max_rel_diff": max(rel_err(a, b) for a, b in zip(grads_a, grads_b, strict=True)),
        "loss_max_rel_diff": _max_rel_diff(trace_a, trace_b, 0),
        "grad_norm_max_rel_diff": _max_rel_diff(trace_a, trace_b, 1),
        "first_grad_norm": trace_b[0][1],
        "param_max_abs_diff": max_param_diff(ma, mb),
    }


def run_timing(cfg: BenchConfig) -> dict:
    pool = build_pool(cfg)
    base = build_model(cfg.seed)
    checks = [parity(base, pool, cfg, torch.float64), parity(base, pool[:1], cfg, torch.float32)]

    model_a, model_b = copy.deepcopy(base), copy.deepcopy(base)
    opt_a, opt_b = make_optimizer(model_a, cfg), make_optimizer(model_b, cfg)
    stepper = gradstep.Stepper(model_a, opt_a, clip=gradstep.ClipNorm(cfg.max_norm))
    trace_a: list[tuple[float, float]] = []
    trace_b: list[tuple[float, float]] = []

    def run_a(i: int) -> None:
        trace_a.append(stepper_step(stepper, pool[i % WINDOW_POOL]))

    def run_b(i: int) -> None:
        trace_b.append(hand_step(model_b, opt_b, pool[i % WINDOW_POOL], cfg.max_norm))

    load_before = machine_info()["loadavg_1m"]
    times = interleaved_times(run_a, run_b, cfg.warmup, cfg.pairs)
    wall = ratio_stats(times.wall_a, times.wall_b, seed=cfg.seed)
    cpu = ratio_stats(times.cpu_a, times.cpu_b, seed=cfg.seed)
    result = {
        "wall": asdict(wall),
        "cpu": asdict(cpu),
        "times": asdict(times),
        "parity": checks,
        "parity_end": {
            "steps": len(trace_a),
            "param_max_abs_diff": max_param_diff(model_a, model_b),
            "loss_max_rel_diff": _max_rel_diff(trace_a, trace_b, 0),
            "grad_norm_max_rel_diff": _max_rel_diff(trace_a, trace_b, 1),
            "clipped_steps": stepper.clipped_steps,
        },
        "tokens_per_step": count_items(pool[0]),
        "loadavg_1m_before": load_before,
        "loadavg_1m_after": machine_info()["loadavg_1m"],
    }
    if cfg.profile:
        profile_steps(stepper, (model_b, opt_b, pool), cfg.profile, cfg)
    return result


def _max_rel_diff(a: list[tuple[float, float]], b: list[tuple[float, float]], k: int) -> float:
    return max(abs(x[k] - y[k]) / abs(y[k]) for x, y in zip(a, b, strict=True))


def _op_profile(fn: Callable[[list[Batch]], object], pool: list[list[Batch]], steps: int) -> dict:
    """Per-step count and self CPU time (us) of every aten op / Python-level region."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            fn(pool[i % WINDOW_POOL])
    return {e.key: (e.count / steps, e.self_cpu_time_total / steps) for e in prof.key_averages()}


def _own_python_ms(
    fn: Callable[[list[Batch]], object], pool: list[list[Batch]], steps: int, files: set[str]
) -> float:
    """Own time (ms per step, under cProfile) of Python functions defined in ``files``.

    Own time includes tensor operators written as ``a + b`` and the freeing of autograd
    graphs when a loss goes out of scope, which both sides pay; compare the two numbers.
    """
    prof = cProfile.Profile()
    prof.enable()
    for i in range(steps):
        fn(pool[i % WINDOW_POOL])
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    own = sum(row[2] for (path, _, _), row in stats.items() if Path(path).name in files)
    return own / steps * 1e3


def profile_steps(stepper: gradstep.Stepper, extra: tuple, steps: int, cfg: BenchConfig) -> None:
    """Where would the Stepper's extra time go? Ops it runs that the hand loop does not."""
    model_b, opt_b, pool = extra
    a = _op_profile(lambda w: stepper_step(stepper, w), pool, steps)
    b = _op_profile(lambda w: hand_step(model_b, opt_b, w, cfg.max_norm), pool, steps)
    print(f"\n## Profile ({steps} steps each): ops whose per-step count differs\n")
    print("| op | Stepper calls/step | hand calls/step | Stepper self us/step | hand us/step |")
    print("|---|---:|---:|---:|---:|")
    for key in sorted(set(a) | set(b)):
        (ca, ta), (cb, tb) = a.get(key, (0, 0.0)), b.get(key, (0, 0.0))
        if ca != cb:
            print(f"| `{key}` | {ca:g} | {cb:g} | {ta:.0f} | {tb:.0f} |")
    total_a, total_b = (sum(t for _, t in d.values()) / 1e3 for d in (a, b))
    lib = {"stepper.py", "precision.py", "clip.py", "loss.py", "strategy.py"}
    own_a = _own_python_ms(lambda w: stepper_step(stepper, w), pool, steps, lib)
    bench_files = {Path(__file__).name, "_common.py"}
    own_b = _own_python_ms(
        lambda w: hand_step(model_b, opt_b, w, cfg.max_norm), pool, steps, bench_files
    )
    print(
        f"\nall ops, self CPU per step (not interleaved: load-sensitive): Stepper "
        f"{total_a:.1f} ms, hand loop {total_b:.1f} ms\n"
        f"own Python time per step under cProfile: gradstep's step code {own_a:.2f} ms, "
        f"hand_step + count_items {own_b:.2f} ms"
    )


def parity_ok(checks: list[dict]) -> list[str]:
    """Failures of the same-math check (empty when both sides did the same computation)."""
    errors = []
    for c in checks:
        tol = FP64_TOL if c["dtype"] == "float64" else FP32_GRAD_TOL
        for key in ("grad_max_rel_diff", "loss_max_rel_diff", "grad_norm_max_rel_diff"):
            if not c[key] <= tol:
                errors.append(f"{c['dtype']}: {key} = {c[key]:.2e} > {tol:.0e}")
        if c["dtype"] == "float64" and not c["param_max_abs_diff"] <= FP64_TOL:
            errors.append(f"float64: param_max_abs_diff = {c['param_max_abs_diff']:.2e}")
    return errors


def print_timing(res: dict, cfg: BenchConfig) -> None:
    pe = res["parity_end"]
    print(
        f"\n## Step overhead: Stepper.step vs hand-written loop\n"
        f"window: {cfg.micro_batches} x {cfg.micro_batch_size} sequences, seq_len <= "
        f"{cfg.seq_len} (~{res['tokens_per_step']} target tokens), ClipNorm({cfg.max_norm}) "
        f"+ AdamW(lr={cfg.lr}, wd={cfg.weight_decay}), fp32, {cfg.threads} thread(s); "
        f"{cfg.pairs} interleaved pairs after {cfg.warmup} warm-up; load avg 1m "
        f"{res['loadavg_1m_before']} -> {res['loadavg_1m_after']}\n"
    )
    print(
        "| clock | Stepper (ms) | hand loop (ms) | median ratio | IQR | 95% CI of median "
        "| ratio of medians | median diff (ms) |\n|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    for clock in ("wall", "cpu"):
        s = RatioStats(**res[clock])
        print(
            f"| {clock} | {s.median_a_ms:.1f} | {s.median_b_ms:.1f} | **{s.median_ratio:.4f}** "
            f"| {s.ratio_q1:.4f}-{s.ratio_q3:.4f} | {s.ci95_low:.4f}-{s.ci95_high:.4f} "
            f"| {s.ratio_of_medians:.4f} | {s.median_diff_ms:+.2f} |"
        )
    verdicts = {
        c: "meets" if res[c]["median_ratio"] <= TARGET_RATIO else "MISSES" for c in ("wall", "cpu")
    }
    print(
        f"\ntarget median ratio <= {TARGET_RATIO}: wall clock {verdicts['wall']}, "
        f"CPU time {verdicts['cpu']}"
    )
    for c in res["parity"]:
        print(
            f"same math, {c['dtype']}, {c['steps']} step(s): applied-gradient rel diff "
            f"{c['grad_max_rel_diff']:.1e}, loss {c['loss_max_rel_diff']:.1e}, pre-clip norm "
            f"{c['grad_norm_max_rel_diff']:.1e} (norm {c['first_grad_norm']:.3f}), "
            f"params max abs diff {c['param_max_abs_diff']:.1e}"
        )
    print(
        f"timed fp32 run, after {pe['steps']} steps: loss rel diff <= "
        f"{pe['loss_max_rel_diff']:.1e}, pre-clip norm rel diff <= "
        f"{pe['grad_norm_max_rel_diff']:.1e}, params max abs diff {pe['param_max_abs_diff']:.1e} "
        f"(AdamW amplifies fp32 rounding in ~zero gradient elements; see parity()), "
        f"clipped {pe['clipped_steps']}/{pe['steps']} steps"
    )


# ----------------------------------------------------------------------------- memory


def memory_case(name: str, cfg: BenchConfig) -> dict:
    """Run in its own process: build, take a few steps, report the peak RSS."""
    torch.set_num_threads(cfg.threads)
    case = MEMORY_CASES[name]
    model = build_model(cfg.seed)
    rows = random_rows(32, cfg.memory_seq_len, seed=cfg.seed + 100)
    out = {"case": name, "micro_batches": case.micro_batches, "padded_tokens": 0, "items": 0}
    if case.micro_batches:
        rows = [r[: case.seq_len + 1] if case.seq_len else r for r in rows]
        size = case.micro_batch_size
        window = lm_window(rows[: case.micro_batches * size], size)
        opt = make_optimizer(model, cfg)
        stepper = gradstep.Stepper(model, opt, clip=gradstep.ClipNorm(cfg.max_norm))
        for _ in range(cfg.memory_steps):
            if case.hand:
                hand_step(model, opt, window, cfg.max_norm)
            else:
                stepper.step(window, lm_loss)
        out["padded_tokens"] = max(mb["input_ids"].numel() for mb in window)
        out["items"] = count_items(window)
    out["max_rss_mib"], _ = peak_memory()
    return out


def run_memory(cfg: BenchConfig, script: str) -> list[dict]:
    common = [
        f"--threads={cfg.threads}",
        f"--seed={cfg.seed}",
        f"--memory-seq-len={cfg.memory_seq_len}",
        f"--memory-steps={cfg.memory_steps}",
    ]
    return [run_in_subprocess(script, ["--memory-case", name, *common]) for name in MEMORY_CASES]


def print_memory(rows: list[dict], cfg: BenchConfig) -> None:
    base = next(r["max_rss_mib"] for r in rows if r["case"] == "baseline")
    print(
        f"\n## Peak memory: max RSS (VmHWM) of one fresh process per case, after "
        f"{cfg.memory_steps} steps, seq_len <= {cfg.memory_seq_len}, fp32, Stepper unless "
        "stated\n"
    )
    print("| case | what | largest forward (padded tokens) | max RSS (MiB) | vs baseline (MiB) |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        extra = "-" if r["case"] == "baseline" else f"{r['max_rss_mib'] - base:+.0f}"
        print(
            f"| `{r['case']}` | {MEMORY_CASES[r['case']].what} | {r['padded_tokens'] or '-'} "
            f"| {r['max_rss_mib']:.0f} | {extra} |"
        )


# ----------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None) -> tuple[BenchConfig, argparse.Namespace]:
    ap = BenchConfig.parser(__doc__)
    ap.add_argument("--memory-case", choices=sorted(MEMORY_CASES), help=argparse.SUPPRESS)
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--json", type=Path, help="also write all results to this JSON file")
    return BenchConfig.parse(argv, ap)


def main(argv: list[str] | None = None) -> int:
    cfg, ns = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    if ns.memory_case:
        print(json.dumps(memory_case(ns.memory_case, cfg)))
        return 0
    results: dict = {"config": asdict(cfg), "machine": machine_info()}
    print("machine:", results["machine"])
    ok = True
    if not ns.skip_timing:
        timing = run_timing(cfg)
        results["timing"] = timing
        print_timing(timing, cfg)
        errors = parity_ok(timing["parity"])
        for err in errors:
            print(f"ERROR: not the same math: {err}")
        ok = not errors
    if not ns.skip_memory:
        results["memory"] = run_memory(cfg, str(Path(__file__).resolve()))
        print_memory(results["memory"], cfg)
    if ns.json:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps(results, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
