"""Rank functions for the HF multi-process tests (``run_ranks`` needs them importable)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

import gradstep
from gradstep import parallel
from gradstep.hf import causal_lm_loss, count_tokens
from tests.hf.helpers import grads_of, hf_batch, llama, lora, mixtral


def aux_grads(rank: int, world: int, micro_seqs: list) -> dict:
    """DDP Mixtral (float64): this rank's share of the window, gradients after the step."""
    model = parallel.prepare_model(mixtral(dtype=torch.float64), "ddp")
    stepper = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.0), clip=None)
    mine = [hf_batch(s) for s in micro_seqs[rank::world]]
    stats = stepper.step(mine, causal_lm_loss, count=count_tokens)
    grads = {k.removeprefix("module."): v for k, v in grads_of(model).items()}
    return {"grads": grads, "aux": stats.aux, "loss": stats.loss, "items": stats.items}


def _train(model, windows, rank, world, steps, ckpt=None, start=0):  # noqa: ANN001, ANN202
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))
    stepper = gradstep.Stepper(model, opt, sched, clip=gradstep.ClipNorm(0.5))
    if ckpt is not None and start:
        ckpt.load_latest(model=model, optimizer=opt, scheduler=sched, stepper=stepper)
    stats = []
    for step in range(start, steps):
        window = [hf_batch(s) for s in windows[step][rank::world]]
        stats.append(stepper.step(window, causal_lm_loss, count=count_tokens))
        if ckpt is not None and step + 1 == 2 and not start:
            ckpt.save(2, model=model, optimizer=opt, scheduler=sched, stepper=stepper)
    return stats


def _params(model) -> dict:  # noqa: ANN001
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.removeprefix("module.")] = t.detach().clone()
    return out


def strategies(rank: int, world: int, windows: list, folder: str) -> dict:
    """3 AdamW + ClipNorm steps of Llama under DDP and FSDP2, and a PEFT model under DDP
    checkpointed trainable_only (through DCP) at step 2 and resumed into fresh objects."""
    out = {}
    for strategy in ("ddp", "fsdp"):
        model = parallel.prepare_model(llama(dtype=torch.float64), strategy)
        stats = _train(model, windows, rank, world, 3)
        out[strategy] = {"params": _params(model), "norms": [s.grad_norm for s in stats]}
    ckpt = gradstep.Checkpointer(Path(folder), trainable_only=True)
    model = parallel.prepare_model(lora(llama(dtype=torch.float64)), "ddp")
    _train(model, windows, rank, world, 4, ckpt)
    straight = _params(model)
    fresh = parallel.prepare_model(lora(llama(dtype=torch.float64)), "ddp")
    _train(fresh, windows, rank, world, 4, ckpt, start=2)
    resumed = _params(fresh)
    out["resume_bitwise"] = all(torch.equal(straight[k], resumed[k]) for k in straight)
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(ckpt.latest().path / "dcp")).read_metadata()
    out["dcp_model_keys"] = [k for k in meta.state_dict_metadata if k.startswith("model.")]
    out["peft"] = straight
    return out


def single(windows: list, steps: int = 3) -> dict:
    """The one-process run the ranks must equal."""
    model = llama(dtype=torch.float64)
    stats = _train(model, windows, 0, 1, steps)
    peft = lora(llama(dtype=torch.float64))
    _train(peft, windows, 0, 1, 4)
    return {
        "params": _params(model),
        "norms": [s.grad_norm for s in stats],
        "peft": _params(copy.deepcopy(peft)),
    }
