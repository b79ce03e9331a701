"""How ``gradstep train`` lays the demo's model over the ranks: ``--strategy``, and with
``--strategy fsdp`` the 2-D meshes of ``--tp N`` and ``--hsdp R``.

- ``--tp N``: FSDP2 + tensor parallel on a ``(dp = W/N, tp = N)`` mesh. Each block of the
  demo GPT is split over the N tensor-parallel ranks: the attention's fused ``qkv``
  column-wise (whole heads per rank: the demo attention's ``qkv`` rows are head-major) and
  its ``proj`` row-wise, the MLP's ``fc`` column-wise and ``proj`` row-wise; the embedding,
  the norms and the tied head stay whole (sharded by FSDP2 over ``dp`` only). Rank ``r`` is
  data rank ``r // N``: the N ranks of a data rank read the same micro-batches.
- ``--hsdp R``: a ``(replicate = R, shard = W/R)`` mesh; every rank reads its own data.

The library builds both (:func:`gradstep.parallel.prepare_model`); this module holds what
is the demo's: the GPT's plan and which data each rank reads.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from gradstep import parallel
from gradstep_cli.config.settings import TrainConfig

__all__ = ["data_rank", "data_ranks_note", "gpt_tp_plan", "prepare"]


def gpt_tp_plan() -> dict[str, Any]:
    """The demo GPT's tensor-parallel plan for one block (paths relative to the block)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "attn.qkv": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(),
    }


def layout_of(cfg: TrainConfig) -> parallel.Layout:
    """The run's layout: ``--hsdp R`` replicas, ``--tp N`` tensor-parallel ranks."""
    return parallel.Layout(dp_replicate=cfg.hsdp, tp=cfg.tp)


def prepare(model: nn.Module, cfg: TrainConfig) -> nn.Module:
    """``model`` wrapped as the run lays it out (``--strategy``, ``--tp``, ``--hsdp``)."""
    layout = layout_of(cfg) if cfg.strategy == "fsdp" else None
    plan = gpt_tp_plan() if cfg.tp > 1 else None
    return parallel.prepare_model(model, cfg.strategy, cfg.precision, layout=layout, tp_plan=plan)


def data_rank(cfg: TrainConfig, rank: int, world: int) -> tuple[int, int]:
    """(this rank's data rank, the number of data ranks): ranks that read different data."""
    layout = layout_of(cfg)  # resolved (dp_size) only once preflight checked the sizes
    return layout.data_rank(rank), world // layout.tp


def data_ranks_note(cfg: TrainConfig, world: int) -> str | None:
    """A line saying how the ranks are laid out, for runs on a 2-D mesh."""
    if cfg.tp > 1:
        return (
            f"mesh: {world // cfg.tp} data-parallel x {cfg.tp} tensor-parallel ranks (FSDP2 + "
            "TP): the global batch is split over the data-parallel ranks"
        )
    if cfg.hsdp > 1:
        return (
            f"mesh: HSDP, {cfg.hsdp} replicas x {world // cfg.hsdp} shards: every rank reads "
            "its own data"
        )
    return None
