"""The memory budget for Hugging Face models, measured from outside the process (issue 21).

Each configuration is a locally built pretrained folder (``save_pretrained`` of a model of
one family with a tokenizer trained here, nothing downloaded) fine-tuned by a fresh
``gradstep train --model hf:DIR --micro-batch-size auto --global-batch N --memory-budget B``
on text or JSONL data (prompt/completion records of varying lengths), full fine-tuning or
LoRA, fp32 or bf16, one process or DDP on 2 gloo ranks; then the same plan given by hand
(``--micro-batch-size m [--activation-checkpointing]``, same budget). "measured" is the
highest ``VmRSS``/``VmHWM`` an independent sampler read from ``/proc/PID/status`` of the
run and its children every few ms (the largest rank; the torchrun launcher is not a
rank). "predicted" is the run's ``plan.json``: for the auto run the peak of its process,
probe included (``process_peak_bytes``); for the run by hand the plan's
(``predicted_peak_bytes``). Each budget is calibrated once (``--calibrate 1``: a plan with
an unlimited budget, then 1.02 x the target candidate's predicted peak with the 10%
margin) so that the choice is constrained, and stored below.

    .venv/bin/python bench/memory_hf.py                 # every configuration (~15 min)
    .venv/bin/python bench/memory_hf.py --only H1,H5    # some
    .venv/bin/python bench/memory.py --part hf          # the same, from the memory bench
Outputs: a markdown table on stdout, bench/out/memory_hf.json. Exit status 1 when a run
went over its budget or failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.support.hf_assets: the local tokenizer and configs

from memory_held_out import _ranks_peak, auto_then_by_hand, watched  # noqa: E402

MiB = 2**20
OUT = ROOT / "bench" / "out" / "memory_hf.json"
WORK = ROOT / "bench" / "out" / "memory-hf"
VOCAB = 8192
"""Model vocabulary (the local tokenizer uses its first 512 ids): a real model's output
layer and loss are a large part of its memory, and a 512-word one would hide them."""


@dataclass(frozen=True)
class HFCase:
    """One held-out HF configuration."""

    name: str
    family: str
    size: dict
    """Config overrides: layers, width, heads, MLP width, experts."""
    data: str
    """``text`` (stdlib sources, packed) or ``sft`` (prompt/completion JSONL)."""
    flags: tuple[str, ...]
    global_batch: int
    budget_mib: int
    target: tuple[int, bool]
    """(micro-batch, checkpointing) the budget is calibrated for."""
    seq_len: int = 256
    ranks: int = 1
    steps: int = 4
    extra: dict = field(default_factory=dict)


def _size(layers: int, width: int, heads: int, ff: int, kv: int | None = None) -> dict:
    out = {"num_hidden_layers": layers, "hidden_size": width, "num_attention_heads": heads}
    out |= {"intermediate_size": ff, "head_dim": width // heads}
    if kv is not None:
        out["num_key_value_heads"] = kv
    return out


LORA, BF16, DDP = ("--lora", "8"), ("--precision", "bf16"), ("--strategy", "ddp")
ALL = ("--lora-targets", "all-linear")
CASES = [
    HFCase("H1 llama L4 d256 full fp32 text", "llama", _size(4, 256, 8, 688, 4), "text",
           (), 16, 700, (4, False)),
    HFCase("H2 qwen2 L4 d256 LoRA bf16 sft", "qwen2", _size(4, 256, 8, 704, 2), "sft",
           (*LORA, *BF16), 32, 520, (8, False)),
    HFCase("H3 phi3 L6 d256 full bf16 text", "phi3", _size(6, 256, 8, 512), "text",
           BF16, 16, 760, (2, False)),
    HFCase("H4 gpt_neox L4 d384 LoRA fp32 sft", "gpt_neox", _size(4, 384, 6, 1536), "sft",
           LORA, 24, 560, (4, False)),
    HFCase("H5 opt L6 d256 full fp32 text DDPx2", "opt",
           {"num_hidden_layers": 6, "hidden_size": 256, "num_attention_heads": 8,
            "ffn_dim": 1024, "word_embed_proj_dim": 256, "max_position_embeddings": 512},
           "text", DDP, 16, 700, (2, False), ranks=2),
    HFCase("H6 qwen2_moe L4 d256 LoRA all-linear fp32 sft", "qwen2_moe",
           {**_size(4, 256, 8, 512, 4), "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 256, "shared_expert_intermediate_size": 512},
           "sft", (*LORA, *ALL), 24, 560, (4, False)),
    HFCase("H7 olmoe L4 d256 full bf16 text DDPx2", "olmoe",
           {**_size(4, 256, 8, 256, 8), "num_experts": 8, "num_experts_per_tok": 2},
           "text", (*BF16, *DDP), 16, 800, (2, True), ranks=2),
    HFCase("H8 llama L8 d384 LoRA bf16 sft DDPx2", "llama", _size(8, 384, 6, 1024, 2), "sft",
           (*LORA, *BF16, *DDP), 32, 560, (4, False), ranks=2),
    HFCase("H9 qwen2 L8 d256 s1024 full fp32 text, ckpt", "qwen2", _size(8, 256, 8, 704, 4),
           "text", (), 8, 700, (2, True), seq_len=1024),
]  # fmt: skip
RUN_FLAGS = ("--warmup", "1", "--eval-every", "0", "--eval-batches", "2", "--sample-tokens", "0",
             "--device", "cpu", "--log-every", "1", "--overwrite")  # fmt: skip


def model_folder(case: HFCase) -> Path:
    """``save_pretrained`` of the case's model (seed 0) with the local tokenizer, once."""
    from tests.memory.hf_saved import config
    from tests.support.hf_assets import load_tokenizer

    folder = WORK / "models" / case.name.split()[0]
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM

    size = {"max_position_embeddings": max(512, case.seq_len), **case.size}
    cfg = config(case.family, size.pop("num_hidden_layers"), vocab_size=VOCAB, **size)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    load_tokenizer().save_pretrained(folder)
    return folder


def _functions(text: str) -> list[tuple[str, str]]:
    """(signature line, body) of every top-level or method ``def`` in ``text``."""
    lines, out = text.splitlines(), []
    for i, line in enumerate(lines):
        stripped = line.lstrip()
        if not stripped.startswith("def ") or not stripped.rstrip().endswith(":"):
            continue
        indent, body = len(line) - len(stripped), []
        for nxt in lines[i + 1 : i + 40]:
            if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                break
            body.append(nxt)
        if body:
            out.append((line.strip() + "\n", "\n".join(body).rstrip() + "\n"))
    return out


def data(kind: str) -> Path:
    """``text``: a folder of stdlib sources; ``sft``: prompt/completion JSONL built from
    them (a function's signature -> its body: lengths vary from a line to a page)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))[:60]
    if kind == "text":
        folder = WORK / "text"
        if not folder.is_dir():
            folder.mkdir(parents=True)
            for path in files[:30]:
                (folder / path.name).write_text(path.read_text(errors="ignore"))
        return folder
    path = WORK / "sft.jsonl"
    if not path.is_file():
        pairs = [p for f in files for p in _functions(f.read_text(errors="ignore"))]
        random.Random(0).shuffle(pairs)
        lines = [json.dumps({"prompt": p, "completion": c}) for p, c in pairs[:3000]]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
    return path


def _launch(case: HFCase, command: str) -> list[str]:
    if case.ranks == 1:
        return [sys.executable, "-m", "gradstep", command]
    torchrun = str(Path(sys.executable).parent / "torchrun")
    return [torchrun, "--standalone", f"--nproc_per_node={case.ranks}", "-m", "gradstep", command]


def _flags(case: HFCase) -> list[str]:
    return ["--model", f"hf:{model_folder(case)}", "--data", str(data(case.data)),
            "--seq-len", str(case.seq_len), *case.flags]  # fmt: skip


def calibrate(case: HFCase) -> int:
    """A budget (MiB) for which ``case.target`` is about the largest candidate that fits."""
    cmd = [*_launch(case, "plan"), *_flags(case), "--global-batch", str(case.global_batch),
           "--memory-budget", "64GiB", "--device", "cpu", "--json"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    plan = json.loads(proc.stdout.strip().splitlines()[-1])
    key = ("micro_batch_size", "activation_checkpointing")
    (target,) = [c for c in plan["candidates"] if (c[key[0]], c[key[1]]) == case.target]
    return math.ceil(target["predicted_peak_bytes"] / (1 - 0.1) * 1.02 / MiB)


def analytic(case: HFCase, choice: dict) -> int | None:
    """What ``plan --no-probe`` (the analytic model alone, from the config) predicts for the
    plan the run chose, at the same budget (None: it predicts no such candidate)."""
    cmd = [*_launch(case, "plan"), *_flags(case), "--global-batch", str(case.global_batch),
           "--memory-budget", f"{case.budget_mib}MiB", "--device", "cpu", "--json",
           "--no-probe"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    plan = json.loads(proc.stdout.strip().splitlines()[-1])
    key = (choice["micro_batch_size"], choice["activation_checkpointing"])
    same = [c["predicted_peak_bytes"] for c in plan.get("candidates", [])
            if (c["micro_batch_size"], c["activation_checkpointing"]) == key]  # fmt: skip
    return same[0] if same else None


def run(case: HFCase, sample_ms: float, auto: dict | None = None) -> dict:
    """``train --micro-batch-size auto`` (or, given ``auto``, its choice by hand) under the
    sampler; the prediction is the run's plan.json."""
    out = WORK / "runs" / (case.name.split()[0] + ("-hand" if auto else "-auto"))
    if auto is None:
        batch = ["--micro-batch-size", "auto"]
    else:
        batch = ["--micro-batch-size", str(auto["micro_batch_size"])]
        batch += ["--activation-checkpointing"] if auto["activation_checkpointing"] else []
    cmd = [*_launch(case, "train"), *_flags(case), *RUN_FLAGS, *batch,
           "--global-batch", str(case.global_batch), "--memory-budget", f"{case.budget_mib}MiB",
           "--max-steps", str(case.steps), "--out", str(out)]  # fmt: skip
    start = time.perf_counter()
    proc, seen = watched(cmd, sample_ms)
    if proc.returncode != 0:
        return {"name": case.name, "error": proc.stderr.strip().splitlines()[-1][-300:]}
    plan = json.loads((out / "plan.json").read_text()) if auto is None else auto
    # Planning itself: the probe peaks in the auto run's process, not in the one by hand.
    predicted = plan["process_peak_bytes"] if auto is None else plan["predicted_peak_bytes"]
    own = [json.loads(line)["peak_memory_mb"] for line in (out / "metrics.jsonl").open()]
    peaks = _ranks_peak(seen, case.ranks)
    return {
        "name": case.name,
        "analytic": analytic(case, plan) if auto is not None else None,
        "budget": case.budget_mib * MiB,
        "micro_batch_size": plan["micro_batch_size"],
        "accum_steps": plan["accum_steps"],
        "activation_checkpointing": plan["activation_checkpointing"],
        "predicted": predicted,
        "predicted_peak_bytes": plan["predicted_peak_bytes"],
        "process_peak_bytes": plan.get("process_peak_bytes"),
        "width": plan.get("width"),
        "measured": peaks[0],
        "ranks": peaks,
        "own_peak_mb": own,
        "seconds": time.perf_counter() - start,
    }


def table(rows: list[dict]) -> str:
    out = [
        "| config | budget | plan (mbs x accum, ckpt) | predicted | measured (max rank) "
        "| error | under budget? | analytic alone (error) |",
        "|---|---:|---|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['name']} | | failed: {r['error']} | | | | | |")
            continue
        ckpt = "on" if r["activation_checkpointing"] else "off"
        alone = r.get("analytic")
        alone_text = f"{alone / MiB:.1f} ({alone / r['measured'] - 1:+.1%})" if alone else ""
        out.append(
            f"| {r['name']} | {r['budget'] / MiB:.0f} MiB | {r['micro_batch_size']} x "
            f"{r['accum_steps']}, {ckpt} | {r['predicted'] / MiB:.1f} | "
            f"{r['measured'] / MiB:.1f} | {r['predicted'] / r['measured'] - 1:+.1%} | "
            f"{'yes' if r['measured'] <= r['budget'] else '**NO**'} | {alone_text} |"
        )
    return "\n".join(out)


def held_out_hf(only: str, calibrated: bool, by_hand: bool, sample_ms: float) -> list[dict]:
    """Every case (or those ``only`` names): auto, then by hand; one row each."""
    return auto_then_by_hand(CASES, run, calibrate, only, calibrated, by_hand, sample_ms)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated case names (H1,H5,...)")
    ap.add_argument("--calibrate", type=int, default=0, help="1: re-derive each budget")
    ap.add_argument("--by-hand", type=int, default=1, help="0: skip the by-hand runs")
    ap.add_argument("--sample-ms", type=float, default=2.0)
    ns = ap.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    start = time.perf_counter()
    rows = held_out_hf(ns.only, bool(ns.calibrate), bool(ns.by_hand), ns.sample_ms)
    print("\n## HF models: predicted vs measured (independent RSS sampler)\n")
    print(table(rows))
    ok = [r for r in rows if "error" not in r]
    under = sum(r["measured"] <= r["budget"] for r in ok)
    errors = [r["predicted"] / r["measured"] - 1 for r in ok]
    if errors:
        print(f"\n{under} of {len(ok)} runs under budget, {len(rows) - len(ok)} failed; errors "
              f"{min(errors):+.1%} to {max(errors):+.1%}")  # fmt: skip
    out = OUT if not ns.only else OUT.with_name("memory_hf_some.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    cases = [asdict(c) for c in CASES]
    out.write_text(json.dumps({"cases": cases, "rows": rows,
                               "seconds": time.perf_counter() - start}, indent=1))  # fmt: skip
    print(f"hf: {time.perf_counter() - start:.0f}s; wrote {out.relative_to(ROOT)}")
    return 0 if ok and len(ok) == len(rows) and under == len(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
