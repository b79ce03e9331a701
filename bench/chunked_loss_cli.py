"""What the chunked loss buys (bench/chunked_loss.py, part 2): under one fixed
``--memory-budget`` per vocabulary, the real CLI trains the tiny-width Llama of part 1
(``config.save_pretrained``, no tokenizer: the default corpus read as bytes) with
``--micro-batch-size auto --global-batch G``, once per ``--cli-losses`` value: ``0``
(``--loss-chunk-tokens 0``, the whole logits), ``1024`` (chunks pinned) and ``default``
(the flag left out: the planner then chooses the chunking too). Per run:

* the plan the run chose (its ``plan.json``: micro-batch, accumulation, predicted peak);
* peak RSS from an independent sampler: a thread of this (torch-free) process summing
  ``VmRSS`` over the command's process tree every ``--interval-ms``: over the whole run
  (planning probe, data, build, evaluations included), over the first evaluation, and over
  steps 1 to K-1 (the output is unbuffered and each line timestamped on the sampler's
  clock; the last step and the final evaluation print after both, so they are left out);
  beside the CLI's own ``peak_memory_mb`` (its process's lifetime ``max_rss``);
* trained and processed tokens/s of steps 2+ (``metrics.jsonl``: the first step's one-time
  costs left out), and trained tokens per CPU second of steps 1 to K-1 (the sampler's
  user + system time of the tree): the machine is shared, so wall time inflates with the
  load and CPU time much less.

A run that fails (the planner is being changed concurrently) is retried after a pause; the
failures are kept in the JSON's ``cli_notes``."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import chunked_loss_hf

MIB = 2**20
ROOT = Path(__file__).resolve().parent.parent
GRADSTEP = [sys.executable, "-m", "gradstep"]
TICK = os.sysconf("SC_CLK_TCK")


def _tree(pid: int) -> list[int]:
    out = [pid]
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                for child in f.read().split():
                    out += _tree(int(child))
    except OSError:
        pass
    return out


def _usage(pid: int) -> tuple[int, float]:
    """(VmRSS bytes, user + system CPU seconds) of ``pid``; (0, 0) once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            line = next(x for x in f if x.startswith("VmRSS:"))
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, StopIteration):
        return 0, 0.0
    return int(line.split()[1]) * 1024, (int(fields[11]) + int(fields[12])) / TICK


class TreeSampler(threading.Thread):
    """``(time.monotonic(), summed VmRSS, summed CPU seconds)`` of ``pid`` and its
    descendants every interval."""

    def __init__(self, pid: int, interval_ms: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval_ms / 1000
        self.samples: list[tuple[float, int, float]] = []
        self.pids: set[int] = set()
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            now, pids = time.monotonic(), _tree(self.pid)
            usage = [_usage(p) for p in pids]
            total = sum(rss for rss, _ in usage)
            if total:
                self.samples.append((now, total, sum(cpu for _, cpu in usage)))
                self.pids.update(pids)
            time.sleep(self.interval)

    def stop(self) -> None:
        self._done.set()
        self.join()


def run_sampled(cmd: list[str], log: Path, interval_ms: float) -> tuple[list, TreeSampler]:
    """Run ``cmd``: its output lines, each with the time it arrived, and the sampler."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT)  # fmt: skip
    sampler = TreeSampler(proc.pid, interval_ms)
    sampler.start()
    lines = []
    assert proc.stdout is not None
    with log.open("w") as out:
        for line in proc.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))
            out.write(line)
    rc = proc.wait()
    sampler.stop()
    if rc != 0:
        tail = "\n".join(text for _, text in lines[-15:])
        raise RuntimeError(f"exit {rc}: {' '.join(cmd)}\n{tail}")
    return lines, sampler


def command(args: argparse.Namespace, model: Path, run: Path, budget: str, chunk: int | None):
    cmd = [*GRADSTEP, "train", "--model", f"hf:{model}", "--seq-len", str(args.cli_seq_len),
           "--micro-batch-size", "auto", "--global-batch", str(args.cli_global_batch),
           "--memory-budget", budget, "--max-steps", str(args.cli_steps),
           "--eval-batches", "1", "--sample-tokens", "0", "--log-every", "1",
           "--threads", str(args.threads), "--device", "cpu",
           "--out", str(run), "--overwrite"]  # fmt: skip
    return cmd if chunk is None else [*cmd, "--loss-chunk-tokens", str(chunk)]


def phases(lines: list, samples: list) -> dict:
    """The first evaluation (between the line before ``step 0: val_loss`` and it): its peak
    RSS; steps 1 to K-1 (from that line to the last step's line but one: the last step and
    the final evaluation print after both): their peak RSS, CPU and wall seconds."""
    marks = [i for i, (_, text) in enumerate(lines) if text.startswith("step 0:")]
    done = [t for t, text in lines if re.match(r"step (\d+)/(\d+) loss", text)]
    if not marks or len(done) < 2:
        return {}

    def inside(begin: float, end: float) -> list:
        return [x for x in samples if begin <= x[0] <= end] or [(0.0, 0, 0.0)]

    i = marks[0]
    steps = inside(lines[i][0], done[-2])
    return {
        "1st eval peak MiB": max(x[1] for x in inside(lines[i - 1][0], lines[i][0])) / MIB,
        "steps' peak MiB": max(x[1] for x in steps) / MIB,
        "cpu_s": steps[-1][2] - steps[0][2],
        "wall_s": steps[-1][0] - steps[0][0],
    }


def _flag(chunk: int | None) -> str:
    return "(default: planned)" if chunk is None else f"--loss-chunk-tokens {chunk}"


def train(args: argparse.Namespace, work: Path, vocab: int, chunk: int | None) -> dict:
    """One ``gradstep train`` run under the vocabulary's budget: the table's row."""
    model, budget = work / f"llama-{vocab}", dict(args.cli_budget)[vocab]
    if not model.exists():
        config = chunked_loss_hf.llama_config(vocab, args.cli_seq_len, args.d_model)
        config.save_pretrained(model)
    run = work / f"run-{vocab}-{chunk}"
    cmd = command(args, model, run, budget, chunk)
    start = time.perf_counter()
    lines, sampler = run_sampled(cmd, work / f"run-{vocab}-{chunk}.log", args.interval_ms)
    wall = time.perf_counter() - start
    plan = json.loads((run / "plan.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "step_time_s" in s]
    later = [s for s in steps if s["step"] >= 2] or steps
    seconds = sum(s["step_time_s"] for s in later)
    phase = phases(lines, sampler.samples)
    ran = plan.get("loss_chunk_tokens", 1024 if chunk is None else chunk)
    return {
        "vocab": vocab,
        "budget": budget,
        "flag": _flag(chunk),
        "loss run": "whole" if not ran else f"chunked {ran}",
        "micro-batch x accum": f"{plan['micro_batch_size']} x {plan['accum_steps']}",
        "ckpt": "on" if plan["activation_checkpointing"] else "off",
        "planned peak MiB": plan["predicted_peak_bytes"] / MIB,
        "run peak MiB": max(x[1] for x in sampler.samples) / MIB,
        "steps' peak MiB": phase.get("steps' peak MiB"),
        "1st eval peak MiB": phase.get("1st eval peak MiB"),
        "CLI peak_memory_mb": steps[-1].get("peak_memory_mb"),
        "trained tok/s, steps 2+": sum(s["items"] for s in later) / seconds,
        "processed tok/s, steps 2+": sum(s["processed_tokens"] for s in later) / seconds,
        "trained tok/CPU s, steps 1..K-1": (
            sum(s["items"] for s in steps[:-1]) / phase["cpu_s"] if phase else None
        ),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "wall s": wall,
        "trained tok/s (summary)": summary["train_tokens_per_s"],
        "steps 1..K-1 cpu_s, wall_s": [phase.get("cpu_s"), phase.get("wall_s")],
        "processes": len(sampler.pids),
        "command": " ".join(["gradstep", *cmd[len(GRADSTEP) :]]),
    }


def run_all(args: argparse.Namespace, work: Path, notes: list[str]) -> list[dict]:
    """The runs of ``--cli-losses`` per vocabulary, each retried ``--cli-tries`` times on
    failure."""
    rows = []
    for vocab in args.vocab:
        for chunk in args.cli_losses:
            for attempt in range(1, args.cli_tries + 1):
                try:
                    rows.append(train(args, work, vocab, chunk))
                    break
                except RuntimeError as exc:
                    notes.append(f"{time.strftime('%H:%M:%S')} try {attempt}: {exc}")
                    print(notes[-1], file=sys.stderr, flush=True)
                    if attempt == args.cli_tries:
                        raise
                    time.sleep(args.cli_retry_s)
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def loss_setting(text: str) -> int | None:
    """``--cli-losses``' values: N (``--loss-chunk-tokens N``) or ``default`` (no flag)."""
    return None if text == "default" else int(text)


def budgets(text: str) -> tuple[int, str]:
    vocab, _, budget = text.partition("=")
    return int(vocab), budget
