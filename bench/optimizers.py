"""LARS and LAMB (gradstep.optim): step time against timm, collectives under FSDP2, and a
short large-batch training comparison on the demo.

1. Step time, one process: ``gradstep.optim.LARS``/``LAMB`` against timm's ``Lars``/
   ``Lamb`` on the same model (the demo GPT) with the same gradients, ``optimizer.step()``
   only, interleaved (``_common.interleaved_times``); ratio = ours / timm. Needs timm:
   installed, or ``GRADSTEP_TIMM_SRC`` = a folder holding ``timm/optim`` (an unpacked
   wheel: ``pip download --no-deps timm`` then unzip; ``import timm`` needs torchvision,
   the two optimizer modules only torch). Skipped otherwise.
2. FSDP2, 2 gloo ranks: collectives per ``optimizer.step()`` (``CommDebugMode``), step
   time and the largest relative difference from one process after 5 steps, for ours (one
   batched all-reduce), a naive variant of ours (one all-reduce per parameter and norm),
   and timm's optimizers on the DTensors (DTensor reduces each norm itself).
3. The demo trainer (``gradstep train``) at a large batch, AdamW vs LAMB vs LARS with the
   same seed, data and schedule: final validation loss.

    GRADSTEP_TIMM_SRC=/tmp/timmlib .venv/bin/python bench/optimizers.py
    .venv/bin/python bench/optimizers.py --train-steps 0      # sections 1-2 only

Writes ``bench/out/optimizers.md`` and ``.json``. Not a test: nothing is asserted.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from _common import BaseConfig, interleaved_times, machine_info, ratio_stats, run_ranks
from gradstep.optim import LAMB, LARS
from gradstep.parallel import collectives, dtensor
from gradstep_cli.models.gpt import GPT, GPTConfig

OUT = Path(__file__).resolve().parent / "out"


def load_timm() -> Any:
    # tests/ is importable once _common has put the repository root on sys.path.
    from tests.optim.reference import load_timm as load

    return load()


@dataclass(frozen=True)
class Config(BaseConfig):
    d_model: int = 256
    n_layer: int = 4
    pairs: int = 30
    warmup: int = 5
    train_steps: int = 60
    train_d_model: int = 64
    global_batch: int = 256
    micro_batch_size: int = 32
    seq_len: int = 64
    lrs: tuple[str, ...] = ("adamw:3e-3", "lamb:1e-2", "lars:2.0")

    POSITIVE = ("d_model", "n_layer", "pairs", "global_batch", "micro_batch_size", "seq_len")
    HELP = {"lrs": "optimizer:peak-lr pairs for section 3", "train_steps": "0: skip section 3"}


OPTS: dict[str, dict[str, Any]] = {
    "lars": dict(lr=1.0, momentum=0.9, weight_decay=1e-4),
    "lamb": dict(lr=1e-3, weight_decay=0.01, max_grad_norm=None),
}


def _groups(model: torch.nn.Module, wd: float) -> list[dict[str, Any]]:
    ps = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in ps if p.ndim > 1], "weight_decay": wd},
        {"params": [p for p in ps if p.ndim <= 1], "weight_decay": 0.0},
    ]


def _make(kind: str, which: str, model: torch.nn.Module, timm: Any) -> torch.optim.Optimizer:
    hp = OPTS[kind]
    cls = {"lars": (LARS, timm and timm[0]), "lamb": (LAMB, timm and timm[1])}[kind]
    return (cls[0] if which == "ours" else cls[1])(_groups(model, hp["weight_decay"]), **hp)


def step_time(cfg: Config, timm: Any) -> list[dict[str, Any]]:
    """Section 1: ours / timm per optimizer.step(), same model and gradients."""
    if timm is None:
        return []
    torch.manual_seed(0)
    base = GPT(GPTConfig(n_layer=cfg.n_layer, n_head=4, d_model=cfg.d_model, max_seq_len=64))
    rows = []
    for kind in ("lars", "lamb"):
        models = {w: copy.deepcopy(base) for w in ("ours", "timm")}
        gen = torch.Generator().manual_seed(1)
        for p, q in zip(models["ours"].parameters(), models["timm"].parameters(), strict=True):
            p.grad = 1e-2 * torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        opts = {w: _make(kind, w, m, timm) for w, m in models.items()}
        times = interleaved_times(
            lambda i, o=opts["ours"]: o.step(), lambda i, o=opts["timm"]: o.step(),
            cfg.warmup, cfg.pairs,
        )  # fmt: skip
        stats = ratio_stats(times.wall_a, times.wall_b)
        diff = max(
            float((p - q).detach().norm() / q.detach().norm())
            for p, q in zip(models["ours"].parameters(), models["timm"].parameters(), strict=True)
        )
        rows.append({"optimizer": kind, **asdict(stats), "max_rel_diff": diff,
                     "parameters": sum(p.numel() for p in base.parameters()),
                     "tensors": len(list(base.parameters()))})  # fmt: skip
    return rows


def _naive_reduce(values: torch.Tensor, layouts: list) -> torch.Tensor:
    """The per-parameter baseline: one all_reduce per entry (what a loop over tensors does)."""
    out = values.clone()
    for i, layout in enumerate(layouts):
        for group in layout:
            out[i : i + 1] = collectives.all_reduce_sum(out[i : i + 1], group)
    return out


def fsdp_worker(rank: int, world: int, d_model: int, n_layer: int, timm_src: str) -> list[dict]:
    """Section 2 on each rank: every variant, 5 steps, against one process."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode

    if timm_src:
        os.environ["GRADSTEP_TIMM_SRC"] = timm_src
    timm = load_timm()
    torch.manual_seed(0)
    base = GPT(GPTConfig(n_layer=n_layer, n_head=4, d_model=d_model, max_seq_len=64))
    rows = []
    variants = ["ours", "naive"] + (["timm"] if timm else [])
    for kind in ("lars", "lamb"):
        for variant in variants:
            ref, sharded = copy.deepcopy(base), copy.deepcopy(base)
            for block in sharded.blocks:
                fully_shard(block)
            fully_shard(sharded)
            which = "timm" if variant == "timm" else "ours"
            o_ref, o_sh = _make(kind, which, ref, timm), _make(kind, which, sharded, timm)
            original = dtensor.reduce_over_shards
            if variant == "naive":
                dtensor.reduce_over_shards = _naive_reduce
            counts, secs = [], []
            gen = torch.Generator().manual_seed(1)
            for _ in range(5):
                for p, q in zip(ref.parameters(), sharded.parameters(), strict=True):
                    p.grad = 1e-2 * torch.randn(p.shape, generator=gen)
                    q.grad = torch.distributed.tensor.distribute_tensor(
                        p.grad, q.device_mesh, q.placements
                    )
                o_ref.step()
                t0 = time.perf_counter()
                with CommDebugMode() as mode:
                    o_sh.step()
                secs.append(time.perf_counter() - t0)
                counts.append(mode.get_total_counts())
            dtensor.reduce_over_shards = original
            diff = max(
                float((q.full_tensor() - p).detach().norm() / p.detach().norm())
                for p, q in zip(ref.parameters(), sharded.parameters(), strict=True)
            )
            rows.append({"optimizer": kind, "variant": variant, "collectives": max(counts),
                         "step_ms": 1e3 * sorted(secs)[len(secs) // 2],
                         "max_rel_diff_vs_one_process": diff})  # fmt: skip
    return rows


def training(cfg: Config) -> list[dict[str, Any]]:
    """Section 3: the demo at a large batch, one run per optimizer, same seed."""
    from gradstep_cli.config.settings import TrainConfig
    from gradstep_cli.train import train

    rows = []
    for spec in cfg.lrs:
        name, _, lr = spec.partition(":")
        with tempfile.TemporaryDirectory() as out:
            tc = TrainConfig(
                optimizer=name, lr=float(lr), min_lr=float(lr) / 10, n_layer=2, n_head=4,
                d_model=cfg.train_d_model, seq_len=cfg.seq_len, global_batch=cfg.global_batch,
                micro_batch_size=cfg.micro_batch_size, max_steps=cfg.train_steps,
                warmup=max(1, cfg.train_steps // 10), eval_every=0, eval_batches=8,
                sample_tokens=0, log_every=10**6, out=out, threads=0,
            )  # fmt: skip
            t0 = time.perf_counter()
            summary = train(tc)
        rows.append({"optimizer": name, "lr": float(lr), "steps": summary["steps"],
                     "initial_val_loss": summary["initial_val_loss"],
                     "final_val_loss": summary["final_val_loss"],
                     "final_train_loss": summary["final_train_loss"],
                     "clipped_steps": summary["clipped_steps"],
                     "wall_s": time.perf_counter() - t0})  # fmt: skip
    return rows


def _table(rows: list[dict[str, Any]], keys: list[str]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    cfg, _ = Config.parse(argv, Config.parser(__doc__))
    timm = load_timm()
    result: dict[str, Any] = {"config": asdict(cfg), "machine": machine_info()}
    md = [f"# LARS / LAMB benchmark\n\n{json.dumps(result['machine'])}\n"]
    result["step_time"] = step_time(cfg, timm)
    md.append("## 1. optimizer.step(), one process: ours / timm (interleaved, wall clock)\n")
    md.append(_table(result["step_time"], ["optimizer", "tensors", "parameters", "median_a_ms",
                     "median_b_ms", "median_ratio", "ci95_low", "ci95_high", "max_rel_diff"])
              if result["step_time"] else "timm not importable: skipped")  # fmt: skip
    print("\n".join(md), flush=True)
    src = os.environ.get("GRADSTEP_TIMM_SRC", "")
    ranks = run_ranks(fsdp_worker, 2, cfg.d_model, cfg.n_layer, src, timeout=600)
    result["fsdp2"] = ranks[0]
    part = ["\n## 2. FSDP2, 2 gloo ranks: per optimizer.step()\n",
            _table(ranks[0], ["optimizer", "variant", "collectives", "step_ms",
                              "max_rel_diff_vs_one_process"])]  # fmt: skip
    print("\n".join(part), flush=True)
    md += part
    if cfg.train_steps:
        result["training"] = training(cfg)
        keys = ["optimizer", "lr", "steps", "initial_val_loss", "final_val_loss",
                "final_train_loss", "clipped_steps", "wall_s"]  # fmt: skip
        title = (f"\n## 3. demo, global batch {cfg.global_batch} x {cfg.seq_len} bytes, "
                 f"{cfg.train_steps} steps, same seed\n")  # fmt: skip
        part = [title, _table(result["training"], keys)]
        print("\n".join(part), flush=True)
        md += part
    OUT.mkdir(exist_ok=True)
    (OUT / "optimizers.md").write_text("\n".join(md) + "\n")
    (OUT / "optimizers.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
