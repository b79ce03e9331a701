"""``prepare_model(model, "fsdp", layout=Layout(tp=N), tp_plan=...)`` and
``prepare_model(model, "fsdp", layout=Layout(dp_replicate=R))`` build layouts a plain
``gradstep.Stepper(model, optimizer)`` detects and keeps exact: on 4 gloo ranks
(tests/parallel/layout_ranks.py), the demo GPT in float64 with the demo's tensor-parallel
plan on a (dp_shard=2, tp=2) mesh, and with HSDP on a (dp_replicate=2, dp_shard=2) mesh,
equals one process over 3 steps (clip active, norm types 2, 1 and inf, unequal token counts
per data rank) to 1e-12, each rank holds the parameters the memory model
(``estimate_step_memory(layout=...)``) counts for it, and ``Layout.of`` reads the layout
back. On the same ranks, what only a launched world can refuse: sizes that do not divide 4,
a plan key naming no module (the model left untouched)."""

from __future__ import annotations

import pytest
import torch

from gradstep.parallel import Layout
from tests.parallel import layout_ranks as lr
from tests.parallel.tp_ranks import check_steps
from tests.support.multiproc import run_ranks

pytestmark = pytest.mark.distributed

EXACT = 1e-12
WORLD = 4


def test_prepare_model_builds_tp_and_hsdp_layouts_that_train_exactly() -> None:
    ranks = run_ranks(lr.layouts_run, WORLD, timeout=300)
    tp_ref, hsdp_ref = lr.reference(WORLD // lr.TP), lr.reference(WORLD)
    for rank, res in enumerate(ranks):
        tp, hsdp = res["tp"], res["hsdp"]
        assert (tp["strategy"], tp["world_size"]) == ("FSDP2TPStrategy", WORLD // lr.TP), rank
        assert (hsdp["strategy"], hsdp["world_size"]) == ("FSDP2Strategy", WORLD), rank
        assert hsdp["replicas"] == lr.HSDP, rank
        assert tp["layout"] == Layout(dp_shard=WORLD // lr.TP, tp=lr.TP), rank
        assert hsdp["layout"] == Layout(dp_replicate=lr.HSDP, dp_shard=WORLD // lr.HSDP), rank
        assert tp["local_numel"] == _modelled(tp["layout"]), rank
        assert hsdp["local_numel"] == _modelled(hsdp["layout"]), rank
        check_steps(rank, tp["steps"], tp_ref, EXACT)
        check_steps(rank, hsdp["steps"], hsdp_ref, EXACT)
        refused = res["refused"]
        fits = "tp=3 must divide the number of ranks (4), dp_shard=-1 taking the rest: one of 1, 2"
        assert fits in refused["tp3"]
        assert "dp_replicate=3 must divide the number of ranks (4)" in refused["hsdp3"]
        assert (
            "tp_plan key 'attn.q_proj' names no module of the block Block" in (refused["no_module"])
        )
        assert all(r.endswith("untouched=True") for r in refused.values()), refused


def _modelled(layout: Layout) -> int:
    """The parameters per rank ``gradstep.memory`` predicts for the layout (float64)."""
    from gradstep.memory import estimate_step_memory
    from gradstep_cli.plan.estimate import gpt_shape

    est = estimate_step_memory(
        gpt_shape(lr.GPT4),
        1,
        param_dtype=torch.float64,
        world_size=WORLD,
        sharded=True,
        layout=layout,
    )
    return est.params // 8
