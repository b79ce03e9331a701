"""``gradstep export``: a trained ``hf:`` run as a folder the Hugging Face ecosystem loads."""

from __future__ import annotations

from pathlib import Path

__all__ = ["export_run"]


def export_run(
    run_dir: str | Path, out: str | Path, *, step: int | None = None, merge_lora: bool = False
) -> Path:
    """Write the run's checkpoint (``step``, default the newest valid) to ``out``."""
    raise NotImplementedError("gradstep export is not implemented yet")
