"""What atomic, verified checkpoints cost: gradstep.Checkpointer vs a plain torch.save.

    .venv/bin/python bench/checkpoint.py [--reps 7] [--d-model 192] [--n-layer 4]

The demo GPT (default size) after one AdamW step, on CPU. Baseline, measured in the same
run and interleaved: ``torch.save`` of the model and optimizer state dicts to one file,
fsynced (what a careful hand-written loop does, without atomic rename or checksums), and
``torch.load`` + ``load_state_dict``. gradstep: ``Checkpointer.save`` of the same objects
plus a Stepper, scheduler and RNG (safetensors, JSON manifest, sha256 of every file, fsync,
rename, prune) and ``Checkpointer.load_latest`` (verifies every checksum, then loads).
Prints medians and the ratios as a markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import gradstep
from _common import lm_loss
from gradstep.checkpoint import Checkpointer
from gradstep_cli.models.gpt import GPT, GPTConfig


def _setup(d_model: int, n_layer: int) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(d_model=d_model, n_layer=n_layer, max_seq_len=128))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    stepper = gradstep.Stepper(model, optimizer, scheduler)
    ids = torch.randint(0, 256, (4, 128))
    stepper.step([{"input_ids": ids, "labels": ids}], lm_loss)
    return {"model": model, "optimizer": optimizer, "stepper": stepper}


def _torch_save(path: Path, run: dict) -> None:
    state = {"model": run["model"].state_dict(), "optim": run["optimizer"].state_dict()}
    with open(path, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())


def _torch_load(path: Path, run: dict) -> None:
    state = torch.load(path, weights_only=True)
    run["model"].load_state_dict(state["model"])
    run["optimizer"].load_state_dict(state["optim"])


def _time(fn, *args, **kwargs) -> float:
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--d-model", type=int, default=192)
    parser.add_argument("--n-layer", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    run = _setup(args.d_model, args.n_layer)
    times: dict[str, list[float]] = {k: [] for k in ("ts", "gs", "tl", "gl")}
    with tempfile.TemporaryDirectory() as tmp:
        plain, checkpointer = Path(tmp, "plain.pt"), Checkpointer(Path(tmp, "ckpt"), keep=2)
        for rep in range(args.reps):  # interleaved, so drift in machine load hits both
            times["ts"].append(_time(_torch_save, plain, run))
            times["gs"].append(_time(checkpointer.save, rep, **run))
            times["tl"].append(_time(_torch_load, plain, run))
            times["gl"].append(_time(checkpointer.load_latest, **run))
        size_plain = plain.stat().st_size
        folder = checkpointer.checkpoints()[0]
        size_ckpt = sum(p.stat().st_size for p in folder.iterdir())
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    params = sum(p.numel() for p in run["model"].parameters())
    print(f"demo GPT d_model={args.d_model} n_layer={args.n_layer}: {params:,} parameters, "
          f"AdamW state; median of {args.reps}, 1 CPU thread")  # fmt: skip
    print("| operation | torch.save/load (ms) | Checkpointer (ms) | ratio |")
    print("|---|---:|---:|---:|")
    print(f"| save | {med['ts']:.1f} | {med['gs']:.1f} | {med['gs'] / med['ts']:.2f} |")
    print(f"| load | {med['tl']:.1f} | {med['gl']:.1f} | {med['gl'] / med['tl']:.2f} |")
    print(f"| size (MB) | {size_plain / 1e6:.2f} | {size_ckpt / 1e6:.2f} | "
          f"{size_ckpt / size_plain:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
