"""Child process of the disk-full tests: saves that hit a real file-size limit (EFBIG).

    python -m tests.checkpoint.full_disk_child DIR   -> [{case}, ...] as JSON on the last line

(from the repo root; it imports nothing of the test suite, only gradstep). For each case a
checkpoint of step 1 is saved without a limit, then ``RLIMIT_FSIZE`` is lowered so that one
chosen file of the step-2 save is larger than the limit (SIGXFSZ ignored, so the write
fails with EFBIG instead of killing the process), and the limit is lifted again. Each case
reports what the failed save raised and what a fresh loader then finds. A last case makes
the checkpoint folder read-only instead.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
from pathlib import Path

import torch
from torch import nn

from gradstep.checkpoint import Checkpointer

# case name: (the file expected to hit the limit, model width, optimizer?, rng?, limit bytes)
CASES = {
    "model.safetensors": (100, True, True, 30_000),
    "optimizer.safetensors": (100, True, True, 60_000),
    "rng-rank00000.json": (4, False, True, 10_000),
    "manifest.json": (4, False, False, 400),
}


def _build(width: int, with_optimizer: bool) -> dict:
    torch.manual_seed(0)
    model = nn.Linear(width, width)
    objects: dict = {"model": model}
    if with_optimizer:
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.randn(3, width)).square().sum().backward()
        opt.step()
        objects["optimizer"] = opt
    return objects


def _state(model: nn.Module) -> list[list[float]]:
    return [p.detach().flatten().tolist() for p in model.parameters()]


def run_case(directory: Path, width: int, with_optimizer: bool, rng: bool, limit: int) -> dict:
    objects = _build(width, with_optimizer)
    ckpt = Checkpointer(directory, keep=2, rng=rng)
    ckpt.save(1, **objects)
    saved = _state(objects["model"])
    with torch.no_grad():
        for p in objects["model"].parameters():
            p.add_(1.0)  # step 2 differs from step 1
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        ckpt.save(2, **objects)
        error = None
    except Exception as exc:  # noqa: BLE001 - the type is what the test checks
        error = {
            "type": type(exc).__name__,
            "mro": [c.__name__ for c in type(exc).__mro__],
            "message": str(exc),
            "filename": getattr(exc, "filename", None),
        }
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    fresh = _build(width, with_optimizer)
    loaded = Checkpointer(directory, keep=2, rng=rng).load_latest(**fresh)
    return {
        "error": error,
        "listing": sorted(os.listdir(directory)),
        "loaded": loaded,
        "loaded_equals_step_1": _state(fresh["model"]) == saved,
    }


def read_only_case(directory: Path) -> dict:
    """The checkpoint folder made read-only between two saves (robustness row N120). Root
    bypasses the mode: the test starts this process without that capability (setpriv)."""
    model = nn.Linear(4, 4)
    ckpt = Checkpointer(directory, keep=2)
    ckpt.save(1, model=model)
    directory.chmod(0o555)
    try:
        ckpt.save(2, model=model)
        error = None
    except Exception as exc:  # noqa: BLE001 - the type is what the test checks
        error = {"type": type(exc).__name__, "message": str(exc), "filename": exc.filename}
    finally:
        directory.chmod(0o755)
    loaded = Checkpointer(directory).latest()
    return {
        "error": error,
        "listing": sorted(os.listdir(directory)),
        "loaded": None if loaded is None else loaded.step,
    }


def main() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # Python ignores it already; be explicit
    root = Path(sys.argv[1])
    out = {}
    for name, (width, with_optimizer, rng, limit) in CASES.items():
        out[name] = run_case(root / name, width, with_optimizer, rng, limit)
    out["read-only"] = read_only_case(root / "read-only")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
