"""Rank side of test_prepare_layouts.py: what ``prepare_model(model, "fsdp",
layout=Layout(tp=2), tp_plan=...)`` and ``prepare_model(model, "fsdp",
layout=Layout(dp_replicate=2))`` build on 4 gloo ranks, trained by a plain ``Stepper(model,
optimizer)``, and what they refuse.

The model is the demo GPT in float64 with the demo's own tensor-parallel plan
(``gradstep_cli.models.parallel_plan.gpt_tp_plan``: fused qkv column-wise, whole heads per
rank, attention and MLP projections row-wise), 4 heads so that each tensor-parallel rank
holds 2 of them.
"""

from __future__ import annotations

from typing import Any

import torch

from gradstep.parallel import Layout
from gradstep_cli.models.gpt import GPT, GPTConfig
from tests.parallel.tp_ranks import MAX_NORM, NORM_TYPES, loss_sum, optimizer
from tests.parallel.tp_ranks import reference as tp_reference
from tests.support.batches import make_windows

GPT4 = GPTConfig(vocab_size=32, n_layer=2, n_head=4, d_model=16, max_seq_len=16)
STEPS, K, TP, HSDP = 3, 2, 2, 2


def gpt64() -> GPT:
    torch.manual_seed(7)
    model = GPT(GPT4).double()
    with torch.no_grad():  # norms that are not ones and zeros
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def data(dp: int) -> list[list[list[dict]]]:
    """``data[step][data rank]``: K micro-batches, token counts unequal across data ranks."""
    return make_windows(STEPS, dp, K, seed=5)


def reference(dp: int) -> list[dict[str, Any]]:
    """One process, float64, the plain way (:func:`tests.parallel.tp_ranks.reference`) on
    the demo GPT and this module's data, AdamW."""
    return tp_reference("adamw", dp, model=gpt64, windows=data(dp))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train(model: torch.nn.Module, windows: list[list[dict]]) -> dict[str, Any]:
    import gradstep

    stepper = gradstep.Stepper(model, optimizer("adamw", model.parameters()))
    out: dict[str, Any] = {"strategy": type(stepper.strategy).__name__, "steps": []}
    # What this rank holds: the memory model's per-rank parameter count is checked on it.
    out["local_numel"] = sum(p.to_local().numel() for p in model.parameters())
    out["layout"] = Layout.of(model)
    out |= {"world_size": stepper.world_size, "replicas": stepper.strategy.replicas}
    for step, window in enumerate(windows):
        stepper.clip = gradstep.ClipNorm(MAX_NORM, norm_type=NORM_TYPES[step])
        stats = stepper.step(window, loss_sum)
        params = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
        out["steps"].append({"stats": stats, "params": params})
    return out


def _refusals() -> dict[str, str]:
    """What prepare_model refuses on 4 ranks, and whether the refused model was left as
    it was (no parameter turned into a DTensor)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel

    from gradstep.parallel import prepare_model
    from gradstep_cli.models.parallel_plan import gpt_tp_plan

    cases = {
        "tp3": {"layout": Layout(tp=3), "tp_plan": gpt_tp_plan()},
        "hsdp3": {"layout": Layout(dp_replicate=3)},
        "no_module": {
            "layout": Layout(tp=2),
            "tp_plan": {**gpt_tp_plan(), "attn.q_proj": ColwiseParallel()},
        },
    }
    out = {}
    for name, kwargs in cases.items():
        model = gpt64()
        try:
            prepare_model(model, "fsdp", **kwargs)
            out[name] = "accepted"
        except ValueError as exc:
            untouched = not any(isinstance(p, DTensor) for p in model.parameters())
            out[name] = f"{exc} | untouched={untouched}"
    return out


def layouts_run(rank: int, world: int) -> dict[str, Any]:
    """FSDP2 + TP on (dp_shard=2, tp=2), then HSDP on (dp_replicate=2, dp_shard=2), then
    refusals."""
    from gradstep.parallel import prepare_model
    from gradstep_cli.models.parallel_plan import gpt_tp_plan

    tp_model = prepare_model(gpt64(), "fsdp", layout=Layout(tp=TP), tp_plan=gpt_tp_plan())
    dp_rank = rank // TP  # the mesh is (dp_shard, tp), row-major
    out = {"tp": _train(tp_model, [per_rank[dp_rank] for per_rank in data(world // TP)])}
    hsdp_model = prepare_model(gpt64(), "fsdp", layout=Layout(dp_replicate=HSDP))
    out["hsdp"] = _train(hsdp_model, [per_rank[rank] for per_rank in data(world)])
    out["refused"] = _refusals()
    return out


def factorizations(world: int) -> list[Layout]:
    """Every layout of ``world`` ranks: dp_replicate x dp_shard x tp, each a divisor."""
    sizes = [n for n in range(1, world + 1) if world % n == 0]
    return [
        Layout(dp_replicate=r, dp_shard=world // (r * t), tp=t)
        for r in sizes
        for t in sizes
        if world % (r * t) == 0
    ]


def round_trip_run(rank: int, world: int) -> dict[str, Any]:
    """Each layout of :func:`factorizations` built by ``prepare_model`` on the tiny model of
    tests/parallel/tp_ranks.py (no step: reading back needs none), then DDP: what
    ``Layout.of``, the checkpoints' ``data_parallel_size``, the mesh's dim names and the
    detected strategy say."""
    from gradstep.checkpoint.elastic import data_parallel_size
    from gradstep.parallel import prepare_model, strategy_for
    from tests.parallel.tp_ranks import model64, tp_plan

    out: dict[str, Any] = {}
    for layout in factorizations(world):
        plan = tp_plan() if layout.tp > 1 else None
        model = prepare_model(model64(), "fsdp", layout=layout, tp_plan=plan)
        strategy = strategy_for(model)
        out[repr(layout)] = {
            "of": Layout.of(model),
            "dp_size": data_parallel_size(model, world),
            "dims": {p.device_mesh.mesh_dim_names for p in model.parameters()},
            "strategy": (type(strategy).__name__, strategy.world_size),
        }
    ddp = prepare_model(model64(), "ddp")
    out["ddp"] = {"of": Layout.of(ddp), "dp_size": data_parallel_size(ddp, world)}
    return out
