"""``gradstep train``: a Hugging Face causal LM or the toy GPT, trained with the exact
accumulate-and-clip step.

:func:`train` reads as its pipeline: the launch, then five stages, each built once and
handed on, then the loop.

=========  =======================================  ==============================
stage      value                                    module
=========  =======================================  ==============================
checks     :class:`~.run.start.Checked`: settings   :mod:`gradstep_cli.run.start`
           checked, run folder claimed, checkpoint
           to resume, an hf: model's config.json
data       :class:`~.data.load.Data`: tokenizer,    :mod:`gradstep_cli.data.load`
           the data read and tokenized
model      :class:`~.models.spec.ModelSpec`         :mod:`gradstep_cli.models.spec`
plan       :class:`~.plan.batch.BatchPlan`:         :mod:`gradstep_cli.plan.batch`
           micro-batch size, accumulation,
           checkpointing, the window layout
run        :class:`~.run.build.Run`: the model      :mod:`gradstep_cli.run.build`
           built, optimizer, Stepper, schedule,
           checkpointer, this rank's data
=========  =======================================  ==============================

The loop (:mod:`gradstep_cli.run.loop`) consumes the run. Outputs in the run folder:

* ``config.json``   the resolved :class:`~gradstep_cli.config.settings.TrainConfig`;
* ``metrics.jsonl`` one JSON object per optimizer step, written by
  :class:`~gradstep.metrics.MetricsLogger` (every ``StepStats`` field, plus ``tokens_per_s``,
  ``step_time_s``, ``peak_memory_mb``, ``elapsed_s`` and ``val_loss`` on evaluation steps);
* ``tensorboard/``  the same scalars as TensorBoard events, with ``--tensorboard``;
* ``summary.json``  effective batch, initial/final losses, clip/skip counts, wall time and
  a generated sample;
* ``plan.json``     with ``--micro-batch-size auto``: the plan and what the probe measured;
* ``checkpoints/``  with ``--save-every N``: ``step-N`` folders (:mod:`gradstep.checkpoint`);
  ``--resume`` continues the newest valid one, ``metrics.jsonl`` cut back to its step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from gradstep_cli.config.settings import TrainConfig
from gradstep_cli.data.load import load_data
from gradstep_cli.models.spec import resolve_model
from gradstep_cli.plan.batch import plan_batch
from gradstep_cli.run.build import build_run
from gradstep_cli.run.components import build_optimizer, loss_for
from gradstep_cli.run.evaluation import LMLoss, evaluate
from gradstep_cli.run.launch import launched
from gradstep_cli.run.loop import run_loop
from gradstep_cli.run.schedule import WarmupCosine
from gradstep_cli.run.start import check_train, given_fields

__all__ = ["LMLoss", "WarmupCosine", "build_optimizer", "evaluate", "loss_for", "train"]


def train(
    cfg: TrainConfig,
    callbacks: Sequence[Callable[[dict[str, Any]], Any]] = (),
    given: Iterable[str] | None = None,
) -> dict[str, Any]:
    """Train the model as configured; write the run folder and return the summary.

    ``callbacks`` are called (on rank 0) with every step's metrics record, see
    :class:`~gradstep.metrics.MetricsLogger`: e.g. to forward them to another tracker.
    ``given`` names the settings the caller set on purpose (the CLI: flags and config-file
    keys); on a resume those are checked against the checkpoint's, the others take the
    checkpoint's values (see :mod:`gradstep_cli.run.folder`). None: every setting that
    differs from its default counts as given, except automatic ones left as None (e.g. the
    warm-up, which follows max_steps).

    Under torchrun (``--strategy ddp|fsdp``) every rank runs this; the process group is
    created here (unless the caller made one) and closed at the end; only rank 0 prints
    and writes the run folder.
    """
    started = time.perf_counter()
    given = given_fields(cfg) if given is None else frozenset(given)
    # Rank 0 holds the run folder's lock until the run is done.
    with launched(cfg) as launch, contextlib.ExitStack() as folder:
        checked = check_train(cfg, launch, given, folder)
        data = load_data(checked)
        model = resolve_model(checked)
        plan = plan_batch(checked, data, model)
        run = build_run(checked, data, model, plan)
        return run_loop(run, started, callbacks)
