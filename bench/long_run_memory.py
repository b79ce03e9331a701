"""Resident memory over a long fine-tuning run, and how long ``gradstep plan`` takes, on the
fine-tuning walk's model (shared/reviews/finetune-walk-3.md: a 2.6M-parameter Llama, 4
layers of width 192, MLP 512, 4 heads, tied embeddings, vocabulary 4096; SFT records of
stdlib functions at --seq-len 256; micro-batch 4 x 4 accumulation; AdamW, warm-up 8, cosine).

The walk saw ``peak_memory_mb`` creep +11% from step 1 to 80. Each variant here runs
``gradstep train`` for ``--steps`` steps in a fresh process and reads ``rss_mb`` (the resident
set after each step) and ``peak_memory_mb`` (its high-water mark) from ``metrics.jsonl``:

* ``default``: the run as the walk ran it;
* ``budget``: with ``--memory-budget`` (the run then pins glibc's mmap threshold and bounds
  oneDNN's kernel caches, ``gradstep_cli.plan.budget.settle_process``);
* ``env-mmap``: the default run with glibc's threshold pinned from outside
  (``MALLOC_MMAP_THRESHOLD_``), to tell glibc's share of the creep from gradstep's.

``--plan`` also times ``gradstep plan`` with the walk's budget (650 MiB, --global-batch 16).
Nothing is downloaded: the model is randomly initialised and saved as a pretrained folder,
its tokenizer trained on the default corpus (bench/finetune_data.py).

    python bench/long_run_memory.py --steps 300 --plan 1
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import finetune_data as fd
from _common import BaseConfig, machine_info, markdown_table, write_outputs

SHAPE = dict(vocab=4096, hidden=192, intermediate=512, layers=4, heads=4, kv_heads=4)
VARIANTS = {
    "default": ([], {}),
    "budget": (["--memory-budget", "4GiB"], {}),
    "env-mmap": ([], {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}),
}
AT = (1, 10, 50, 80, 100, 200, 300, 500, 1000)


@dataclass(frozen=True)
class Config(BaseConfig):
    steps: int = 300
    variants: str = "default,budget,env-mmap"
    plan: int = 0
    work: str = "runs/long_run_memory"
    seq_len: int = 256
    val_pairs: int = 61
    POSITIVE = ("steps", "seq_len", "val_pairs")
    HELP = {
        "variants": f"comma-separated, of: {', '.join(VARIANTS)}",
        "plan": "1: also time gradstep plan",
    }


def assets(cfg: Config) -> dict:
    """The walk's base folder (with weights: fine-tuning) and its SFT records, built once."""
    work = Path(cfg.work)
    done = work / "assets.json"
    if done.exists():
        return json.loads(done.read_text())
    work.mkdir(parents=True, exist_ok=True)
    shape = SimpleNamespace(**SHAPE, seq_len=cfg.seq_len, val_pairs=cfg.val_pairs)
    made = fd.prepare(shape, work)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(made["base"]))
    config.tie_word_embeddings = True
    AutoModelForCausalLM.from_config(config).save_pretrained(str(made["base"]))
    out = {k: str(made[k]) for k in ("base", "train_jsonl", "val_jsonl")}
    done.write_text(json.dumps(out))
    return out


def train_args(paths: dict, steps: int, out: Path) -> list[str]:
    return [
        "--model", f"hf:{paths['base']}", "--data", paths["train_jsonl"],
        "--val-data", paths["val_jsonl"], "--seq-len", "256", "--micro-batch-size", "4",
        "--accum-steps", "4", "--max-steps", str(steps), "--lr", "5e-4", "--min-lr", "0",
        "--warmup", "8", "--lr-schedule", "cosine", "--weight-decay", "0",
        "--clip", "norm:1.0", "--eval-every", "0", "--sample-tokens", "0",
        "--log-every", "50", "--out", str(out), "--overwrite",
    ]  # fmt: skip


def run_variant(cfg: Config, paths: dict, name: str) -> dict:
    flags, env = VARIANTS[name]
    out = Path(cfg.work) / f"run-{name}"
    cmd = [sys.executable, "-m", "gradstep", "train", *train_args(paths, cfg.steps, out), *flags]
    started = time.perf_counter()
    subprocess.run(cmd, check=True, env={**os.environ, **env}, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    row: dict = {"variant": name, "wall_s": round(time.perf_counter() - started, 1)}
    for step in (s for s in AT if s <= len(rows)):
        r = rows[step - 1]
        row[f"rss@{step}"] = round(r["rss_mb"], 1)
        row[f"peak@{step}"] = round(r["peak_memory_mb"], 1)
    first, last = rows[0]["peak_memory_mb"], rows[-1]["peak_memory_mb"]
    row["peak growth %"] = round(100 * (last / first - 1), 1)
    row["rss growth % (10 -> end)"] = round(100 * (rows[-1]["rss_mb"] / rows[9]["rss_mb"] - 1), 1)
    return row


def time_plan(paths: dict) -> dict:
    cmd = [
        sys.executable, "-m", "gradstep", "plan", "--model", f"hf:{paths['base']}",
        "--data", paths["train_jsonl"], "--val-data", paths["val_jsonl"], "--seq-len", "256",
        "--global-batch", "16", "--memory-budget", "650MiB", "--json",
    ]  # fmt: skip
    started = time.perf_counter()
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
    planned = json.loads(proc.stdout)
    return {
        "plan_wall_s": round(time.perf_counter() - started, 1),
        "probe_s": planned.get("probe", {}).get("seconds"),
        "micro_batch_size": planned.get("micro_batch_size"),
        "stderr_tail": proc.stderr.strip().splitlines()[-3:],
    }


def main() -> None:
    description = "RSS over a long fine-tuning run; gradstep plan's time"
    cfg, _ = Config.parse(None, Config.parser(description))
    paths = assets(cfg)
    rows = [run_variant(cfg, paths, v.strip()) for v in cfg.variants.split(",") if v.strip()]
    result = {"machine": machine_info(), "config": cfg.__dict__, "runs": rows}
    text = markdown_table(rows)
    if cfg.plan:
        result["plan"] = time_plan(paths)
        text += f"\n\ngradstep plan: {json.dumps(result['plan'])}\n"
    print(text)
    write_outputs("long_run_memory", text, result)


if __name__ == "__main__":
    main()
