"""The :class:`Checkpointer`: where checkpoints live, and the order of a save and a load.

A save puts each object where it goes (model and optimizer through :mod:`.state`, the rest
through :mod:`.codec`, RNG through :mod:`.rng`), on the right rank and in the protocol's
order, and fills in the manifest; a load picks the newest checkpoint that verifies (or the
one given) and hands it to :func:`.restore.restore`. The folder protocol itself (temporary
folder, manifest, rename, prune, verify) is :mod:`.layout`; what a checkpoint tells its
caller is :class:`.info.CheckpointInfo`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._validate import check_int
from .._version import __version__
from ..parallel import collectives

# The protocol's steps are called through the module, not imported by name, so that the
# SIGKILL tests (tests/checkpoint/kill_child.py) can hook each one.
from . import layout
from .codec import encode, write_tensor_file
from .elastic import data_parallel_size
from .errors import CheckpointError, not_saved
from .fingerprint import base_fingerprint
from .info import CheckpointInfo
from .objects import NamedObject, classify
from .restore import restore
from .rng import rng_file, rng_state
from .state import dcp_save, local_optim_state, trainable_state, uses_dcp

__all__ = ["Checkpointer"]

# The package's name, not this module's: one logger for every checkpoint warning, where users
# and tests configure them.
logger = logging.getLogger("gradstep.checkpoint")


class Checkpointer:
    """Atomic, verified, elastic checkpoints in ``directory`` (one ``step-N`` folder each).

    Args:
        directory: where the ``step-N`` folders live (created on the first save).
        keep: how many of the newest checkpoints to keep after each save (>= 1).
        accum_steps: micro-batches per rank per optimizer step, recorded so that a resume on
            another world size can keep the global batch (:meth:`CheckpointInfo.accum_steps_for`).
        micro_batch_size: items per micro-batch, recorded to report the global batch.
        dp_size: the data-parallel ranks (ranks that read different data), recorded as the
            manifest's ``dp_size`` and used for its global batch and by a resume's
            :meth:`CheckpointInfo.accum_steps_for`. None: read from the saved model, which
            is the world size except for FSDP2 + tensor parallel (FSDP2's data-parallel
            mesh is then smaller than the world: its size).
        rng: also save and restore each rank's python/numpy/torch(/CUDA) RNG state.
        trainable_only: save only the model's trainable parameters (``requires_grad``) and
            their optimizer state, e.g. a PEFT model's adapters: frozen weights and buffers
            must then come from elsewhere (rebuilt from the same seed, ``from_pretrained``)
            before loading. Loading such a checkpoint needs ``trainable_only=True`` too.

    ``save(step, **stateful)`` / ``load_latest(**stateful)`` take the same names: one
    ``nn.Module`` (plain, DDP, FSDP2 or compiled), at most one optimizer, and any objects
    with ``state_dict()``/``load_state_dict()`` (scheduler, Stepper, data iterator, ...).
    With several ranks both are collective: every rank calls them.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        keep: int = 3,
        *,
        accum_steps: int | None = None,
        micro_batch_size: int | None = None,
        rng: bool = True,
        trainable_only: bool = False,
        dp_size: int | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.dp_size = (
            None if dp_size is None else check_int("dp_size", dp_size, 1, error=CheckpointError)
        )
        self.trainable_only = bool(trainable_only)
        self.keep = check_int("keep", keep, 1, error=CheckpointError)
        self.accum_steps = (
            None
            if accum_steps is None
            else check_int("accum_steps", accum_steps, 1, error=CheckpointError)
        )
        self.micro_batch_size = (
            None
            if micro_batch_size is None
            else check_int("micro_batch_size", micro_batch_size, 1, error=CheckpointError)
        )
        self.rng = bool(rng)
        self._verified: dict[Path, tuple[tuple, bool]] = {}
        self.protected: set[int] = set()
        """Steps whose checkpoints no prune removes, beside the ``keep`` newest (a best one)."""

    def __repr__(self) -> str:
        return f"Checkpointer({str(self.directory)!r}, keep={self.keep})"

    # ---------------------------------------------------------------------------- save

    def save(self, step: int, **stateful: Any) -> Path:
        """Write a checkpoint of ``stateful`` for ``step``; return its folder."""
        check_int("step", step, 0, error=CheckpointError)
        if not stateful:
            raise CheckpointError("save(step, **stateful) needs at least one object to save")
        model, optimizer, others = classify(stateful)
        dp = self._dp_size(model.obj if model is not None else None)
        final = self.directory / f"step-{step:06d}"
        tmp = self.directory / f".tmp-{final.name}"
        rank = collectives.rank()
        if rank == 0:
            self._make_directory()
            layout.recover(self.directory)
        published = False
        try:
            if rank == 0:
                tmp.mkdir()
            collectives.barrier()
            written = self._write_state(tmp, model, optimizer, others)
            if self.rng:
                rng = json.dumps(encode(rng_state(), "rng", {})).encode()
                layout.write_bytes(tmp / rng_file(rank), rng)
            collectives.barrier()
            if rank == 0:
                layout.write_manifest(tmp, self._manifest(step, tmp, *written, dp=dp))
                layout.fsync(tmp)
                layout.publish(tmp, final)
                published = True
                protect = {final, *(self.directory / f"step-{n:06d}" for n in self.protected)}
                layout.prune(self.directory, self.keep, protect=protect, is_valid=self._valid)
        except BaseException as exc:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            failed = getattr(exc, "filename", None)
            if not published and failed and isinstance(exc, (OSError, CheckpointError)):
                raise not_saved(step, exc) from exc
            raise
        collectives.barrier()
        return final

    def _make_directory(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise CheckpointError(
                f"checkpoint directory {str(self.directory)!r} exists and is not a folder"
            ) from None
        except OSError as exc:
            raise CheckpointError(
                f"cannot create checkpoint directory {str(self.directory)!r}: {exc.strerror or exc}"
            ) from None

    def _valid(self, folder: Path) -> bool:
        """Whether ``folder`` verifies, remembered per manifest version: each prune would
        otherwise hash every kept checkpoint again."""
        try:
            st = (folder / layout.MANIFEST).stat()
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            return False
        cached = self._verified.get(folder)
        if cached is None or cached[0] != key:
            cached = self._verified[folder] = (key, layout.verify(folder)[0] is not None)
        return cached[1]

    def _write_state(
        self,
        tmp: Path,
        model: NamedObject | None,
        optimizer: NamedObject | None,
        others: dict[str, Any],
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Write every object's state into ``tmp``; return the manifest's ``objects`` entries
        and where the other objects' tensors went."""
        objects: dict[str, Any] = {}
        object_tensors = None
        main = collectives.rank() == 0
        if model is not None:
            module = model.obj
            optim = optimizer.obj if optimizer is not None else None
            in_dcp = False
            only = self.trainable_only
            if uses_dcp(module):
                in_dcp = dcp_save(tmp, module, optim, only)
                objects[model.name] = {"kind": "module", "store": "dcp"}
            elif main:
                state = trainable_state(module) if only else collectives.unwrap(module).state_dict()
                aliases = write_tensor_file(tmp / "model.safetensors", state)
                objects[model.name] = {
                    "kind": "module",
                    "store": "file",
                    "file": "model.safetensors",
                    "aliases": aliases,
                }
            # Every rank takes part (a sharded base is gathered tensor by tensor).
            base = base_fingerprint(module) if only else None
            if base is not None and model.name in objects:
                objects[model.name]["trainable_only"] = True
                objects[model.name]["base_fingerprint"] = base.to_json()
            if optimizer is not None and in_dcp:
                objects[optimizer.name] = {"kind": "optimizer", "store": "dcp"}
            elif optimizer is not None and main:
                objects[optimizer.name] = self._optimizer_entry(tmp, module, optim)
            if optimizer is not None and main:
                # Loading Adam state into SGD (or back) would pass every shape check and
                # fail, or silently misbehave, at the first step: the type is checked.
                objects[optimizer.name]["type"] = type(optim).__qualname__
        if main and others:
            tensors: dict[str, torch.Tensor] = {}
            for name, obj in others.items():
                objects[name] = {
                    "kind": "object",
                    "state": encode(obj.state_dict(), name, tensors),
                }
            if tensors:
                aliases = write_tensor_file(tmp / "objects.safetensors", tensors)
                object_tensors = {"file": "objects.safetensors", "aliases": aliases}
        return objects, object_tensors

    @staticmethod
    def _optimizer_entry(tmp: Path, module: nn.Module, optim: torch.optim.Optimizer) -> dict:
        """Name-keyed optimizer state: tensors in a file, the rest in the manifest."""
        tensors: dict[str, torch.Tensor] = {}
        state = encode(local_optim_state(module, optim), "", tensors)
        entry: dict[str, Any] = {"kind": "optimizer", "store": "file", "state": state}
        if tensors:
            entry["aliases"] = write_tensor_file(tmp / "optimizer.safetensors", tensors)
            entry["file"] = "optimizer.safetensors"
        return entry

    def _dp_size(self, module: nn.Module | None) -> int:
        """The data-parallel ranks the manifest records (see ``dp_size`` in the class docs)."""
        world = collectives.world_size()
        if self.dp_size is not None:
            if world % self.dp_size:
                raise CheckpointError(
                    f"dp_size={self.dp_size} must divide the world size ({world}): it counts "
                    "the ranks that read different data"
                )
            return self.dp_size
        return data_parallel_size(module, world)

    def _manifest(
        self,
        step: int,
        tmp: Path,
        objects: dict[str, Any],
        object_tensors: dict | None,
        *,
        dp: int,
    ) -> dict[str, Any]:
        world, k, mbs = collectives.world_size(), self.accum_steps, self.micro_batch_size
        return {
            "format": layout.FORMAT,
            "format_version": layout.FORMAT_VERSION,
            "step": step,
            "world_size": world,
            "dp_size": dp,
            "accum_steps": k,
            "micro_batch_size": mbs,
            "global_micro_batches": None if k is None else k * dp,
            "global_batch": None if k is None or mbs is None else k * dp * mbs,
            "gradstep_version": __version__,
            "torch_version": torch.__version__,
            "created_unix": time.time(),
            "objects": objects,
            "object_tensors": object_tensors,
            "files": layout.file_table(tmp),
        }

    # ---------------------------------------------------------------------------- load

    def checkpoints(self) -> list[Path]:
        """Published checkpoint folders, newest first (not verified)."""
        return [path for _, path in layout.step_dirs(self.directory)]

    def latest(self) -> CheckpointInfo | None:
        """The newest checkpoint whose files all match their checksums, or None.

        Each unusable (truncated, corrupted, unfinished) checkpoint is reported in one
        warning line and the next older one is tried. With several ranks this is collective:
        rank 0 verifies and every rank gets its choice.
        """
        choice = self._newest_valid() if collectives.rank() == 0 else None
        choice = collectives.broadcast_from_rank0(choice)
        if choice is None:
            return None
        name, manifest = choice
        return CheckpointInfo(int(manifest["step"]), self.directory / name, manifest)

    def _newest_valid(self) -> tuple[str, dict[str, Any]] | None:
        bad, found = [], None
        for _, path in layout.step_dirs(self.directory):
            manifest, problem = layout.verify(path)
            if manifest is not None:
                found = (path.name, manifest)
                break
            bad.append((path, problem))
        outcome = f"loading {found[0]} instead" if found else "no valid checkpoint left"
        for path, problem in bad:
            logger.warning("checkpoint %s is unusable: %s; %s", path, problem, outcome)
        return found

    def load_latest(self, *, strict: bool = True, **stateful: Any) -> int | None:
        """Restore the newest valid checkpoint into ``stateful``; its step, or None if none.

        ``strict``: the checkpoint must hold exactly the names given (False: a subset).
        """
        info = self.latest()
        return None if info is None else self.load(info, strict=strict, **stateful)

    def load(
        self,
        checkpoint: CheckpointInfo | str | os.PathLike,
        *,
        strict: bool = True,
        **stateful: Any,
    ) -> int:
        """Restore one checkpoint (from :meth:`latest`, or a ``step-N`` folder, verified)."""
        if not stateful:
            raise CheckpointError("load needs the objects to restore, by the names used in save")
        if not isinstance(checkpoint, CheckpointInfo):
            checkpoint = self.inspect(checkpoint)
        restore(checkpoint, stateful, strict, self.rng, self.trainable_only)
        return checkpoint.step

    def inspect(self, folder: str | os.PathLike) -> CheckpointInfo:
        """Verify one ``step-N`` folder (collective); raise CheckpointError if unusable."""
        path = Path(folder)
        verdict = layout.verify(path) if collectives.rank() == 0 else None
        manifest, problem = collectives.broadcast_from_rank0(verdict)
        if manifest is None:
            raise CheckpointError(f"checkpoint {path} is unusable: {problem}")
        return CheckpointInfo(int(manifest["step"]), path, manifest)
