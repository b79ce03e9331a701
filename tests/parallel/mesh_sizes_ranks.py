"""Rank side of test_mesh_sizes.py: ``prepare_model(model, "fsdp", layout=Layout(tp=N) |
Layout(dp_replicate=R))`` on meshes whose two sizes differ, trained by a plain
``Stepper(model, optimizer)``.

The model, data, optimizer, clip and per-step record are tests/parallel/layout_ranks.py's
(the demo GPT in float64 with 4 heads and the demo's own tensor-parallel plan, AdamW,
``ClipNorm`` below every norm with norm types 2 then 1); only the mesh differs:

- 2 ranks: FSDP2 + TP on (dp_shard=1, tp=2), HSDP on (dp_replicate=2, dp_shard=1);
- 4 ranks: FSDP2 + TP on (dp_shard=1, tp=4) (one head per rank), HSDP on (dp_replicate=4,
  dp_shard=1).

(dp_shard=2, tp=2) and (dp_replicate=2, dp_shard=2) are test_prepare_layouts.py's.

After its steps each layout is saved by a plain ``Checkpointer`` (no ``dp_size`` given: it
reads the data-parallel ranks off the model) into ``folder/NAME``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gradstep.parallel import Layout
from tests.parallel import layout_ranks as lr

STEPS = 2
ROWS = 2
"""``micro_batch_size`` given to the Checkpointer: the manifest's global batch is
``K x data-parallel ranks x ROWS``."""


def layouts(world: int) -> dict[str, Layout]:
    """The layouts run on ``world`` ranks, by name: the whole world tensor parallel, and
    every rank its own replica."""
    return {f"tp{world}": Layout(tp=world), f"hsdp{world}": Layout(dp_replicate=world)}


def data_ranks(layout: Layout, world: int) -> int:
    """Ranks that read different data: the world over tp (HSDP: every rank)."""
    return layout.resolve(world).dp_size


def mesh_sizes_run(rank: int, world: int, folder: str) -> dict[str, Any]:
    """Each layout of :func:`layouts`: STEPS steps, every step's stats and parameters, then
    a checkpoint of the model in ``folder/NAME``."""
    from gradstep import Checkpointer
    from gradstep.parallel import prepare_model
    from gradstep_cli.models.parallel_plan import gpt_tp_plan

    out = {}
    for name, layout in layouts(world).items():
        plan = gpt_tp_plan() if layout.tp > 1 else None
        model = prepare_model(lr.gpt64(), "fsdp", layout=layout, tp_plan=plan)
        dp = data_ranks(layout, world)
        data_rank = layout.data_rank(rank)  # the mesh is row-major, tp innermost
        windows = [per_rank[data_rank] for per_rank in lr.data(dp)[:STEPS]]
        out[name] = lr._train(model, windows)
        Checkpointer(Path(folder, name), accum_steps=lr.K, micro_batch_size=ROWS).save(
            STEPS, model=model
        )
    return out
