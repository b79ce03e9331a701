"""Checkpoint and resume: exact, atomic, elastic.

``Checkpointer(directory, keep=3).save(step, model=..., optimizer=..., ...)`` writes one
folder per checkpoint; ``load_latest(**same_names)`` restores the newest one that verifies.

Layout of ``directory`` (one writer at a time)::

    step-000120/                     one published checkpoint (never modified afterwards)
        manifest.json                written last: metadata, non-tensor state, checksums
        model.safetensors            single process: the module's state_dict (FQN keys)
        optimizer.safetensors        single process: optimizer tensors, keyed by param FQN
        objects.safetensors          tensors found in the other objects' state (if any)
        dcp/                         several ranks: model + optimizer via
                                     torch.distributed.checkpoint (one file per rank)
        rng-rank00000.json           python / numpy / torch (CPU, CUDA) RNG of each rank
    .tmp-step-000130/                a save in progress (ignored, removed by the next save)

``manifest.json`` holds: format and version, step, world size, accumulation steps,
micro-batch size, global batch, gradstep and torch versions, the size and sha256 of every
other file, each object's non-tensor state as JSON (tensors are ``{"__gradstep__":
"tensor", "key": K}`` references into the object's safetensors file; tuples, non-finite
floats and dicts with non-string keys are tagged the same way, so the JSON is strict and
round-trips exactly) and its own sha256 (``checksum``, over the canonical JSON of the rest).

Why each rule exists:

* Atomic: files go to ``.tmp-step-N``, are fsynced, then the manifest, then the folder is
  fsynced and renamed to ``step-N`` (a single atomic rename) and the parent fsynced; only
  then are old checkpoints pruned (renamed away first, so a half-deleted folder is never
  visible). A process killed at any instant leaves every published checkpoint intact.
* Verified: loading hashes every file against the manifest; a truncated or corrupted
  checkpoint is reported in one warning line and the next older one is used.
* Validated before modified: every tensor is read and the model/optimizer structure is
  checked (missing, unexpected and mis-shaped keys, all listed) before anything is loaded;
  other objects are rolled back if a later one refuses its state.
* Elastic: several ranks save model and optimizer through DCP (any sharding, resharded on
  load); other objects' state is taken from rank 0 (in gradstep it is identical on every
  rank, and the data position is global). :func:`elastic_accum_steps` keeps the global
  batch when the world size changes.
* The optimizer is stored with parameter names, not indices, so a checkpoint survives
  re-wrapping (DDP, FSDP2, ``torch.compile``). Locally the name mapping is done here
  rather than with ``get_optimizer_state_dict``: that function initialises an empty
  optimizer by running a zero-lr ``step()``, which would turn a fresh AdamW into one at
  step 1 and break an exact resume from a step-0 checkpoint.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import _checkpoint_state as st
from . import distributed as dist_env
from ._checkpoint_state import CheckpointError
from ._validate import check_int

__all__ = ["CheckpointError", "CheckpointInfo", "Checkpointer", "elastic_accum_steps"]

logger = logging.getLogger(__name__)

FORMAT = "gradstep-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_LEFTOVER = re.compile(r"^\.(tmp|trash)-step-\d+$")
_REPLACED = re.compile(r"^\.replaced-(step-\d+)$")


def elastic_accum_steps(accum_steps: int, saved_world_size: int, world_size: int) -> int:
    """Accumulation steps that keep the checkpoint's global batch on ``world_size`` ranks.

    The global batch is ``accum_steps * saved_world_size`` micro-batches per optimizer step;
    it must stay the same for the data stream and the LR schedule to mean the same thing.
    """
    for name, value in (
        ("accum_steps", accum_steps),
        ("saved_world_size", saved_world_size),
        ("world_size", world_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{name} must be an int >= 1, got {value!r}")
    total = accum_steps * saved_world_size
    if total % world_size:
        raise CheckpointError(
            f"cannot keep the global batch: the checkpoint was saved with world_size="
            f"{saved_world_size} x accum_steps={accum_steps} = {total} micro-batches per step, "
            f"which world_size={world_size} does not divide; use a world size dividing {total}"
        )
    return total // world_size


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
    def accum_steps(self) -> int | None:
        return self.manifest.get("accum_steps")

    def accum_steps_for(self, world_size: int) -> int:
        """:func:`elastic_accum_steps` for this checkpoint (needs ``accum_steps`` saved)."""
        if self.accum_steps is None:
            raise CheckpointError(
                f"{self.path.name} was saved without accum_steps; pass accum_steps= to the "
                "Checkpointer that saves, to resume on a different world size"
            )
        return elastic_accum_steps(int(self.accum_steps), self.world_size, world_size)


# ----------------------------------------------------------------- the atomic protocol


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    body = {**manifest, "checksum": hashlib.sha256(_canonical(manifest)).hexdigest()}
    st.write_bytes(folder / MANIFEST, json.dumps(body, sort_keys=True, indent=1).encode() + b"\n")


def _file_table(folder: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file under ``folder`` (DCP's hidden ``.metadata`` included)."""
    table = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = Path(root, name)
            rel = path.relative_to(folder).as_posix()
            if rel != MANIFEST:
                table[rel] = {"bytes": path.stat().st_size, "sha256": st.file_sha256(path)}
    return dict(sorted(table.items()))


def _publish(tmp: Path, final: Path) -> None:
    """Make a complete, fsynced folder visible under its final name in one rename.

    Saving a step that exists replaces it: the old copy is renamed to ``.replaced-step-N``
    first, and stays loadable under that name until the new one is in place.
    """
    replaced = final.with_name(f".replaced-{final.name}")
    if final.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
    os.rename(tmp, final)
    st.fsync(final.parent)
    shutil.rmtree(replaced, ignore_errors=True)


def _recover(directory: Path) -> None:
    """Tidy what a killed save left: partial folders go, a replaced step is put back."""
    for path in directory.iterdir():
        if _LEFTOVER.match(path.name):
            shutil.rmtree(path, ignore_errors=True)
        elif m := _REPLACED.match(path.name):
            original = path.with_name(m.group(1))
            if original.exists():  # the replacement was published: the old copy can go
                shutil.rmtree(path, ignore_errors=True)
            else:  # killed between the two renames of _publish: restore the old copy
                os.rename(path, original)
    st.fsync(directory)


def _step_dirs(directory: Path) -> list[tuple[int, Path]]:
    """Published checkpoint folders, newest first (not verified)."""
    if not directory.is_dir():
        return []
    found: dict[int, Path] = {}
    for path in sorted(directory.iterdir(), key=lambda p: p.name.startswith(".")):
        m = _STEP_DIR.match(path.name) or _REPLACED.match(path.name)
        if m and path.is_dir():
            found.setdefault(int(m.group(1).removeprefix("step-")), path)
    return sorted(found.items(), reverse=True)


def _prune(directory: Path, keep: int) -> None:
    """Drop all but the ``keep`` newest: rename away (atomic), fsync, then delete."""
    trash = []
    for n, path in _step_dirs(directory)[keep:]:
        # Named by step (not by folder: a ``.replaced-`` folder would not match _LEFTOVER),
        # so a kill during the delete leaves something the next save cleans up.
        target = directory / f".trash-step-{n:06d}"
        shutil.rmtree(target, ignore_errors=True)
        os.rename(path, target)
        trash.append(target)
    if trash:
        st.fsync(directory)
    for target in trash:
        shutil.rmtree(target, ignore_errors=True)


def _verify(folder: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None) when every file matches its checksum, else (None, the reason)."""
    try:
        raw = json.loads((folder / MANIFEST).read_bytes())
    except FileNotFoundError:
        return None, f"{MANIFEST} is missing (the save did not finish)"
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"{MANIFEST} is not valid JSON ({exc})"
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        return None, f"{MANIFEST} is not a {FORMAT} manifest"
    checksum = raw.pop("checksum", None)
    if hashlib.sha256(_canonical(raw)).hexdigest() != checksum:
        return None, f"{MANIFEST} does not match its checksum (corrupted)"
    if raw.get("format_version", 0) > FORMAT_VERSION:
        return None, f"format version {raw['format_version']} is newer than this gradstep's"
    for name, meta in raw["files"].items():
        path = folder / name
        if not path.is_file():
            return None, f"{name} is missing"
        size = path.stat().st_size
        if size != meta["bytes"]:
            return None, f"{name} is truncated or resized ({size} of {meta['bytes']} bytes)"
        if st.file_sha256(path) != meta["sha256"]:
            return None, f"{name} does not match its sha256 checksum (corrupted)"
    return raw, None


# ------------------------------------------------------------------------ the Checkpointer


def _classify(stateful: dict[str, Any]) -> tuple[tuple | None, tuple | None, dict[str, Any]]:
    """Split the keyword objects into (model), (optimizer) and the rest, checking each."""
    modules = [(n, o) for n, o in stateful.items() if isinstance(o, nn.Module)]
    optims = [(n, o) for n, o in stateful.items() if isinstance(o, torch.optim.Optimizer)]
    if len(modules) > 1 or len(optims) > 1:
        raise CheckpointError(
            "a checkpoint holds at most one nn.Module and one Optimizer; got modules "
            f"{[n for n, _ in modules]} and optimizers {[n for n, _ in optims]}"
        )
    if optims and not modules:
        raise CheckpointError("an optimizer needs its model in the same call (parameter names)")
    special = {n for n, _ in modules + optims}
    others = {n: o for n, o in stateful.items() if n not in special}
    for name, obj in others.items():
        if not (
            callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))
        ):
            raise CheckpointError(
                f"{name}={type(obj).__name__}: checkpointed objects must be an nn.Module, an "
                "Optimizer, or have state_dict() and load_state_dict()"
            )
    return (modules[0] if modules else None), (optims[0] if optims else None), others


class Checkpointer:
    """Atomic, verified, elastic checkpoints in ``directory`` (one ``step-N`` folder each).

    Args:
        directory: where the ``step-N`` folders live (created on the first save).
        keep: how many of the newest checkpoints to keep after each save (>= 1).
        accum_steps: micro-batches per rank per optimizer step, recorded so that a resume on
            another world size can keep the global batch (:meth:`CheckpointInfo.accum_steps_for`).
        micro_batch_size: items per micro-batch, recorded to report the global batch.
        rng: also save and restore each rank's python/numpy/torch(/CUDA) RNG state.

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
    ) -> None:
        self.directory = Path(directory)
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

    def __repr__(self) -> str:
        return f"Checkpointer({str(self.directory)!r}, keep={self.keep})"

    # ---------------------------------------------------------------------------- save

    def save(self, step: int, **stateful: Any) -> Path:
        """Write a checkpoint of ``stateful`` for ``step``; return its folder."""
        check_int("step", step, 0, error=CheckpointError)
        if not stateful:
            raise CheckpointError("save(step, **stateful) needs at least one object to save")
        model, optimizer, others = _classify(stateful)
        final = self.directory / f"step-{step:06d}"
        tmp = self.directory / f".tmp-{final.name}"
        rank = dist_env.rank()
        if rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            _recover(self.directory)
            tmp.mkdir()
        st.barrier()
        try:
            written = self._write_state(tmp, model, optimizer, others)
            if self.rng:
                rng = json.dumps(st.encode(st.rng_state(), "rng", {})).encode()
                st.write_bytes(tmp / st.rng_file(rank), rng)
            st.barrier()
            if rank == 0:
                _write_manifest(tmp, self._manifest(step, tmp, *written))
                st.fsync(tmp)
                _publish(tmp, final)
                _prune(self.directory, self.keep)
        except BaseException:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        st.barrier()
        return final

    def _write_state(
        self, tmp: Path, model: tuple | None, optimizer: tuple | None, others: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Write every object's state into ``tmp``; return the manifest's ``objects`` entries
        and where the other objects' tensors went."""
        objects: dict[str, Any] = {}
        object_tensors = None
        main = dist_env.rank() == 0
        if model is not None:
            (mname, module), optim = model, optimizer[1] if optimizer else None
            in_dcp = False
            if st.uses_dcp(module):
                in_dcp = st.dcp_save(tmp, module, optim)
                objects[mname] = {"kind": "module", "store": "dcp"}
            elif main:
                aliases = st.write_tensor_file(
                    tmp / "model.safetensors", st.unwrap(module).state_dict()
                )
                objects[mname] = {
                    "kind": "module",
                    "store": "file",
                    "file": "model.safetensors",
                    "aliases": aliases,
                }
            if optimizer is not None and in_dcp:
                objects[optimizer[0]] = {"kind": "optimizer", "store": "dcp"}
            elif optimizer is not None and main:
                objects[optimizer[0]] = self._optimizer_entry(tmp, module, optim)
        if main and others:
            tensors: dict[str, torch.Tensor] = {}
            for name, obj in others.items():
                objects[name] = {
                    "kind": "object",
                    "state": st.encode(obj.state_dict(), name, tensors),
                }
            if tensors:
                aliases = st.write_tensor_file(tmp / "objects.safetensors", tensors)
                object_tensors = {"file": "objects.safetensors", "aliases": aliases}
        return objects, object_tensors

    @staticmethod
    def _optimizer_entry(tmp: Path, module: nn.Module, optim: torch.optim.Optimizer) -> dict:
        """Name-keyed optimizer state: tensors in a file, the rest in the manifest."""
        tensors: dict[str, torch.Tensor] = {}
        state = st.encode(st.local_optim_state(module, optim), "", tensors)
        entry: dict[str, Any] = {"kind": "optimizer", "store": "file", "state": state}
        if tensors:
            entry["aliases"] = st.write_tensor_file(tmp / "optimizer.safetensors", tensors)
            entry["file"] = "optimizer.safetensors"
        return entry

    def _manifest(
        self, step: int, tmp: Path, objects: dict[str, Any], object_tensors: dict | None
    ) -> dict[str, Any]:
        from . import __version__

        world, k, mbs = dist_env.world_size(), self.accum_steps, self.micro_batch_size
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": step,
            "world_size": world,
            "accum_steps": k,
            "micro_batch_size": mbs,
            "global_micro_batches": None if k is None else k * world,
            "global_batch": None if k is None or mbs is None else k * world * mbs,
            "gradstep_version": __version__,
            "torch_version": torch.__version__,
            "created_unix": time.time(),
            "objects": objects,
            "object_tensors": object_tensors,
            "files": _file_table(tmp),
        }

    # ---------------------------------------------------------------------------- load

    def checkpoints(self) -> list[Path]:
        """Published checkpoint folders, newest first (not verified)."""
        return [path for _, path in _step_dirs(self.directory)]

    def latest(self) -> CheckpointInfo | None:
        """The newest checkpoint whose files all match their checksums, or None.

        Each unusable (truncated, corrupted, unfinished) checkpoint is reported in one
        warning line and the next older one is tried. With several ranks this is collective:
        rank 0 verifies and every rank gets its choice.
        """
        choice = self._newest_valid() if dist_env.rank() == 0 else None
        choice = st.from_rank0(choice)
        if choice is None:
            return None
        name, manifest = choice
        return CheckpointInfo(int(manifest["step"]), self.directory / name, manifest)

    def _newest_valid(self) -> tuple[str, dict[str, Any]] | None:
        bad, found = [], None
        for _, path in _step_dirs(self.directory):
            manifest, problem = _verify(path)
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
            path = Path(checkpoint)
            manifest, problem = st.from_rank0(_verify(path) if dist_env.rank() == 0 else None)
            if manifest is None:
                raise CheckpointError(f"checkpoint {path} is unusable: {problem}")
            checkpoint = CheckpointInfo(int(manifest["step"]), path, manifest)
        _restore(checkpoint, stateful, strict, self.rng)
        return checkpoint.step


def _check_names(info: CheckpointInfo, stateful: dict[str, Any], strict: bool) -> None:
    entries = info.manifest["objects"]
    missing = sorted(set(stateful) - set(entries))
    extra = sorted(set(entries) - set(stateful))
    if missing:
        raise CheckpointError(
            f"checkpoint {info.path} has no state for {missing}; it holds {sorted(entries)}"
        )
    if extra and strict:
        raise CheckpointError(
            f"checkpoint {info.path} also holds {extra}: pass them too, or strict=False to "
            f"restore only {sorted(stateful)}"
        )
    for name, obj in stateful.items():
        kind = (
            "module" if isinstance(obj, nn.Module)
            else "optimizer" if isinstance(obj, torch.optim.Optimizer)
            else "object"
        )  # fmt: skip
        if entries[name]["kind"] != kind:
            raise CheckpointError(
                f"checkpoint {info.path}: {name!r} was saved as kind {entries[name]['kind']!r}, "
                f"got kind {kind!r} ({type(obj).__name__})"
            )


def _prepare_tensors(
    info: CheckpointInfo, model: tuple | None, optimizer: tuple | None
) -> Callable[[], None]:
    """Read and validate model + optimizer state, modifying nothing; return the loader."""
    if model is None:
        return lambda: None
    (mname, module), optim = model, optimizer[1] if optimizer else None
    entries = info.manifest["objects"]
    oentry = entries[optimizer[0]] if optimizer else None
    if entries[mname]["store"] == "dcp":
        optim_in_dcp = oentry is not None and oentry["store"] == "dcp"
        problems, load_model = st.dcp_prepare(info.path, module, optim, optim_in_dcp)
    else:
        problems, load_model = st.file_prepare(info.path, entries[mname], module)
    saved_optim = None
    if optim is not None and oentry is not None and oentry["store"] == "file":
        tensors = (
            st.read_tensor_file(info.path / oentry["file"], oentry["aliases"])
            if "file" in oentry
            else {}
        )
        saved_optim = st.decode(oentry["state"], tensors)
        problems += st.optim_problems(saved_optim, st.param_fqns(module, optim))
    if problems:
        names = mname + (f" / {optimizer[0]}" if optimizer else "")
        raise CheckpointError(
            f"checkpoint {info.path} does not fit {names}: {'; '.join(problems)}. "
            "Nothing was loaded."
        )

    def load() -> None:
        load_model()
        if saved_optim is not None:
            st.load_optim_full(module, optim, saved_optim)

    return load


def _restore(info: CheckpointInfo, stateful: dict[str, Any], strict: bool, rng: bool) -> None:
    """Read and validate everything first; then load, rolling objects back on a refusal."""
    model, optimizer, others = _classify(stateful)
    _check_names(info, stateful, strict)
    entries, blob = info.manifest["objects"], info.manifest.get("object_tensors")
    tensors = st.read_tensor_file(info.path / blob["file"], blob["aliases"]) if blob else {}
    states = {name: st.decode(entries[name]["state"], tensors) for name in others}
    load_tensors = _prepare_tensors(info, model, optimizer)
    rng_file = st.rng_file(dist_env.rank())
    rng_state = None
    if rng and rng_file in info.manifest["files"]:
        rng_state = st.decode(json.loads((info.path / rng_file).read_bytes()), {})
    done: list[tuple[Any, Any]] = []
    try:
        for name, obj in others.items():
            backup = copy.deepcopy(obj.state_dict())
            try:
                obj.load_state_dict(states[name])
            except Exception as exc:
                raise CheckpointError(
                    f"checkpoint {info.path}: {name} refused its saved state ({exc}); "
                    "nothing was loaded"
                ) from exc
            done.append((obj, backup))
        load_tensors()
    except BaseException:
        for obj, backup in reversed(done):
            obj.load_state_dict(backup)
        raise
    if rng_state is not None:
        st.set_rng_state(rng_state)
