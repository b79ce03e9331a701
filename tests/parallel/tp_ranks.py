"""Rank side of test_tensor_parallel.py: FSDP2 + tensor parallel on a (dp=2, tp=2) mesh.

A small transformer with separate q/k/v/o projections and biases (so both Shard and
Replicate tensor-parallel placements occur), built the torchtitan way: the blocks
``parallelize_module``-d over ``mesh["tp"]``, then ``fully_shard`` per block and root
over ``mesh["dp"]``. Two plans: ``tp`` (blocks only: the embedding, norms and head stay on
the dp mesh alone, so the gradients live on two meshes) and ``tp+sp`` (sequence parallel:
every parameter on the 2-D mesh). The tensor-parallel peers of a dp rank get the same
micro-batches; the dp ranks get different ones, with different token counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.support.batches import Batch, collate, concat, make_windows, rows
from tests.support.models import TINY_GPT

DP, TP, K, STEPS = 2, 2, 2, 3
D, HEADS, HIDDEN, LAYERS, T = 8, 2, 16, 2, 16
MAX_NORM = 1e-2  # below every norm: the clip acts on every step
NORM_TYPES = (2.0, 1.0, math.inf)  # the clip's norm type on steps 1, 2, 3


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, hd = x.shape[0], x.shape[1], D // HEADS
        # -1 heads: under tensor parallelism a rank holds HEADS / tp of them.
        q, k, v = (f(x).view(b, t, -1, hd).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, HIDDEN), nn.Linear(HIDDEN, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = (
            nn.LayerNorm(D),
            Attention(),
            nn.LayerNorm(D),
            MLP(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(TINY_GPT.vocab_size, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, TINY_GPT.vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def model64() -> Model:
    torch.manual_seed(0)
    model = Model().double()
    with torch.no_grad():  # norms that are not ones and zeros
        for name, p in model.named_parameters():
            if ".ln" in name or name.startswith("norm"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def data(dp: int = DP) -> list[list[list[Batch]]]:
    """``data[step][dp_rank]``: K micro-batches padded to T columns (sequence parallel
    shards the sequence dim by tp)."""
    windows = make_windows(STEPS, dp, K, seed=3)
    return [[[collate(rows(mb), pad_to=T) for mb in w] for w in per_rank] for per_rank in windows]


def loss_sum(model: nn.Module, mb: Batch) -> Any:
    import gradstep

    logits = model(mb["input_ids"])
    labels = mb["labels"]
    total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    return gradstep.LossSum(total, int((labels != -100).sum()))


def optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.5, momentum=0.9, weight_decay=0.01)


def reference(
    opt_name: str,
    dp: int = DP,
    model: Callable[[], nn.Module] = model64,
    windows: list[list[list[Batch]]] | None = None,
) -> list[dict[str, Any]]:
    """The plain way, one process, float64: per step the full batch of every dp rank, loss
    = sum of token losses / their count, ``get_total_norm``, scale by min(1, max / (norm +
    1e-6)) (``clip_grad_norm_``'s coefficient, which ``ClipNorm`` uses), step. Per step:
    the loss, items, pre-clip norm, and the gradients and parameters after the step."""
    model = model()
    opt = optimizer(opt_name, model.parameters())
    out = []
    for step, per_rank in enumerate(data(dp) if windows is None else windows):
        batch = concat([mb for mbs in per_rank for mb in mbs])
        items = int((batch["labels"] != -100).sum())
        opt.zero_grad(set_to_none=True)
        loss = loss_sum(model, batch).total / items
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        norm = float(torch.nn.utils.get_total_norm(grads, NORM_TYPES[step]))
        coef = min(1.0, MAX_NORM / (norm + 1e-6))
        torch._foreach_mul_(grads, coef)
        opt.step()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        grads_ = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        out.append(
            {"loss": loss.item(), "items": items, "norm": norm, "params": params, "grads": grads_}
        )
    return out


def tp_plan(sp: bool = False) -> dict[str, Any]:
    """The blocks' tensor-parallel plan: q, k, v and the MLP's up column-wise, o and down
    row-wise (their outputs sequence-sharded with ``sp``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out = Shard(1) if sp else Replicate()
    return {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.o": RowwiseParallel(output_layouts=out),
        "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(output_layouts=out),
    }


def build(sp: bool) -> tuple[nn.Module, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    model = model64()
    plan = tp_plan(sp)
    if sp:
        to_whole = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        )
        plan |= {
            "ln1": SequenceParallel(),
            "ln2": SequenceParallel(),
            "attn": to_whole,
            "mlp": to_whole,
        }
        parallelize_module(model, mesh["tp"], {
            "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        })  # fmt: skip
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], plan)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def tp_run(rank: int, world: int, sp: bool, opt_name: str, with_count: bool) -> dict[str, Any]:
    """STEPS gradstep steps on the 2-D mesh; per step the stats and the full parameters."""
    import gradstep

    model, mesh = build(sp)
    stepper = gradstep.Stepper(model, optimizer(opt_name, model.parameters()))
    dp_rank = mesh["dp"].get_local_rank()
    out: dict[str, Any] = {"strategy": type(stepper.strategy).__name__, "steps": []}
    out |= {"world_size": stepper.world_size, "divisor": stepper.strategy.grad_divisor}
    for step, per_rank in enumerate(data()):
        stepper.clip = gradstep.ClipNorm(MAX_NORM, norm_type=NORM_TYPES[step])
        count = (lambda mb: int((mb["labels"] != -100).sum())) if with_count else None
        stats = stepper.step(per_rank[dp_rank], loss_sum, count=count)
        params = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
        grads = {n: _full(p.grad).detach().clone() for n, p in model.named_parameters()}
        out["steps"].append({"stats": stats, "params": params, "grads": grads})
    # A tensor-parallel peer passing one micro-batch more: every rank raises, none hangs.
    window = per_rank[dp_rank] + (per_rank[dp_rank][:1] if rank == 1 else [])
    try:
        stepper.step(window, loss_sum, count=count)
        out["mismatch"] = None
    except RuntimeError as exc:
        out["mismatch"] = str(exc)
    return out


def hsdp_run(rank: int, world: int, in_backward: bool) -> dict[str, Any]:
    """HSDP, the multi-node layout: a (replicate=2, shard=2) mesh, every rank its own data
    (4 data-parallel ranks), AdamW; the norm taken in backward or after it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import gradstep

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = model64()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = optimizer("adamw", model.parameters())
    stepper = gradstep.Stepper(model, opt, norm_in_backward=in_backward)
    out: dict[str, Any] = {"strategy": type(stepper.strategy).__name__, "steps": []}
    out |= {"world_size": stepper.world_size, "in_backward": stepper.norm_in_backward}
    for step, per_rank in enumerate(data(world)):
        stepper.clip = gradstep.ClipNorm(MAX_NORM, norm_type=NORM_TYPES[step])
        stats = stepper.step(per_rank[rank], loss_sum)
        params = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
        grads = {n: _full(p.grad).detach().clone() for n, p in model.named_parameters()}
        out["steps"].append({"stats": stats, "params": params, "grads": grads})
    return out


def _user_3d() -> nn.Module:
    """HSDP + tensor parallel built with torch's own APIs: a (dp_replicate=2, dp_shard=2,
    tp=2) mesh, the blocks parallelized over ``mesh["tp"]``, then ``fully_shard`` per block
    and root over ``mesh["dp_replicate", "dp_shard"]``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    names = ("dp_replicate", "dp_shard", "tp")
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=names)
    model = model64()
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], tp_plan())
        fully_shard(block, mesh=mesh["dp_replicate", "dp_shard"])
    fully_shard(model, mesh=mesh["dp_replicate", "dp_shard"])
    return model


def _prepared_3d() -> nn.Module:
    """The same layout through ``prepare_model(model, "fsdp", layout=...)``."""
    from gradstep.parallel import Layout, prepare_model

    layout = Layout(dp_replicate=2, dp_shard=2, tp=2)
    return prepare_model(model64(), "fsdp", layout=layout, tp_plan=tp_plan())


def hsdp_tp_run(rank: int, world: int) -> dict[str, Any]:
    """HSDP + tensor parallel on 8 ranks, built by a user (a) and by ``prepare_model`` (b):
    STEPS steps each (AdamW, the clip acting with norm types 2, 1, inf), a plain
    ``Stepper(model, optimizer)``; per step the stats, full gradients and parameters."""
    import gradstep
    from gradstep.checkpoint.elastic import data_parallel_size
    from gradstep.parallel import Layout

    out: dict[str, Any] = {}
    windows = data(world // TP)
    for name, make in (("user", _user_3d), ("prepared", _prepared_3d)):
        model = make()
        stepper = gradstep.Stepper(model, optimizer("adamw", model.parameters()))
        got: dict[str, Any] = {"strategy": type(stepper.strategy).__name__, "steps": []}
        got |= {"world_size": stepper.world_size, "divisor": stepper.strategy.grad_divisor}
        got |= {"layout": Layout.of(model), "dp_size": data_parallel_size(model, world)}
        got["dims"] = {n: p.device_mesh.mesh_dim_names for n, p in model.named_parameters()}
        data_rank = Layout.of(model).data_rank(rank)
        for step, per_rank in enumerate(windows):
            stepper.clip = gradstep.ClipNorm(MAX_NORM, norm_type=NORM_TYPES[step])
            stats = stepper.step(per_rank[data_rank], loss_sum)
            params = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
            grads = {n: _full(p.grad).detach().clone() for n, p in model.named_parameters()}
            got["steps"].append({"stats": stats, "params": params, "grads": grads})
        out[name] = got
    return out


def check_steps(rank: int, steps: list[dict], ref: list[dict], exact: float = 1e-12) -> None:
    """Each step's stats, and the parameters (and gradients, where recorded) after it,
    against :func:`reference`: to ``exact``, with the clip acting."""
    import pytest

    for step, (got, want) in enumerate(zip(steps, ref, strict=True)):
        stats, where = got["stats"], (rank, step)
        assert stats.items == want["items"], where
        assert stats.loss == pytest.approx(want["loss"], rel=exact), where
        assert stats.grad_norm == pytest.approx(want["norm"], rel=exact), where
        assert stats.clipped and stats.clip_coef < 1, where
        for key in ("grads", "params"):
            for name in want[key] if key in got else ():
                torch.testing.assert_close(
                    got[key][name], want[key][name], rtol=exact, atol=exact, msg=str(where)
                )
