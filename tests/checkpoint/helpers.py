"""Shared pieces of tests/checkpoint/test_checkpoint.py and test_restore.py: a tiny run, exact
comparisons and :class:`Blob`.

``build()`` returns every stateful object of a run by the names the Checkpointer gets
(model, optimizer, scheduler, stepper, data), with dropout on so the RNG state matters,
two optimizer groups and a warmup + cosine schedule, like ``gradstep train``.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch

import gradstep
from gradstep_cli.data.sources import Document, TrainBatches
from gradstep_cli.models.gpt import GPT, GPTConfig
from gradstep_cli.train import LMLoss, WarmupCosine

SEQ = 16
MICRO = 2
LR = 1e-2
WARMUP = 3
MAX_STEPS = 12
CPU = torch.device("cpu")


def docs(n: int = 6, size: int = 200, seed: int = 0) -> list[Document]:
    """Printable random bytes: a corpus small enough that a test run crosses epochs."""
    rng = random.Random(seed)
    return [Document(f"doc{i}", bytes(rng.choices(range(32, 127), k=size))) for i in range(n)]


def model_config(**overrides: Any) -> GPTConfig:
    base = {"n_layer": 1, "n_head": 2, "d_model": 16, "max_seq_len": SEQ, "dropout": 0.1}
    return GPTConfig(**{**base, **overrides})


def build(
    precision: str = "fp32",
    rank: int = 0,
    world: int = 1,
    clip: Any = None,
    strategy: str = "none",
    **model_overrides: Any,
) -> dict[str, Any]:
    """Fresh objects of a run; the same initial weights every time (fixed seed)."""
    import gradstep.parallel as gd

    torch.manual_seed(1234)
    model = gd.prepare_model(GPT(model_config(**model_overrides)), strategy)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=LR,
    )
    schedule = WarmupCosine(WARMUP, MAX_STEPS, 0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    stepper = gradstep.Stepper(
        model,
        optimizer,
        scheduler,
        clip=gradstep.ClipNorm(0.5) if clip is None else clip,
        precision=precision,
    )
    data = TrainBatches(docs(), SEQ, MICRO, seed=7, rank=rank, world_size=world)
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "stepper": stepper,
        "data": data,
    }


def train(run: dict[str, Any], steps: int, k: int = 2) -> list[gradstep.StepStats]:
    return [
        run["stepper"].step([next(run["data"]) for _ in range(k)], LMLoss(CPU))
        for _ in range(steps)
    ]


def scramble_rng(seed: int = 999) -> None:
    """Move every global RNG away from where a checkpoint left it."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def snapshot_run(run: dict[str, Any]) -> dict[str, Any]:
    """Deep copies of everything a resume must restore, for bitwise comparisons."""
    model, optimizer = run["model"], run["optimizer"]
    names = {id(p): n for n, p in model.named_parameters()}
    optim_state = {
        names[id(p)]: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
        for p, s in optimizer.state.items()
    }
    return {
        "params": {n: t.detach().clone() for n, t in model.state_dict().items()},
        "optim": optim_state,
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "objects": {
            name: repr(run[name].state_dict()) for name in ("scheduler", "stepper", "data")
        },
        "rng": (repr(random.getstate()), torch.get_rng_state().clone()),
    }


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Bitwise: every parameter, every optimizer tensor, hyperparameters, objects, RNG."""
    assert a["params"].keys() == b["params"].keys()
    for name, t in a["params"].items():
        assert torch.equal(t, b["params"][name]), f"parameter {name} differs"
    assert a["optim"].keys() == b["optim"].keys()
    for name, state in a["optim"].items():
        assert state.keys() == b["optim"][name].keys()
        for key, v in state.items():
            w = b["optim"][name][key]
            assert torch.equal(v, w) if torch.is_tensor(v) else v == w, f"optim {name}.{key}"
    assert a["groups"] == b["groups"]
    assert a["objects"] == b["objects"]
    assert a["rng"][0] == b["rng"][0] and torch.equal(a["rng"][1], b["rng"][1])


def batch_id(batch: dict[str, torch.Tensor]) -> str:
    """A micro-batch's identity: the hash of its contents."""
    digest = hashlib.sha256(batch["input_ids"].numpy().tobytes())
    digest.update(batch["labels"].numpy().tobytes())
    return digest.hexdigest()[:16]


# ------------------------------------------------------------------ elastic (2 -> 1 -> 2)


class Recorder:
    """A data iterator that remembers which micro-batches it handed out."""

    def __init__(self, inner: TrainBatches) -> None:
        self.inner = inner
        self.seen: list[str] = []

    def __next__(self) -> dict[str, torch.Tensor]:
        batch = next(self.inner)
        self.seen.append(batch_id(batch))
        return batch

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


def full_state(run: dict[str, Any]) -> dict[str, Any]:
    """Whole model and optimizer state (FSDP2 shards gathered), names without wrappers."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    if not run["optimizer"].state:
        # get_state_dict would initialise a fresh optimizer with a zero-lr step (AdamW at
        # step 1 afterwards): exactly the trap the Checkpointer avoids.
        model = get_model_state_dict(run["model"], options=options)
        optim = {"state": {}, "param_groups": run["optimizer"].state_dict()["param_groups"]}
    else:
        model, optim = get_state_dict(run["model"], run["optimizer"], options=options)
    return {
        "params": {k: v.detach().clone() for k, v in model.items()},
        "optim": {
            name: {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
            for name, state in optim["state"].items()
        },
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in optim["param_groups"]],
        "objects": {n: repr(run[n].state_dict()) for n in ("scheduler", "stepper")},
    }


def assert_same_full_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["params"].keys() == b["params"].keys() and a["optim"].keys() == b["optim"].keys()
    for name, t in a["params"].items():
        assert torch.equal(t, b["params"][name]), f"parameter {name} differs"
    for name, state in a["optim"].items():
        for key, v in state.items():
            w = b["optim"][name][key]
            assert torch.equal(v, w) if torch.is_tensor(v) else v == w, f"optim {name}.{key}"
    assert a["groups"] == b["groups"], (a["groups"], b["groups"])
    assert a["objects"] == b["objects"], (a["objects"], b["objects"])


def elastic_phase(
    rank: int,
    world: int,
    directory: str,
    strategy: str,
    steps: int,
    saved_accum: int,
) -> dict[str, Any]:
    """One leg of an elastic run on ``world`` ranks: resume the newest checkpoint in
    ``directory`` (if any) with the accumulation that keeps the global batch, train
    ``steps`` steps, save. Returns the state right after loading and at the end, the
    micro-batches each step consumed, and k."""
    from gradstep.checkpoint import Checkpointer

    run = build(rank=rank, world=world, strategy=strategy, dropout=0.0)
    run["data"] = Recorder(run["data"])
    probe = Checkpointer(directory)
    info = probe.latest()
    k = saved_accum if info is None else info.accum_steps_for(world)
    checkpointer = Checkpointer(directory, accum_steps=k, micro_batch_size=MICRO)
    start = 0 if info is None else checkpointer.load(info, **run)
    restored = full_state(run)
    per_step = []
    for _ in range(steps):
        before = len(run["data"].seen)
        train(run, 1, k)
        per_step.append(run["data"].seen[before:])
    final = full_state(run)
    checkpointer.save(start + steps, **run)
    return {"k": k, "start": start, "restored": restored, "final": final, "seen": per_step}


def elastic_phase_then_rewrap(rank: int, world: int, directory: str, other: str, steps: int):
    """An elastic leg on FSDP2, then: its DCP checkpoint loaded into a DDP model on the same
    ranks (2 -> 2, other wrapping) must restore the same state; that model saves again
    (DDP through DCP) into ``other``."""
    from gradstep.checkpoint import Checkpointer

    result = elastic_phase(rank, world, directory, "fsdp", steps, 0)
    ddp = build(rank=rank, world=world, strategy="ddp", dropout=0.0)
    step = Checkpointer(directory).load_latest(**ddp)
    result["ddp_restored"] = full_state(ddp)
    Checkpointer(other, accum_steps=result["k"]).save(step, **ddp)
    return result


class Blob:
    """An object whose state exercises every encoding the manifest supports."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state
