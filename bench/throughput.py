"""Throughput: gradstep packed / unpacked, chunked loss / not, compiled / not, against TRL's
SFTTrainer (its padded default, and its packing), on the fine-tuning walk's job (issue 31 §5).

Same model, tokenizer, records, epochs, learning rate and schedule on every run
(``throughput_data.py``: nothing downloaded):

* the model: the walk's Llama shape (hidden 192, 4 layers, 6 heads / 2 KV, MLP 512,
  vocabulary 2,048) at ``max_position_embeddings = --seq-len``, pretrained here from random
  weights (``gradstep train --init random`` + ``export``); both sides fine-tune its export;
* ``walk``: the walk's SFT records (a function's ``def`` + docstring -> its body, at most 192
  tokens: a third of the positions of random micro-batches of 4 are padding);
* ``tail``: a long-tailed length distribution at ``--seq-len`` 1024 (log-normal token
  lengths, most short, a few near 1024; lines of the same corpus).

Runs (``--tail-variants``, ``--walk-variants``): gradstep through its CLI (``padded``: a
record a row, micro-batches padded to their longest, the default; ``packed``: ``--packing``;
``compiled``: ``--compile``; ``unchunked``: ``--loss-chunk-tokens 0``, else the default
chunking; ``mask``, a diagnostic: packed rows through sdpa's 4-D block-causal mask, the
CLI's segment attention switched off by the timing hook: the attention ``--compile`` runs,
so the compile speed-up is also read against the same attention), TRL through
``finetune_trl_worker.py`` in its own venv (``trl-padded``: its default; ``trl-packed``:
``packing=True``, its ``bfd`` strategy, which makes batches padding-free: sequences told
apart by ``position_ids`` only, so under ``sdpa`` on CPU they attend to each other:
reported, marked "not exact (leaks)"). Unpacked runs take ``--micro-batch`` x ``--accum``
records a step on both sides; packed runs one row of ``--seq-len`` a micro-batch, as many
rows a step as hold about the unpacked step's tokens. The main pair (``gs-packed`` and
``trl-padded`` on ``tail``) runs with every seed of ``--seeds``: their spread is the seed
noise the validation losses are compared against.

Measured per run (``throughput_runs.py`` has the definitions): real (non-pad) tokens per
second of process CPU time in the optimizer steps (and per wall second), the first step
left out; padding fraction (pad positions / all positions); peak RSS of the training
process (an independent ``/proc`` sampler); validation loss of the exported model
(``finetune_data.scored_loss``: float64, each held-out record alone); MFU = (6 N + 12 l h q
t) FLOPs a real token x tokens/s / the fp32 matmul peak measured in this run.

Run: ``nice -n 10 .venv/bin/python bench/throughput.py`` (about 30 minutes on 2 shared
cores), ``--quick`` (a few minutes), ``--reuse-pretrained`` (keep the base and records).
Writes bench/out/throughput.md and .json; logs and run folders under bench/out/throughput/.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import finetune_data as fd
import finetune_trl as ft
import throughput_data as td
import throughput_report as tr
import throughput_runs as rn
from _common import OUT, BaseConfig, machine_info, write_outputs

VARIANTS = ("trl-padded", "gs-padded", "gs-packed", "gs-packed-compiled", "gs-packed-mask",
            "gs-packed-unchunked", "trl-packed", "gs-padded-compiled")  # fmt: skip


@dataclass(frozen=True)
class Config(BaseConfig):
    hidden: int = 192
    layers: int = 4
    heads: int = 6
    kv_heads: int = 2
    intermediate: int = 512
    vocab: int = 2048
    seq_len: int = 1024
    pretrain_seq_len: int = 256
    pretrain_steps: int = 60
    pretrain_micro_batch: int = 8
    pretrain_accum: int = 2
    pretrain_lr: float = 3e-3
    walk_max_tokens: int = 192
    walk_train: int = 320
    walk_val: int = 64
    tail_train: int = 384
    tail_val: int = 64
    tail_median: float = 128.0
    tail_sigma: float = 1.0
    epochs: float = 1.0
    walk_epochs: float = 2.0
    micro_batch: int = 4
    accum: int = 4
    lr: float = 5e-4
    warmup: float = 0.1
    seeds: str = "0,1,2"
    tail_variants: str = ",".join(VARIANTS[:7])
    walk_variants: str = "trl-padded,gs-padded,gs-packed"
    threads: int = 1
    sample_ms: float = 20.0
    trl_python: str = "/work/trlvenv/bin/python"
    POSITIVE = ("hidden", "layers", "heads", "vocab", "seq_len", "pretrain_steps",
                "walk_train", "walk_val", "tail_train", "tail_val", "micro_batch", "accum",
                "threads")  # fmt: skip
    HELP = {
        "tail_variants": f"runs on the long-tailed set, of: {', '.join(VARIANTS)}",
        "walk_variants": "runs on the walk's records (the same names)",
        "seeds": "seeds of the main pair (gs-packed, trl-padded on tail); others: the first",
        "tail_median": "median token length of the long-tailed records (log-normal)",
        "tail_sigma": "log-normal sigma of the long-tailed records' lengths",
        "epochs": "epochs of the long-tailed set's runs",
        "walk_epochs": "epochs of the walk's records' runs (the walk's 2)",
        "walk_max_tokens": "the walk's records: at most this many tokens (the walk's 192)",
        "trl_python": "the interpreter of a venv with trl, datasets, peft",
    }

    def check(self) -> None:
        for name in (self.tail_variants, self.walk_variants):
            bad = {v.strip() for v in name.split(",") if v.strip()} - set(VARIANTS)
            if bad:
                raise ValueError(f"variants are {', '.join(VARIANTS)}, got {', '.join(bad)}")

    def seed_list(self) -> list[int]:
        return [int(s) for s in self.seeds.split(",") if s.strip()]


QUICK = dict(pretrain_steps=10, walk_epochs=1.0, walk_train=64, walk_val=16, tail_train=48,
             tail_val=16, seeds="0", tail_variants="trl-padded,gs-padded,gs-packed",
             walk_variants="gs-packed")  # fmt: skip


def variant(key: str, data: str, seed: int) -> rn.Variant:
    side = "TRL" if key.startswith("trl") else "gradstep"
    return rn.Variant(side=side, data=data, packed="packed" in key, compiled="compiled" in key,
                      chunk=0 if "unchunked" in key else None, seed=seed, masked="mask" in key,
                      trl_packing="bfd" if key == "trl-packed" else None)  # fmt: skip


def plan(cfg: Config) -> list[rn.Variant]:
    """Run order: the main pair on ``tail`` seed by seed (sides alternating), then the other
    ``tail`` runs, then ``walk``'s."""
    seeds = cfg.seed_list()
    order: list[rn.Variant] = []
    for data, keys in (("tail", cfg.tail_variants), ("walk", cfg.walk_variants)):
        keys_ = [k.strip() for k in keys.split(",") if k.strip()]
        main = [k for k in ("trl-padded", "gs-packed") if k in keys_]
        for i, seed in enumerate(seeds if data == "tail" else seeds[:1]):
            order += [variant(k, data, seed) for k in (main if i % 2 == 0 else main[::-1])]
        order += [variant(k, data, seeds[0]) for k in keys_ if k not in main]
    return order


def base_model(cfg: Config, work: Path, env: dict, reuse: bool) -> dict:
    """The records and the pretrained base (``finetune_trl.pretrain`` at --pretrain-seq-len)."""
    data_json = work / "data.json"
    if reuse and data_json.exists() and (work / "pretrained").exists():
        return json.loads(data_json.read_text())
    data = td.prepare(cfg, work)
    pre_cfg = SimpleNamespace(**{**asdict(cfg), "seq_len": cfg.pretrain_seq_len})
    data["pretrain"] = ft.pretrain(pre_cfg, work, Path(data["base"]), env)
    data_json.write_text(json.dumps(data, default=str))
    return data


def run_all(cfg: Config, work: Path, data: dict, env: dict) -> list[dict]:
    model = work / "pretrained"
    for files in data["sets"].values():
        rn.warm_store(cfg, work, model, files, env)
    runs = []
    for v in plan(cfg):
        files = data["sets"][v.data]
        go = rn.run_trl if v.side == "TRL" else rn.run_gradstep
        print(f"run {v.name}", file=sys.stderr, flush=True)
        try:
            runs.append(go(cfg, work, model, files, v, env))
        except RuntimeError as exc:  # reported, not hidden: the table says it failed
            print(f"  FAILED: {str(exc)[-1500:]}", file=sys.stderr, flush=True)
            runs.append({"variant": v, "failed": str(exc)[-3000:]})
    return runs


def evaluate(cfg: Config, work: Path, data: dict, runs: list[dict]) -> dict[str, dict]:
    """Every exported model (and the base, ``base:SET``) through one evaluator: float64,
    each held-out record of its set alone (``finetune_data.scored_loss``)."""
    import torch

    torch.set_num_threads(cfg.threads)
    sets = data["sets"]
    evals = {f"base:{k}": fd.scored_loss(work / "pretrained", s["val_encoded"])
             for k, s in sets.items()}  # fmt: skip
    for r in runs:
        if "failed" not in r:
            val = sets[r["variant"].data]["val_encoded"]
            evals[r["variant"].name] = fd.scored_loss(Path(r["export"]), val)
    return evals


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = Config.parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="a smoke run (a few minutes)")
    ap.add_argument("--tag", default="", help="suffix of the output files (throughput-TAG.md)")
    ap.add_argument("--reuse-pretrained", action="store_true",
                    help="keep an earlier run's base model and records")  # fmt: skip
    if "--quick" in argv:
        ap.set_defaults(**QUICK)
    cfg, ns = Config.parse(argv, ap)
    name = "throughput-quick" if ns.quick else "throughput"
    name = f"{name}-{ns.tag}" if ns.tag else name
    work = OUT / ("throughput-quick" if ns.quick else "throughput")
    for sub in ("logs", "hook"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    (work / "hook" / "sitecustomize.py").write_text(rn.HOOK)
    started, load = time.perf_counter(), [os.getloadavg()[0]]
    env = {**ft.base_env(cfg, work), "GRADSTEP_CACHE": str(work / "gradstep-cache")}
    peaks = [rn.matmul_peak(cfg.threads)]
    data = base_model(cfg, work, env, ns.reuse_pretrained)
    runs = run_all(cfg, work, data, env)
    peaks.append(rn.matmul_peak(cfg.threads))
    load.append(os.getloadavg()[0])
    evals = evaluate(cfg, work, data, runs)
    shape = rn.model_shape(work / "pretrained")
    sdpa = rn.sdpa_cost(cfg.threads, shape, cfg.micro_batch, cfg.seq_len)
    context = {"machine": machine_info(), "loadavg": load, "date": time.strftime("%Y-%m-%d"),
               "versions": ft.versions(cfg), "peaks": peaks, "shape": shape, "sdpa": sdpa,
               "pretrain": data["pretrain"], "command": " ".join(["bench/throughput.py", *argv]),
               "sets": {k: {"train": s["train_stats"], "val": s["val_stats"]}
                        for k, s in data["sets"].items()},
               "bench_wall_s": time.perf_counter() - started}  # fmt: skip
    lengths = {k: s["train_lengths"] for k, s in data["sets"].items()}
    out = tr.report(cfg, context, runs, evals, lengths)
    write_outputs(name, out["text"], out["result"])
    print(f"bench wall time {time.perf_counter() - started:.0f}s", file=sys.stderr)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
