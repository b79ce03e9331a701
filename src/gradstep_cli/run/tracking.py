"""The trackers of a ``gradstep train`` run: ``--report-to tensorboard,wandb,mlflow`` (and the
older ``--tensorboard``), logged to by :class:`gradstep.metrics.MetricsLogger` on rank 0.

A W&B or MLflow run is named after the run folder and gets the run's settings as its
config / params. Their run ids are kept in ``OUT/trackers.json``, so a resumed run logs on
into the same tracker runs (its steps continue where the checkpoint's stopped).
"""

from __future__ import annotations

import json
from typing import Any

from gradstep.metrics import MetricsLogger
from gradstep_cli.config.evaluation import trackers_of

__all__ = ["TRACKERS_FILE", "logger_options", "remember_trackers"]

TRACKERS_FILE = "trackers.json"


def logger_options(run: Any) -> dict[str, Any]:
    """MetricsLogger's tracker arguments for this rank (the others log nowhere)."""
    cfg = run.cfg
    if not run.is_main:
        return {"tensorboard": False}
    ids = {}
    if run.start:
        try:
            ids = json.loads((run.out / TRACKERS_FILE).read_text())
        except (OSError, ValueError):
            ids = {}
    return {
        "report_to": trackers_of(cfg.report_to or "", cfg.tensorboard),
        "run_name": run.out.resolve().name,
        "run_config": cfg.to_dict(),
        "tracker_ids": ids if isinstance(ids, dict) else {},
    }


def remember_trackers(run: Any, logger: MetricsLogger) -> None:
    """``OUT/trackers.json``: the tracker runs this run logs to (none: no file)."""
    ids = logger.tracker_ids()
    if ids:
        (run.out / TRACKERS_FILE).write_text(json.dumps(ids) + "\n")
