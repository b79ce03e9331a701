"""Per-step training metrics, fanned out to sinks: JSON lines, TensorBoard, W&B, MLflow
(:mod:`gradstep.trackers`), a Python callback.

One record (a flat ``dict``) per optimizer step: every :class:`~gradstep.StepStats` field
(loss, pre- and post-clip gradient norm, clip coefficient and threshold, clip/skip flags
and reasons, lr, loss scale), plus what only the caller can know (step wall time, hence
tokens/s; validation loss on the steps where it was measured) and the process's peak
memory. The record is built once by :class:`MetricsLogger` and every sink sees the same
values, so the TensorBoard curves, the ``metrics.jsonl`` file and a user's callback can
never disagree.

Peak memory is the process peak so far, not a per-step figure: the CUDA caching allocator's
``max_memory_allocated`` on a CUDA device (peak bytes in tensors), max resident set size on
CPU (the OS figure, which also counts the interpreter and libraries). Neither is reset, so
user code measuring its own peaks is not disturbed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol, TextIO, runtime_checkable

import torch

from .step.stepper import StepStats
from .trackers import TENSORBOARD_TAGS, tracker_sinks

__all__ = [
    "FINISHED_FILE",
    "CallbackSink",
    "JsonlSink",
    "MetricsLogger",
    "MetricsSink",
    "TensorBoardSink",
    "jsonable",
    "peak_memory",
]

Record = dict[str, Any]

FINISHED_FILE = "metrics.finished.json"
"""Written into the run folder by :meth:`MetricsLogger.finish`: the run ended normally.
``gradstep report`` shows a run without it as "in progress"."""


def jsonable(value: Any) -> Any:
    """Strict-JSON form of a record: non-finite floats -> null, tensors -> numbers."""
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def peak_memory(device: torch.device | str | None = None) -> tuple[float | None, str]:
    """``(peak MiB so far, source)``: CUDA allocator peak on a CUDA device, else max RSS.

    Read by :func:`gradstep.memory.peak_bytes`: on Linux max RSS is ``VmHWM`` from
    ``/proc/self/status`` (``ru_maxrss`` survives fork + exec, so a run started from a large
    parent, a test runner or a notebook, would report the parent's peak), elsewhere
    ``ru_maxrss``; ``(None, "unavailable")`` where neither exists (Windows).
    """
    try:
        # Imported here: the memory planner stays out of ``import gradstep``.
        from .memory import peak_bytes
    except ImportError:  # pragma: no cover - Windows (no ``resource`` module)
        return None, "unavailable"
    dev = torch.device(device) if device is not None else torch.device("cpu")
    source = "cuda_max_allocated" if dev.type == "cuda" and torch.cuda.is_available() else "max_rss"
    return peak_bytes(dev) / 2**20, source


@runtime_checkable
class MetricsSink(Protocol):
    """Anything that takes one record per step. ``close`` flushes and releases files."""

    def write(self, record: Record) -> None: ...

    def close(self) -> None: ...


def _naming(exc: OSError, path: str | None) -> OSError:
    """``exc`` with the file it was writing: a ``write`` or ``flush`` that fails (disk
    full, file-size limit) raises an OSError without ``filename``."""
    if exc.filename is not None or path is None:
        return exc
    return type(exc)(exc.errno, exc.strerror or str(exc), path)


class JsonlSink:
    """One strict-JSON object per line, flushed every step so a live ``report`` can read it.

    A reader may still catch a line half-written; ``gradstep report`` ignores an
    unterminated last line for that reason. A write that fails (a full disk) raises an
    ``OSError`` whose ``filename`` is this file.
    """

    def __init__(self, path: str | Path | TextIO, append: bool = False) -> None:
        if isinstance(path, (str, Path)):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file: TextIO = open(path, "a" if append else "w")  # noqa: SIM115
            self._owned = True
            self.path: str | None = str(path)
        else:
            self._file, self._owned = path, False
            name = getattr(path, "name", None)  # an open file's path; not for StringIO
            self.path = name if isinstance(name, str) else None
        self._failed = False

    def write(self, record: Record) -> None:
        line = json.dumps(jsonable(record), allow_nan=False) + "\n"
        try:
            self._file.write(line)
            self._file.flush()
        except OSError as exc:
            self._failed = True
            raise _naming(exc, self.path) from exc

    def close(self) -> None:
        try:
            if self._owned:
                self._file.close()
            else:
                self._file.flush()
        except OSError as exc:
            if not self._failed:  # a failed write was reported already; its rest is lost
                raise _naming(exc, self.path) from exc


class TensorBoardSink:
    """Scalars for TensorBoard through ``torch.utils.tensorboard.SummaryWriter``.

    The x axis is the window index (1, 2, ... per logged step, after ``start_index`` on a
    resumed run), not ``StepStats.step``, which does not advance on a skipped step and
    would put two points at one x.
    """

    def __init__(
        self, log_dir: str | Path, tags: Mapping[str, str] | None = None, start_index: int = 0
    ) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # tensorboard is an optional extra
            raise ImportError(
                "the TensorBoard sink (--tensorboard) needs the tensorboard package: "
                "pip install 'gradstep[tensorboard]'"
            ) from exc
        self.log_dir = Path(log_dir)
        self.tags = dict(TENSORBOARD_TAGS if tags is None else tags)
        self._writer = SummaryWriter(log_dir=str(self.log_dir))
        self._index = int(start_index)

    def write(self, record: Record) -> None:
        self._index += 1
        for key, tag in self.tags.items():
            value = record.get(key)
            if isinstance(value, torch.Tensor):
                value = value.item()
            if isinstance(value, (bool, int, float)):
                self._writer.add_scalar(tag, float(value), self._index)

    def close(self) -> None:
        self._writer.close()


class CallbackSink:
    """Calls ``fn(record)`` every step: the hook for wandb, MLflow, a progress UI, a test.

    The callback gets its own shallow copy, so mutating it cannot change what the other
    sinks write.
    """

    def __init__(self, fn: Callable[[Record], Any]) -> None:
        if not callable(fn):
            raise TypeError(f"CallbackSink: fn must be callable, got {type(fn).__name__}")
        self.fn = fn

    def write(self, record: Record) -> None:
        self.fn(dict(record))

    def close(self) -> None:
        pass


class MetricsLogger:
    """Builds one record per optimizer step and hands it to every sink.

    Args:
        out_dir: run folder; when given, ``OUT_DIR/metrics.jsonl`` is always written.
        tensorboard: also write TensorBoard events to ``OUT_DIR/tensorboard``.
        report_to: trackers to log to as well, of :data:`gradstep.trackers.TRACKERS`
            (``"tensorboard"`` is ``tensorboard=True``; ``"wandb"``, ``"mlflow"`` need
            their packages, imported only then); ``run_name``, ``run_config`` and
            ``tracker_ids`` (a tracker's run to continue, by tracker) go to them.
        callbacks: plain functions called with each record.
        sinks: any further :class:`MetricsSink` objects.
        device: where the model lives, to choose the peak-memory source.
        append: append to an existing ``metrics.jsonl`` (a resumed run) instead of
            truncating it.
        start_index: windows already logged before this logger (a resumed run), so the
            TensorBoard x axis continues instead of restarting at 1.

    Use as a context manager (or call :meth:`close`) so files are flushed and closed.
    """

    def __init__(
        self,
        out_dir: str | Path | None = None,
        *,
        tensorboard: bool = False,
        callbacks: Iterable[Callable[[Record], Any]] = (),
        sinks: Iterable[MetricsSink] = (),
        device: torch.device | str | None = None,
        append: bool = False,
        start_index: int = 0,
        report_to: Iterable[str] = (),
        run_name: str | None = None,
        run_config: Mapping[str, Any] | None = None,
        tracker_ids: Mapping[str, str] | None = None,
    ) -> None:
        report_to = tuple(report_to)
        tensorboard = tensorboard or "tensorboard" in report_to
        if tensorboard and out_dir is None:
            raise ValueError("MetricsLogger: tensorboard=True needs out_dir (events go there)")
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.sinks: list[MetricsSink] = []
        self.out_dir = None if out_dir is None else Path(out_dir)
        if out_dir is not None:
            self.sinks.append(JsonlSink(Path(out_dir) / "metrics.jsonl", append=append))
            if tensorboard:
                tb_dir = Path(out_dir) / "tensorboard"
                self.sinks.append(TensorBoardSink(tb_dir, start_index=start_index))
        self.trackers = self._trackers(report_to, run_name, run_config, start_index, tracker_ids)
        self.sinks.extend(self.trackers.values())
        self.sinks.extend(CallbackSink(fn) for fn in callbacks)
        for sink in sinks:
            if not isinstance(sink, MetricsSink):
                raise TypeError(
                    f"MetricsLogger: sinks must have write(record) and close(), got "
                    f"{type(sink).__name__}"
                )
            self.sinks.append(sink)
        self.started = time.perf_counter()
        self.steps_logged = 0

    def _trackers(
        self,
        names: tuple[str, ...],
        run_name: str | None,
        config: Mapping[str, Any] | None,
        start_index: int,
        ids: Mapping[str, str] | None,
    ) -> dict[str, Any]:
        """W&B and MLflow sinks by name; the sinks opened so far are closed if one fails."""
        wanted = [name for name in names if name != "tensorboard"]
        try:
            made = tracker_sinks(
                wanted, self.out_dir, name=run_name, config=config, start_index=start_index,
                run_ids=ids,
            )  # fmt: skip
        except BaseException:
            self.close()
            raise
        return dict(zip([n for n in wanted if n in ("wandb", "mlflow")], made, strict=True))

    def tracker_ids(self) -> dict[str, str]:
        """The tracker runs logged to, by tracker (to continue them on a resume)."""
        return {name: sink.run_id for name, sink in self.trackers.items()}

    def record(
        self,
        stats: StepStats,
        step_time_s: float,
        val_loss: float | None = None,
        **extra: Any,
    ) -> Record:
        """The record for one step, without writing it (see :meth:`log_step`)."""
        if not isinstance(stats, StepStats):
            raise TypeError(f"stats must be a gradstep.StepStats, got {type(stats).__name__}")
        if not (isinstance(step_time_s, (int, float)) and step_time_s > 0):
            raise ValueError(f"step_time_s must be a number > 0 (seconds), got {step_time_s!r}")
        memory, source = peak_memory(self.device)
        record: Record = dataclasses.asdict(stats)
        record.update(
            tokens_per_s=stats.items / step_time_s,
            step_time_s=float(step_time_s),
            peak_memory_mb=memory,
            memory_source=source,
            elapsed_s=time.perf_counter() - self.started,
        )
        if val_loss is not None:
            record["val_loss"] = float(val_loss)
        record.update(extra)
        return record

    def log_step(
        self,
        stats: StepStats,
        step_time_s: float,
        val_loss: float | None = None,
        **extra: Any,
    ) -> Record:
        """Build the step's record, write it to every sink and return it.

        ``step_time_s`` is the wall time of the ``Stepper.step`` call (tokens/s =
        ``stats.items / step_time_s``); ``val_loss`` is given on steps where validation
        ran; ``extra`` keys are added to the record as they are.
        """
        rec = self.record(stats, step_time_s, val_loss, **extra)
        for sink in self.sinks:
            sink.write(rec)
        self.steps_logged += 1
        return rec

    def finish(self, **summary: Any) -> None:
        """Mark the run as finished (``FINISHED_FILE`` in ``out_dir``, with ``summary``)."""
        if self.out_dir is None:
            return
        body = {"steps_logged": self.steps_logged, "finished_unix": time.time(), **summary}
        path = self.out_dir / FINISHED_FILE
        try:
            path.write_text(json.dumps(jsonable(body)) + "\n")
        except OSError as exc:
            raise _naming(exc, str(path)) from exc

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
