"""The plan stage of ``gradstep train``: how each window is cut (:class:`BatchPlan`).

``--micro-batch-size auto`` is planned here (probed on the data stage's rows:
:func:`gradstep_cli.plan.planning.plan_for`); a fixed micro-batch size under a
``--memory-budget`` gets the analytic prediction said. Either way the result is the run's
settings with the split decided (micro-batch size, checkpointing, the loss's chunking
unless ``--loss-chunk-tokens`` is given, accumulation) and the window layout the run and
its checkpoints follow.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gradstep_cli.config.settings import TrainConfig
from gradstep_cli.data.batching import Layout, layout_for
from gradstep_cli.models.spec import ModelSpec
from gradstep_cli.plan import planning
from gradstep_cli.plan.budget import budget_notes

if TYPE_CHECKING:
    from gradstep_cli.data.load import Data
    from gradstep_cli.run.start import Checked

__all__ = ["BatchPlan", "plan_batch"]


@dataclass(frozen=True)
class BatchPlan:
    """How every window of the run is cut into micro-batches."""

    cfg: TrainConfig
    """The run's settings with the split decided: what config.json and checkpoints record."""
    layout: Layout
    planned: planning.Planned | None = None
    """The plan of ``--micro-batch-size auto`` (None: a fixed micro-batch size)."""
    notes: tuple[str, ...] = ()
    """The fixed choice against ``--memory-budget``, said once the run is built."""


def plan_batch(checked: Checked, data: Data, model: ModelSpec) -> BatchPlan:
    """The plan stage: the window layout of the checked settings on their launch."""
    cfg, launch = checked.cfg, checked.launch
    planned = None
    if cfg.auto_micro_batch:
        planned = planning.plan_for(cfg, launch, model, data.source, given=checked.given)
        if launch.is_main:
            _say_plan(planned)
        # The loss's chunking is only ever planned down to 0 (the whole logits), which the
        # run's loss computes from the logits whatever the model was built with.
        cfg = dataclasses.replace(
            cfg,
            micro_batch_size=planned.plan.micro_batch_size,
            activation_checkpointing=planned.plan.activation_checkpointing,
            loss_chunk_tokens=planned.plan.loss_chunk_tokens,
        )
    layout = layout_for(cfg, launch.data_ranks)
    notes: tuple[str, ...] = ()
    if planned is None:
        notes = tuple(budget_notes(model, launch.device, launch.world_size, layout))
    if cfg.global_batch is not None:  # config.json says how the batch is really split
        cfg = dataclasses.replace(cfg, accum_steps=layout.micro_batches)
    return BatchPlan(cfg, layout, planned, notes)


def _say_plan(planned: planning.Planned) -> None:
    """What the probe measured and the plan chose (rank 0)."""
    from tqdm.auto import tqdm

    if planned.probe is not None:
        tqdm.write(planned.probe.describe(), file=sys.stderr)
    tqdm.write(planned.plan.table(), file=sys.stderr)
