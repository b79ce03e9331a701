"""The load path: a verified checkpoint restored into the caller's objects, all or nothing.

:func:`restore` checks the names and kinds the caller passes against the manifest, reads
and validates every saved state first (other objects, then model and optimizer through
:mod:`.state`, the frozen base of an adapter-only checkpoint through :mod:`.fingerprint`),
and only then loads, rolling the other objects back if one refuses its state; each rank's
RNG (:mod:`.rng`) is set last. Which checkpoint to load is :class:`.Checkpointer`'s choice.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

from ..parallel import collectives
from .codec import decode, read_tensor_file
from .errors import CheckpointError
from .fingerprint import check_base
from .info import CheckpointInfo
from .objects import NamedObject, classify, kind
from .rng import rng_file, set_rng_state
from .state import dcp_prepare, file_prepare, load_optim_full, optim_problems, param_fqns

__all__ = ["restore"]


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
        got = kind(obj)
        if entries[name]["kind"] != got:
            raise CheckpointError(
                f"checkpoint {info.path}: {name!r} was saved as kind {entries[name]['kind']!r}, "
                f"got kind {got!r} ({type(obj).__name__})"
            )


def _prepare_tensors(
    info: CheckpointInfo,
    model: NamedObject | None,
    optimizer: NamedObject | None,
    trainable_only: bool = False,
) -> Callable[[], None]:
    """Read and validate model + optimizer state, modifying nothing; return the loader."""
    if model is None:
        return lambda: None
    module = model.obj
    optim = optimizer.obj if optimizer is not None else None
    entries = info.manifest["objects"]
    oentry = entries[optimizer.name] if optimizer is not None else None
    saved_only = bool(entries[model.name].get("trainable_only", False))
    if saved_only and not trainable_only:
        # Loading it as a whole model would keep whatever frozen weights the model has now.
        raise CheckpointError(
            f"checkpoint {info.path}: {model.name!r} holds only its trainable parameters "
            "(saved with trainable_only=True); load it with Checkpointer(..., "
            "trainable_only=True) into a model whose frozen weights are already in place"
        )
    if entries[model.name]["store"] == "dcp":
        optim_in_dcp = oentry is not None and oentry["store"] == "dcp"
        problems, load_model = dcp_prepare(info.path, module, optim, optim_in_dcp, saved_only)
    else:
        problems, load_model = file_prepare(info.path, entries[model.name], module)
    saved_type = oentry.get("type") if oentry is not None else None
    if optim is not None and saved_type is not None and saved_type != type(optim).__qualname__:
        raise CheckpointError(
            f"checkpoint {info.path}: {optimizer.name!r} was saved from a {saved_type}, got "
            f"a {type(optim).__qualname__}; build the optimizer the run was saved with "
            "(nothing was loaded)"
        )
    saved_optim = None
    if optim is not None and oentry is not None and oentry["store"] == "file":
        tensors = (
            read_tensor_file(info.path / oentry["file"], oentry["aliases"])
            if "file" in oentry
            else {}
        )
        saved_optim = decode(oentry["state"], tensors)
        problems += optim_problems(saved_optim, param_fqns(module, optim))
    if problems:
        names = model.name + (f" / {optimizer.name}" if optimizer is not None else "")
        raise CheckpointError(
            f"checkpoint {info.path} does not fit {names}: {'; '.join(problems)}. "
            "Nothing was loaded."
        )
    if saved_only:  # adapters: the frozen base must be the one they were trained on
        check_base(info.path, model.name, entries[model.name], module)

    def load() -> None:
        load_model()
        if saved_optim is not None:
            load_optim_full(module, optim, saved_optim)

    return load


def restore(
    info: CheckpointInfo,
    stateful: dict[str, Any],
    strict: bool,
    rng: bool,
    trainable_only: bool = False,
) -> None:
    """Read and validate everything first; then load, rolling objects back on a refusal."""
    model, optimizer, others = classify(stateful)
    _check_names(info, stateful, strict)
    entries, blob = info.manifest["objects"], info.manifest.get("object_tensors")
    tensors = read_tensor_file(info.path / blob["file"], blob["aliases"]) if blob else {}
    states = {name: decode(entries[name]["state"], tensors) for name in others}
    load_tensors = _prepare_tensors(info, model, optimizer, trainable_only)
    rng_name = rng_file(collectives.rank())
    saved_rng = None
    if rng and rng_name in info.manifest["files"]:
        saved_rng = decode(json.loads((info.path / rng_name).read_bytes()), {})
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
    if saved_rng is not None:
        set_rng_state(saved_rng)
