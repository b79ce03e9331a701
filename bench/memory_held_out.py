"""The memory budget on configurations nobody tuned for, measured from outside the process.

Run through ``bench/memory.py --part held-out``: each configuration is a fresh ``gradstep
train --micro-batch-size auto --global-batch N --memory-budget B`` (then the same plan given
by hand) under an independent sampler of the resident memory of the run and its children.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from gradstep import memory as gm

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20


def _err(pred: float, meas: float) -> float:
    return pred / meas - 1


WATCHER = r"""
import json, os, sys, time
root, interval = int(sys.argv[1]), float(sys.argv[2]) / 1000
metrics = sys.argv[3] if len(sys.argv) > 3 else None
tick = os.sysconf("SC_CLK_TCK")
seen, steps, lines = {}, [], 0

def tree(pid):
    out = [pid]
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                for child in f.read().split():
                    out += tree(int(child))
    except OSError:
        pass
    return out

def cpu(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / tick

while os.path.exists(f"/proc/{root}"):
    for pid in tree(root):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f)
            rss = int(fields["VmRSS"].split()[0]) * 1024
            hwm = int(fields["VmHWM"].split()[0]) * 1024
        except (OSError, KeyError, ValueError):
            continue
        old = seen.get(pid, {"rss": 0, "hwm": 0, "parent": pid == root})
        seen[pid] = {"rss": max(old["rss"], rss), "hwm": max(old["hwm"], hwm),
                     "parent": pid == root}
    if metrics:
        try:
            with open(metrics, "rb") as f:
                now = f.read().count(b"\n")
            if now > lines:
                lines = now
                steps.append([now, cpu(root), time.perf_counter()])
        except (OSError, IndexError, ValueError):
            pass
    time.sleep(interval)
print(json.dumps({"procs": seen, "steps": steps}))
"""
"""The independent sampler: a separate interpreter (no torch) that reads ``VmRSS`` and
``VmHWM`` from ``/proc/PID/status`` of the run and all its descendants (both ranks under
torchrun) every few ms and keeps each process's maximum. It does not rely on the run's own
counter, which gradstep resets (``clear_refs``): a sample taken between resets still sees
each high-water mark. Given a ``metrics.jsonl`` path, it also reads the run's CPU time
(``/proc/PID/stat``) whenever the file gains a line (a step ended: it is flushed every
step): steps' CPU seconds, which other processes on a shared machine do not stretch as
they stretch wall time."""


@dataclass(frozen=True)
class HeldOut:
    """A configuration nobody tuned for (memory-2.md's C-numbers where they match)."""

    name: str
    flags: tuple[str, ...]
    global_batch: int
    budget_mib: int
    """Chosen so that the plan is constrained (``--calibrate 1`` re-derives it)."""
    target: tuple[int, bool]
    """(micro-batch, checkpointing) the budget is calibrated for: the candidate whose
    predicted peak, with the margin and 2% slack, sets the budget."""
    ranks: int = 1
    steps: int = 4


def _model(layers: int, width: int, heads: int, seq: int, *extra: str) -> tuple[str, ...]:
    shape = ("--n-layer", layers, "--d-model", width, "--n-head", heads, "--seq-len", seq)
    return (*map(str, shape), *extra)


BF16, DDP, FSDP = ("--precision", "bf16"), ("--strategy", "ddp"), ("--strategy", "fsdp")
DROP, LAMB = ("--dropout", "0.1"), ("--optimizer", "lamb")
m = _model
HELD_OUT = [
    HeldOut("C1 fp32 L2 d256 s192", m(2, 256, 4, 192), 24, 438, (4, False)),
    HeldOut("C4 bf16 L6 d128 s384 mb1", m(6, 128, 4, 384, *BF16), 20, 453, (1, True), steps=8),
    HeldOut("C5 fp32 L4 d384 s128", m(4, 384, 6, 128), 12, 516, (1, False)),
    HeldOut("C6 fp32 L3 d192 s320 dropout", m(3, 192, 6, 320, *DROP), 18, 487, (2, False)),
    HeldOut("C7 fp32 L4 d128 s256 LAMB", m(4, 128, 4, 256, *LAMB), 40, 486, (8, False)),
    HeldOut("C8 DDPx2 fp32 L3 d192 s256", m(3, 192, 4, 256, *DDP), 32, 423, (2, False), 2),
    HeldOut("C9 FSDP2x2 bf16 L4 d256 s192", m(4, 256, 4, 192, *BF16, *FSDP), 24, 466, (4, True), 2),
    HeldOut("C11 bf16 L2 d512 s128 mb1", m(2, 512, 8, 128, *BF16), 16, 552, (1, False), steps=8),
    HeldOut("C12 DDPx2 bf16 L2 d320 s224", m(2, 320, 4, 224, *BF16, *DDP), 20, 532, (5, False), 2),
    HeldOut("C10 FSDP2x2 fp32 L6 d128 s384", m(6, 128, 4, 384, *FSDP), 16, 399, (1, True), 2),
]  # fmt: skip
RUN_FLAGS = ("--warmup", "1", "--eval-every", "0", "--eval-batches", "2", "--sample-tokens", "0",
             "--device", "cpu", "--log-every", "1", "--overwrite")  # fmt: skip


def _launch(case: HeldOut, command: str) -> list[str]:
    venv = Path(sys.executable).parent
    if case.ranks == 1:
        return [sys.executable, "-m", "gradstep", command]
    return [str(venv / "torchrun"), "--standalone", f"--nproc_per_node={case.ranks}",
            "-m", "gradstep", command]  # fmt: skip


def watched(cmd: list[str], interval_ms: float) -> tuple[subprocess.CompletedProcess, dict]:
    """Run ``cmd`` under the sampler; (its result, per-process maxima)."""
    proc, seen = watched_steps(cmd, None, interval_ms)
    return proc, seen["procs"]


def watched_steps(
    cmd: list[str], metrics: Path | None, interval_ms: float
) -> tuple[subprocess.CompletedProcess, dict]:
    """Run ``cmd`` under the sampler; (its result, ``{"procs": per-process maxima, "steps":
    [[metrics lines, CPU seconds, wall clock], ...]}``, the steps read from ``metrics``)."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    argv = [sys.executable, "-c", WATCHER, str(proc.pid), str(interval_ms)]
    watcher = subprocess.Popen([*argv, *([str(metrics)] if metrics else [])],
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    out, err = proc.communicate()
    seen = json.loads(watcher.communicate()[0] or '{"procs": {}, "steps": []}')
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), seen


def _ranks_peak(seen: dict, ranks: int) -> list[int]:
    """Each rank's peak: the process itself, or under torchrun its children (the launcher,
    ~220 MiB, is not a rank: the budget is per rank)."""
    procs = [v for v in seen.values() if ranks == 1 or not v["parent"]]
    return sorted((max(v["rss"], v["hwm"]) for v in procs), reverse=True)[:ranks]


def calibrate(case: HeldOut) -> int:
    """A budget (MiB) for which ``case.target`` is about the largest candidate that fits."""
    cmd = [*_launch(case, "plan"), *case.flags, "--global-batch", str(case.global_batch),
           "--memory-budget", "64GiB", "--device", "cpu", "--json"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    plan = json.loads(proc.stdout.strip().splitlines()[-1])
    mbs, ckpt = case.target
    key = ("micro_batch_size", "activation_checkpointing")
    (target,) = [c for c in plan["candidates"] if (c[key[0]], c[key[1]]) == (mbs, ckpt)]
    return math.ceil(target["predicted_peak_bytes"] / (1 - 0.1) * 1.02 / MiB)


def held_out_run(case: HeldOut, sample_ms: float, auto: dict | None = None) -> dict:
    """``train --micro-batch-size auto`` (or, given ``auto``, its choice by hand) under the
    sampler; the prediction is the run's plan.json."""
    out = ROOT / "bench" / "out" / "memory-runs" / case.name.split()[0]
    out = out.with_name(out.name + ("-hand" if auto else "-auto"))
    if auto is None:
        batch = ["--micro-batch-size", "auto"]
    else:
        batch = ["--micro-batch-size", str(auto["micro_batch_size"])]
        batch += ["--activation-checkpointing"] if auto["activation_checkpointing"] else []
    cmd = [*_launch(case, "train"), *case.flags, *RUN_FLAGS, *batch,
           "--global-batch", str(case.global_batch), "--memory-budget", f"{case.budget_mib}MiB",
           "--max-steps", str(case.steps), "--out", str(out)]  # fmt: skip
    start = time.perf_counter()
    proc, seen = watched(cmd, sample_ms)
    if proc.returncode != 0:
        return {"name": case.name, "error": proc.stderr.strip().splitlines()[-1][-300:]}
    plan = (
        json.loads((out / "plan.json").read_text())
        if auto is None
        else {**auto, "predicted_peak_bytes": auto["predicted"]}
    )
    own = [json.loads(line)["peak_memory_mb"] for line in (out / "metrics.jsonl").open()]
    peaks = _ranks_peak(seen, case.ranks)
    return {
        "name": case.name,
        "budget": case.budget_mib * MiB,
        "micro_batch_size": plan["micro_batch_size"],
        "accum_steps": plan["accum_steps"],
        "activation_checkpointing": plan["activation_checkpointing"],
        "predicted": plan["predicted_peak_bytes"],
        "measured": peaks[0],
        "ranks": peaks,
        "own_peak_mb": own,
        "seconds": time.perf_counter() - start,
        "notes": [line for line in proc.stderr.splitlines() if "predicted to peak" in line],
    }


def held_out(only: str, calibrated: bool, by_hand: bool, sample_ms: float) -> list[dict]:
    """Every held-out case (or those ``only`` names): auto, then by hand; one row each."""
    return auto_then_by_hand(
        HELD_OUT, held_out_run, calibrate, only, calibrated, by_hand, sample_ms
    )


def auto_then_by_hand(
    cases: list, run: Callable, calibrate: Callable, only: str, calibrated: bool,
    by_hand: bool, sample_ms: float,
) -> list[dict]:  # fmt: skip
    """``run(case, sample_ms)`` of every case (or those ``only`` names), then, unless it
    failed, ``run(case, sample_ms, auto=row)``: the same plan given by hand; one row each.
    ``calibrated``: each budget re-derived by ``calibrate(case)`` first."""
    wanted = {w.strip() for w in only.split(",") if w.strip()}
    rows = []
    for case in [c for c in cases if not wanted or c.name.split()[0] in wanted]:
        if calibrated:
            case = replace(case, budget_mib=calibrate(case))
            print(f"{case.name}: calibrated budget {case.budget_mib} MiB", file=sys.stderr)
        row = run(case, sample_ms)
        print(f"{case.name}: {_held_line(row)}", file=sys.stderr)
        rows.append(row)
        if by_hand and "error" not in row:
            hand = run(case, sample_ms, auto=row)
            hand["name"] += " (by hand)"
            print(f"{hand['name']}: {_held_line(hand)}", file=sys.stderr)
            rows.append(hand)
    return rows


def _held_line(r: dict) -> str:
    if "error" in r:
        return f"FAILED: {r['error']}"
    ckpt = " ckpt" if r["activation_checkpointing"] else ""
    return (
        f"{r['micro_batch_size']} x {r['accum_steps']}{ckpt}, "
        f"budget {gm.format_bytes(r['budget'])}, predicted {gm.format_bytes(r['predicted'])}, "
        f"measured {gm.format_bytes(r['measured'])} ({_err(r['predicted'], r['measured']):+.1%}), "
        f"{'under' if r['measured'] <= r['budget'] else 'OVER'} budget, {r['seconds']:.0f}s"
    )


def print_held_out(rows: list[dict]) -> None:
    print("\n## Held-out configurations: predicted vs measured (independent RSS sampler)\n")
    print("| config | budget | plan (mbs x accum, ckpt) | predicted | measured (max rank) "
          "| error | under budget? |")  # fmt: skip
    print("|---|---:|---|---:|---:|---:|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['name']} | | failed: {r['error']} | | | | |")
            continue
        ckpt = "on" if r["activation_checkpointing"] else "off"
        print(
            f"| {r['name']} | {r['budget'] / MiB:.0f} MiB | {r['micro_batch_size']} x "
            f"{r['accum_steps']}, {ckpt} | {r['predicted'] / MiB:.1f} | "
            f"{r['measured'] / MiB:.1f} | {_err(r['predicted'], r['measured']):+.1%} | "
            f"{'yes' if r['measured'] <= r['budget'] else '**NO**'} |"
        )
    ok = [r for r in rows if "error" not in r]
    under = sum(r["measured"] <= r["budget"] for r in ok)
    print(f"\n{under} of {len(ok)} runs under budget; {len(rows) - len(ok)} failed")
