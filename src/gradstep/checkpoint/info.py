"""What a verified checkpoint tells its caller: :class:`CheckpointInfo`.

Its step, folder and manifest (as :meth:`.Checkpointer.latest` and :meth:`.Checkpointer.inspect`
hand it back), and what the manifest implies: the run's world and data-parallel sizes, the
accumulation steps that keep its global batch on another number of ranks, and the frozen
base an adapter-only checkpoint was trained on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .elastic import elastic_accum_steps
from .errors import CheckpointError
from .fingerprint import Fingerprint

__all__ = ["CheckpointInfo"]


@dataclass(frozen=True)
class CheckpointInfo:
    """A verified checkpoint: its step, folder and manifest."""

    step: int
    path: Path
    manifest: dict[str, Any]

    @property
    def world_size(self) -> int:
        return int(self.manifest["world_size"])

    @property
    def dp_size(self) -> int:
        """The run's data-parallel ranks (ranks that read different data): its world size,
        except under tensor parallel (the tensor-parallel peers of a rank read the same
        data). A manifest from before the field: its ``world_size``."""
        return int(self.manifest.get("dp_size", self.manifest["world_size"]))

    @property
    def accum_steps(self) -> int | None:
        return self.manifest.get("accum_steps")

    @property
    def base_fingerprint(self) -> Fingerprint | None:
        """The fingerprint of the frozen base an adapter-only (``trainable_only``) checkpoint
        was trained on; None for a full checkpoint or one saved before fingerprints."""
        for entry in self.manifest["objects"].values():
            if entry.get("kind") == "module" and entry.get("trainable_only"):
                return Fingerprint.from_json(entry.get("base_fingerprint"))
        return None

    def accum_steps_for(self, world_size: int) -> int:
        """:func:`elastic_accum_steps` for this checkpoint (needs ``accum_steps`` saved), from
        its :attr:`dp_size` to ``world_size``: the data-parallel ranks of the run that
        resumes (its world size, except under tensor parallel)."""
        if self.accum_steps is None:
            raise CheckpointError(
                f"{self.path.name} was saved without accum_steps; pass accum_steps= to the "
                "Checkpointer that saves, to resume on a different world size"
            )
        return elastic_accum_steps(int(self.accum_steps), self.dp_size, world_size)
