"""Experiment trackers as metrics sinks: Weights & Biases and MLflow, through their own
libraries, which gradstep never needs (``pip install 'gradstep[wandb]'`` / ``'gradstep[mlflow]'``).

Each sink takes the records :class:`~gradstep.metrics.MetricsLogger` builds and logs their
numeric fields under the TensorBoard tags (``train/loss``, ``val/loss``, ``grad/norm_pre_clip``,
...: :data:`TENSORBOARD_TAGS`), at the window index as the step, so the three
trackers show the same curves as ``metrics.jsonl``. Where a tracker logs to is its own
library's business, set the usual way: ``WANDB_MODE=offline``, ``WANDB_DIR``,
``WANDB_PROJECT``; ``MLFLOW_TRACKING_URI`` (MLflow 3 refuses its ``file:`` store unless
``MLFLOW_ALLOW_FILE_STORE=true``), ``MLFLOW_EXPERIMENT_NAME``.

``run_id`` continues a tracker run (a resumed training run); :attr:`run_id` says which run
a sink logs to.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .errors import GradstepError

__all__ = [
    "TENSORBOARD_TAGS",
    "TRACKERS",
    "MLflowSink",
    "TrackerError",
    "WandbSink",
    "scalars",
    "tracker_sinks",
]

# Record keys written to TensorBoard (the logger's own sink) and to W&B and MLflow, and their
# tags. Booleans become 0/1 so clip and skip events are visible as curves; strings and lists
# (skip_reason, policies) stay in the JSON. Defined here so that metrics imports trackers and
# never the reverse.
TENSORBOARD_TAGS: dict[str, str] = {
    "loss": "train/loss",
    "val_loss": "val/loss",
    "val_accuracy": "val/accuracy",
    "val_entropy": "val/entropy",
    "val_items": "val/items",
    "val_records": "val/records",
    "grad_norm": "grad/norm_pre_clip",
    "post_clip_norm": "grad/norm_post_clip",
    "clip_coef": "grad/clip_coef",
    "clip_threshold": "grad/clip_threshold",
    "clipped": "grad/clipped",
    "skipped": "grad/skipped",
    "lr": "opt/lr",
    "loss_scale": "opt/loss_scale",
    "items": "perf/items",
    "tokens_per_s": "perf/tokens_per_s",
    "step_time_s": "perf/step_time_s",
    "peak_memory_mb": "perf/peak_memory_mb",
}

TRACKERS = ("tensorboard", "wandb", "mlflow")
"""What ``--report-to`` (``MetricsLogger(report_to=...)``) can name."""
_EXTRA = {"wandb": "wandb", "mlflow": "mlflow", "tensorboard": "tensorboard"}
PROJECT = "gradstep"
"""The W&B project and the MLflow experiment when the environment names none."""


class TrackerError(GradstepError, RuntimeError):
    """A tracker cannot start or log (not installed, misconfigured); the message says which
    and what to do."""


def _import(name: str) -> Any:
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        raise TrackerError(
            f"the {name} tracker (--report-to {name}) needs the {name} package, which "
            f"gradstep does not: pip install 'gradstep[{_EXTRA[name]}]'"
        ) from None


def scalars(record: Mapping[str, Any], tags: Mapping[str, str]) -> dict[str, float]:
    """The record's finite numbers (booleans as 0/1) under their tags."""
    out = {}
    for key, tag in tags.items():
        value = record.get(key)
        if hasattr(value, "item"):
            value = value.item()
        if isinstance(value, (bool, int, float)) and math.isfinite(float(value)):
            out[tag] = float(value)
    return out


class WandbSink:
    """Logs every record to a W&B run (``wandb.init``: project ``WANDB_PROJECT`` or
    ``gradstep``, files under ``WANDB_DIR`` or ``log_dir``)."""

    def __init__(
        self,
        log_dir: str | Path | None = None,
        *,
        name: str | None = None,
        config: Mapping[str, Any] | None = None,
        start_index: int = 0,
        run_id: str | None = None,
    ) -> None:
        wandb = _import("wandb")
        self.tags = dict(TENSORBOARD_TAGS)
        self._index = int(start_index)
        directory = os.environ.get("WANDB_DIR") or (None if log_dir is None else str(log_dir))
        if directory is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)
        try:
            self._run = wandb.init(
                project=os.environ.get("WANDB_PROJECT") or PROJECT,
                name=name,
                dir=directory,
                config=dict(config or {}),
                id=run_id,
                resume="allow" if run_id else None,
                reinit="create_new",
            )
        except Exception as exc:  # wandb's own errors: not logged in, no network, ...
            raise TrackerError(
                f"the wandb tracker (--report-to wandb) did not start: {exc}"
            ) from exc
        self.run_id: str = self._run.id

    def write(self, record: Mapping[str, Any]) -> None:
        self._index += 1
        self._run.log(scalars(record, self.tags), step=self._index)

    def close(self) -> None:
        self._run.finish()


class MLflowSink:
    """Logs every record to an MLflow run (``MlflowClient``: the tracking URI and the
    experiment from the environment, else MLflow's default and ``gradstep``)."""

    def __init__(
        self,
        *,
        name: str | None = None,
        config: Mapping[str, Any] | None = None,
        start_index: int = 0,
        run_id: str | None = None,
    ) -> None:
        mlflow = _import("mlflow")
        self.tags = dict(TENSORBOARD_TAGS)
        self._index = int(start_index)
        self._entities = mlflow.entities
        try:
            self._client = mlflow.tracking.MlflowClient()
            if run_id is None:
                run_id = self._new_run(name, config or {})
            else:
                self._client.update_run(run_id, status="RUNNING")
        except Exception as exc:  # MLflow's own errors: the store refused, no server, ...
            raise TrackerError(
                f"the mlflow tracker (--report-to mlflow) did not start: {exc}"
            ) from exc
        self.run_id = run_id

    def _new_run(self, name: str | None, config: Mapping[str, Any]) -> str:
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or PROJECT
        found = self._client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found else self._client.create_experiment(experiment)
        run = self._client.create_run(exp_id, run_name=name)
        params = [
            self._entities.Param(str(k), str(v)[:6000]) for k, v in config.items() if v is not None
        ]
        for start in range(0, len(params), 100):  # MLflow's batch limit
            self._client.log_batch(run.info.run_id, params=params[start : start + 100])
        return run.info.run_id

    def write(self, record: Mapping[str, Any]) -> None:
        self._index += 1
        now = int(time.time() * 1000)
        metrics = [
            self._entities.Metric(tag, value, now, self._index)
            for tag, value in scalars(record, self.tags).items()
        ]
        self._client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def tracker_sinks(
    names: Iterable[str],
    out_dir: str | Path | None,
    *,
    name: str | None = None,
    config: Mapping[str, Any] | None = None,
    start_index: int = 0,
    run_ids: Mapping[str, str] | None = None,
) -> list[Any]:
    """The W&B and MLflow sinks ``names`` asks for (TensorBoard is the logger's own)."""
    ids = dict(run_ids or {})
    sinks: list[Any] = []
    for tracker in names:
        if tracker not in TRACKERS:
            raise ValueError(f"unknown tracker {tracker!r}; choose from {', '.join(TRACKERS)}")
        if tracker == "wandb":
            sinks.append(
                WandbSink(out_dir, name=name, config=config, start_index=start_index,
                          run_id=ids.get("wandb"))
            )  # fmt: skip
        elif tracker == "mlflow":
            sinks.append(
                MLflowSink(name=name, config=config, start_index=start_index,
                           run_id=ids.get("mlflow"))
            )  # fmt: skip
    return sinks
