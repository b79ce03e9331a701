"""gradstep side by side with the accumulation loops people usually write.

One model (the demo GPT), the same initial weights, the same windows of variable-length
sequences (``-100`` label padding), the same window of k micro-batches, the same
ClipNorm threshold and AdamW, through four loops:

(a) ``plain``      hand-written PyTorch: per-token loss sum / the window's token count,
                   ``torch.nn.utils.clip_grad_norm_``, AdamW. The baseline for time.
(b) ``gradstep``   ``gradstep.Stepper(model, opt, clip=ClipNorm(max_norm)).step(window, ...)``.
(c) ``accelerate`` Hugging Face Accelerate as its docs show it: ``with
                   accelerator.accumulate(model)``, the micro-batch's *mean* loss,
                   ``accelerator.backward`` (which divides by k), ``accelerator.clip_grad_norm_``
                   when ``accelerator.sync_gradients``.
(d) ``fabric``     Lightning Fabric: ``fabric.no_backward_sync`` on all but the last micro-batch,
                   ``fabric.backward(mean_loss / k)`` (the Fabric docs leave the loss
                   normalisation to the user; mean / k is what the Lightning Trainer does with
                   ``accumulate_grad_batches``), ``fabric.clip_gradients``.

Measured:

* **time**: the four loops run interleaved in one process, window by window, in rotating
  order, each on its own copy of the model; the median over windows of t_method / t_plain;
* **gradient error** against an fp64 reference computed the plain way: one batch holding
  every sequence of the window, the token-weighted mean loss, one backward. Per loop, the
  gradient the optimizer is handed (captured by an optimizer step pre-hook) is compared,
  with clipping off (||g - g_ref|| / ||g_ref||), the reported pre-clip norm, and with
  clipping on (the post-clip gradient against the clipped reference). A mean of
  per-micro-batch means weights a token of a short micro-batch more than one of a long one;
  these columns show by how much;
* **memory**: each loop in a fresh subprocess: peak RSS, and how far the steps pushed it
  above the RSS right before the first step.

    .venv/bin/pip install -e '.[bench]'     # accelerate, lightning
    .venv/bin/python bench/peers.py         # ~3 minutes on 2 CPU cores
    .venv/bin/python bench/peers.py --json bench/out/peers.json

fp32 on CPU. Nothing here asserts on time; ratios are measured against (a) in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import Optimizer

import gradstep
from _common import (
    BaseConfig,
    Batch,
    concat,
    count_items,
    flat,
    lm_loss,
    lm_window,
    machine_info,
    mean_token_loss,
    random_rows,
    ratio_stats,
    reference_grads,
    run_in_subprocess,
)
from gradstep.metrics import peak_memory
from gradstep_cli.data.sources import IGNORE_INDEX, TrainBatches, load_corpus
from gradstep_cli.models.gpt import GPT, GPTConfig

METHODS = ("plain", "gradstep", "accelerate", "fabric")
DATA = ("text", "random")
NO_CLIP = 1e30  # a threshold no norm reaches: clip coefficient exactly 1 in every loop


@dataclass(frozen=True)
class BenchConfig(BaseConfig):
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    seq_len: int = 128
    micro_batch_size: int = 4
    accum_steps: int = 8
    max_norm: float = 1.0
    lr: float = 1e-3
    rounds: int = 20
    warmup: int = 3
    error_windows: int = 6
    error_micro_batch_size: int = 1
    data: str = "text"
    min_frac: float = 0.1
    memory_steps: int = 3
    threads: int = 1
    seed: int = 0

    POSITIVE = ("n_layer", "n_head", "d_model", "micro_batch_size", "accum_steps",
                "error_windows", "error_micro_batch_size", "memory_steps", "threads")  # fmt: skip

    def check(self) -> None:
        if self.rounds < 5 or self.warmup < 0:
            raise ValueError("--rounds must be >= 5 (a median of fewer is noise), --warmup >= 0")
        if not 2 <= self.seq_len <= 1024:
            raise ValueError(f"--seq-len must be in [2, 1024], got {self.seq_len}")
        if self.data not in DATA:
            raise ValueError(f"--data must be one of {', '.join(DATA)}, got {self.data!r}")
        if not 0 < self.min_frac <= 1:
            raise ValueError(f"--min-frac must be in (0, 1], got {self.min_frac}")
        if not self.max_norm > 0:
            raise ValueError(f"--max-norm must be > 0, got {self.max_norm}")


# ----------------------------------------------------------------------------- the loops


def ce_sum(model: nn.Module, mb: Batch) -> torch.Tensor:
    logits = model(mb["input_ids"])
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)), mb["labels"].reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="sum",
    )  # fmt: skip


Step = Callable[[list[Batch]], float]
"""Runs one window, takes one optimizer step, returns the reported pre-clip norm."""


def plain_loop(model: nn.Module, opt: torch.optim.Optimizer, max_norm: float) -> Step:
    def step(window: list[Batch]) -> float:
        items = count_items(window)  # known up front in one process
        for mb in window:
            (ce_sum(model, mb) / items).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(norm)

    return step


def gradstep_loop(model: nn.Module, opt: torch.optim.Optimizer, max_norm: float) -> Step:
    stepper = gradstep.Stepper(model, opt, clip=gradstep.ClipNorm(max_norm))
    return lambda window: stepper.step(window, lm_loss).grad_norm


class Peers:
    """One ``Accelerator`` and one ``Fabric`` for the process, as a script would have."""

    def __init__(self, accum_steps: int) -> None:
        from accelerate import Accelerator
        from lightning.fabric import Fabric

        self.k = accum_steps
        self.accelerator = Accelerator(gradient_accumulation_steps=accum_steps, cpu=True)
        self.fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")

    def accelerate_loop(
        self, model: nn.Module, opt: torch.optim.Optimizer, max_norm: float
    ) -> Step:
        acc = self.accelerator
        model, opt = acc.prepare(model, opt)

        def step(window: list[Batch]) -> float:
            norm = math.nan
            for mb in window:
                with acc.accumulate(model):
                    acc.backward(mean_token_loss(model, mb))  # what ``outputs.loss`` is
                    if acc.sync_gradients:
                        norm = float(acc.clip_grad_norm_(model.parameters(), max_norm))
                    opt.step()  # a no-op until the window's last micro-batch
                    opt.zero_grad()
            if math.isnan(norm):
                raise RuntimeError("accelerate did not sync on the window's last micro-batch")
            return norm

        return step

    def fabric_loop(self, model: nn.Module, opt: Optimizer, max_norm: float) -> Step:
        fabric, k = self.fabric, self.k
        model, opt = fabric.setup(model, opt)

        def step(window: list[Batch]) -> float:
            for i, mb in enumerate(window):
                with fabric.no_backward_sync(model, enabled=i < len(window) - 1):
                    fabric.backward(mean_token_loss(model, mb) / k)
            norm = float(fabric.clip_gradients(model, opt, max_norm=max_norm))
            opt.step()
            opt.zero_grad()
            return norm

        return step


def make_loop(
    name: str, peers: Peers | None, model: nn.Module, cfg: BenchConfig, max_norm: float
) -> tuple[Step, Optimizer]:
    """A fresh AdamW and the named loop around ``model``; also returns the raw optimizer.

    ``peers`` is needed only for ``accelerate`` and ``fabric`` (so a memory run of (a) or
    (b) never imports them).
    """
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    if name == "plain":
        return plain_loop(model, opt, max_norm), opt
    if name == "gradstep":
        return gradstep_loop(model, opt, max_norm), opt
    if peers is None:
        raise ValueError(f"loop {name!r} needs the Peers object (accelerate / lightning)")
    build = {"accelerate": peers.accelerate_loop, "fabric": peers.fabric_loop}[name]
    return build(model, opt, max_norm), opt


def build_model(cfg: BenchConfig, state: dict[str, torch.Tensor] | None = None) -> GPT:
    gpt = GPTConfig(n_layer=cfg.n_layer, n_head=cfg.n_head, d_model=cfg.d_model,
                    max_seq_len=cfg.seq_len)  # fmt: skip
    torch.manual_seed(cfg.seed)
    model = GPT(gpt)
    if state is not None:
        model.load_state_dict(state)
    return model


def make_windows(cfg: BenchConfig, n: int, micro_batch_size: int, seed: int) -> list[list[Batch]]:
    """``n`` windows of ``accum_steps`` micro-batches.

    ``text``: the demo trainer's own pipeline on its default corpus (Python stdlib source):
    half the chunks full length, half of random length, documents ending mid-chunk.
    ``random``: random bytes, lengths uniform in [min_frac, 1] x seq_len.
    """
    if cfg.data == "text":
        stream = TrainBatches(load_corpus().train, cfg.seq_len, micro_batch_size, seed)
        return [[next(stream) for _ in range(cfg.accum_steps)] for _ in range(n)]
    rows = cfg.accum_steps * micro_batch_size
    return [
        lm_window(random_rows(rows, cfg.seq_len, seed + i, min_frac=cfg.min_frac), micro_batch_size)
        for i in range(n)
    ]


# ----------------------------------------------------------------------------- gradient error


def flat_grads(params: list[nn.Parameter]) -> torch.Tensor:
    return flat([p.grad.detach() for p in params]).double()


def reference_grad(model: nn.Module, window: list[Batch]) -> torch.Tensor:
    """fp64, one batch of every sequence (right-padded to the longest), token-weighted mean.

    Right padding is exact for a causal model: real positions never attend to padding.
    """
    grads, _ = reference_grads(model, concat(window), torch.float64)
    return flat(grads)


def clipped(g: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The ``clip_grad_norm_`` formula, in fp64."""
    return g * min(1.0, max_norm / (float(g.norm()) + 1e-6))


def applied_gradient(name: str, peers: Peers, cfg: BenchConfig, state: dict, window, max_norm):
    """(gradient handed to AdamW, reported pre-clip norm) for one window from ``state``."""
    model = build_model(cfg, state)
    loop, opt = make_loop(name, peers, model, cfg, max_norm)
    seen: list[torch.Tensor] = []
    params = [p for g in opt.param_groups for p in g["params"]]
    opt.register_step_pre_hook(lambda *_: seen.append(flat_grads(params)))
    norm = loop(window)
    if len(seen) != 1:
        raise RuntimeError(f"{name}: expected one optimizer step per window, saw {len(seen)}")
    return seen[0], norm


def gradient_errors(cfg: BenchConfig, peers: Peers, micro_batch_size: int) -> dict[str, Any]:
    """Median and max over windows of each loop's errors against the fp64 reference."""
    state = build_model(cfg).state_dict()
    windows = make_windows(cfg, cfg.error_windows, micro_batch_size, cfg.seed + 1000)
    errors: dict[str, dict[str, list[float]]] = {m: {} for m in METHODS}
    counts = [count_items([mb]) for w in windows for mb in w]
    for window in windows:
        g_ref = reference_grad(build_model(cfg, state), window)
        ref_norm = float(g_ref.norm())
        ref_clipped = clipped(g_ref, cfg.max_norm)
        for name in METHODS:
            raw, norm = applied_gradient(name, peers, cfg, state, window, NO_CLIP)
            post, _ = applied_gradient(name, peers, cfg, state, window, cfg.max_norm)
            e = errors[name]
            e.setdefault("grad", []).append(float((raw - g_ref).norm()) / ref_norm)
            e.setdefault("norm", []).append(abs(norm - ref_norm) / ref_norm)
            e.setdefault("post_clip", []).append(
                float((post - ref_clipped).norm() / ref_clipped.norm())
            )
    return {
        "micro_batch_size": micro_batch_size,
        "windows": len(windows),
        "tokens_per_micro_batch": {
            "min": min(counts),
            "max": max(counts),
            "mean": statistics.fmean(counts),
            "cv": statistics.pstdev(counts) / statistics.fmean(counts),
        },  # fmt: skip
        "errors": {
            m: {k: {"median": statistics.median(v), "max": max(v)} for k, v in e.items()}
            for m, e in errors.items()
        },
    }


# ----------------------------------------------------------------------------- time


def timing(cfg: BenchConfig, peers: Peers) -> dict[str, Any]:
    """All loops interleaved window by window (rotating order) on the same windows."""
    state = build_model(cfg).state_dict()
    loops = {m: make_loop(m, peers, build_model(cfg, state), cfg, cfg.max_norm)[0] for m in METHODS}
    windows = make_windows(cfg, cfg.warmup + cfg.rounds, cfg.micro_batch_size, cfg.seed + 1)
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    load_before = os.getloadavg()[0]
    for r, window in enumerate(windows):
        order = METHODS[r % len(METHODS) :] + METHODS[: r % len(METHODS)]
        for name in order:
            t0 = time.perf_counter()
            loops[name](window)
            if r >= cfg.warmup:
                times[name].append(time.perf_counter() - t0)
    return {
        "tokens_per_window": statistics.fmean(count_items(w) for w in windows),
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "stats": {m: asdict(ratio_stats(times[m], times["plain"], cfg.seed)) for m in METHODS},
    }


# ----------------------------------------------------------------------------- memory


def _rss_now_mib() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return math.nan


def memory_of(name: str, cfg: BenchConfig) -> dict[str, float | str]:
    """In a fresh process: build one loop, take a few steps, report peak RSS."""
    torch.set_num_threads(cfg.threads)
    peers = Peers(cfg.accum_steps) if name in ("accelerate", "fabric") else None
    loop, _ = make_loop(name, peers, build_model(cfg), cfg, cfg.max_norm)
    windows = make_windows(cfg, cfg.memory_steps, cfg.micro_batch_size, cfg.seed + 1)
    before = _rss_now_mib()
    for window in windows:
        loop(window)
    peak, _ = peak_memory()
    return {"method": name, "peak_rss_mib": peak, "above_setup_mib": peak - before}


# ----------------------------------------------------------------------------- output


_DATA_WORDS = {
    "text": "the demo's byte-level stdlib text, variable-length chunks",
    "random": "random bytes, variable length",
}


def print_tables(res: dict[str, Any], cfg: BenchConfig) -> None:
    t = res["timing"]
    print(
        f"\n## Peers: gradstep vs the usual accumulation loops\n\n"
        f"Demo GPT ({res['parameters']:,} parameters: {cfg.n_layer} layers, d_model "
        f"{cfg.d_model}), fp32, CPU, {cfg.threads} thread(s); window = {cfg.accum_steps} "
        f"micro-batches x {cfg.micro_batch_size} sequences ({_DATA_WORDS[cfg.data]}) of at most "
        f"{cfg.seq_len} tokens (-100 padding), ~{t['tokens_per_window']:.0f} target "
        f"tokens; ClipNorm({cfg.max_norm}), AdamW(lr={cfg.lr}). {cfg.rounds} timed windows per "
        f"loop after {cfg.warmup} warm-up, interleaved; load avg {t['loadavg_1m']}.\n"
    )
    print("| loop | median step (ms) | step time vs (a), median of per-window ratios "
          "[95% CI] | peak RSS (MiB) | RSS above setup (MiB) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|")
    mem = {m["method"]: m for m in res.get("memory", [])}
    for i, name in enumerate(METHODS):
        s = t["stats"][name]
        m = mem.get(name)
        peak = f"{m['peak_rss_mib']:.0f}" if m else "-"
        above = f"{m['above_setup_mib']:+.0f}" if m else "-"
        print(
            f"| ({'abcd'[i]}) {name} | {s['median_a_ms']:.1f} | {s['median_ratio']:.3f} "
            f"[{s['ci95_low']:.3f}, {s['ci95_high']:.3f}] | {peak} | {above} |"
        )
    for err in res["errors"]:
        tk = err["tokens_per_micro_batch"]
        print(
            f"\n### Gradient error vs fp64 full-batch reference: window {cfg.accum_steps} x "
            f"{err['micro_batch_size']}, {err['windows']} windows; target tokens per "
            f"micro-batch {tk['min']}-{tk['max']} (mean {tk['mean']:.0f}, CV {tk['cv']:.2f})\n"
        )
        print("| loop | gradient rel. error, median (max) | reported pre-clip norm rel. error "
              "| post-clip gradient rel. error |")  # fmt: skip
        print("|---|---:|---:|---:|")
        for i, name in enumerate(METHODS):
            e = err["errors"][name]
            cells = " | ".join(
                f"{e[k]['median']:.1e} ({e[k]['max']:.1e})" for k in ("grad", "norm", "post_clip")
            )
            print(f"| ({'abcd'[i]}) {name} | {cells} |")


def parse_args(argv: list[str] | None) -> tuple[BenchConfig, argparse.Namespace]:
    ap = BenchConfig.parser(__doc__)
    ap.add_argument("--skip-memory", action="store_true", help="no per-loop subprocesses")
    ap.add_argument("--json", type=Path, help="also write every result to this JSON file")
    ap.add_argument("--memory-of", choices=METHODS, help=argparse.SUPPRESS)
    return BenchConfig.parse(argv, ap)


def main(argv: list[str] | None = None) -> int:
    cfg, ns = parse_args(argv)
    if ns.memory_of:
        print(json.dumps(memory_of(ns.memory_of, cfg)))
        return 0
    torch.set_num_threads(cfg.threads)
    peers = Peers(cfg.accum_steps)
    started = time.perf_counter()
    res: dict[str, Any] = {"config": asdict(cfg), "machine": machine_info()}
    res["parameters"] = build_model(cfg).num_parameters()
    res["timing"] = timing(cfg, peers)
    sizes = dict.fromkeys((cfg.micro_batch_size, cfg.error_micro_batch_size))
    res["errors"] = [gradient_errors(cfg, peers, size) for size in sizes]
    if not ns.skip_memory:
        flags = cfg.flags()
        res["memory"] = [run_in_subprocess(__file__, ["--memory-of", m, *flags]) for m in METHODS]
    res["wall_s"] = time.perf_counter() - started
    print_tables(res, cfg)
    print(f"\nmachine: {res['machine']}; wall {res['wall_s']:.0f} s", file=sys.stderr)
    if ns.json:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
