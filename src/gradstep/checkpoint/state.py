"""Model and optimizer state: the single-process file path and the several-rank DCP path.

Single process: the unwrapped module's ``state_dict`` goes to ``model.safetensors`` and the
optimizer's state is re-keyed by parameter name (see the :mod:`gradstep.checkpoint`
docstring for why not ``get_optimizer_state_dict``). Several ranks, or sharded (DTensor)
parameters: both go through ``torch.distributed.checkpoint`` under ``dcp/``.

Loading is split in two everywhere: ``*_prepare`` reads and validates, modifying nothing,
and returns the problems found plus a loader to call once every object has been checked.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..parallel import collectives
from .codec import read_tensor_file
from .errors import CheckpointError

__all__ = [
    "dcp_prepare",
    "dcp_save",
    "expected_shapes",
    "file_prepare",
    "listed",
    "load_optim_full",
    "local_optim_state",
    "module_problems",
    "optim_problems",
    "param_fqns",
    "trainable_state",
    "uses_dcp",
]


def trainable_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The unwrapped module's ``state_dict`` entries that are trainable parameters
    (``requires_grad``): what ``Checkpointer(trainable_only=True)`` stores. Buffers and frozen
    weights come from wherever the base model comes from."""
    full = collectives.unwrap(module).state_dict(keep_vars=True)
    return {
        k: v.detach() for k, v in full.items() if isinstance(v, nn.Parameter) and v.requires_grad
    }


def _options(trainable_only: bool, **extra: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if trainable_only:  # frozen parameters stay out; loading leaves them (and buffers) alone
        extra.update(ignore_frozen_params=True, strict=False)
    return StateDictOptions(**extra)


def _buffer_names(model: nn.Module) -> set[str]:
    return {name for name, _ in collectives.unwrap(model).named_buffers()}


def _dcp_model_state(model: nn.Module, trainable_only: bool, state: Any = None) -> Any:
    """The model's DCP state dict (``state``: one already taken). ``trainable_only``: its
    trainable parameters only. DCP's ``ignore_frozen_params`` keeps the buffers; they are
    dropped here, so the several-rank path holds what the one-process path holds."""
    if state is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(model, options=_options(trainable_only))
    if trainable_only:
        buffers = _buffer_names(model)
        state = {k: v for k, v in state.items() if k not in buffers}
    return state


def uses_dcp(model: nn.Module | None) -> bool:
    """Several ranks, or sharded (DTensor) parameters: model and optimizer go through DCP."""
    if not collectives.is_initialized() or model is None:
        return False
    if collectives.world_size() > 1:
        return True
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


# ------------------------------------------------------------------------ optimizer state


def param_fqns(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Names of the parameters of each optimizer group, in the optimizer's order."""
    names = {id(p): n for n, p in collectives.unwrap(model).named_parameters()}
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        if any(id(p) not in names for p in group["params"]):
            raise CheckpointError(
                f"optimizer param group {i} holds a parameter that is not in the model passed "
                "with it; checkpoint the model the optimizer was built for"
            )
        groups.append([names[id(p)] for p in group["params"]])
    return groups


def local_optim_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with parameter names instead of positions."""
    sd = optimizer.state_dict()
    fqns = [n for group in param_fqns(model, optimizer) for n in group]
    ids = [i for group in sd["param_groups"] for i in group["params"]]
    name = dict(zip(ids, fqns, strict=True))
    return {
        "state": {name[i]: s for i, s in sd["state"].items()},
        "param_groups": [
            {**g, "params": [name[i] for i in g["params"]]} for g in sd["param_groups"]
        ],
    }


def load_optim_full(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Load a name-keyed full optimizer state (validated by :func:`optim_problems`)."""
    if saved["state"] and uses_dcp(model):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(model, optimizer, saved, options=options)
        # It hands hyperparameters back through lists (betas becomes a list): put the saved
        # values back as they were.
        for group, old in zip(optimizer.param_groups, saved["param_groups"], strict=True):
            group.update({k: v for k, v in old.items() if k != "params"})
        return
    groups = param_fqns(model, optimizer)
    index = {n: i for i, n in enumerate(n for group in groups for n in group)}
    optimizer.load_state_dict(
        {
            "state": {index[n]: s for n, s in saved["state"].items()},
            # Positions of the CURRENT optimizer: torch pairs saved and current params by order.
            "param_groups": [
                {**g, "params": [index[n] for n in now]}
                for g, now in zip(saved["param_groups"], groups, strict=True)
            ],
        }
    )


# ----------------------------------------------------------------------------- validation


def expected_shapes(model: nn.Module, trainable_only: bool = False) -> dict[str, tuple | None]:
    if uses_dcp(model):
        state = _dcp_model_state(model, trainable_only)  # DTensor.shape is the global shape
    elif trainable_only:
        state = trainable_state(model)
    else:
        state = collectives.unwrap(model).state_dict()
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in state.items()}


def listed(keys: list[str], limit: int = 20) -> str:
    more = f" ... and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def module_problems(saved: Mapping[str, tuple | None], expected: Mapping[str, Any]) -> list[str]:
    problems = []
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    mismatched = [
        f"{k} (checkpoint {saved[k]}, model {expected[k]})"
        for k in sorted(set(saved) & set(expected))
        if saved[k] != expected[k]
    ]
    if missing:
        problems.append(f"missing keys (in the model, not in the checkpoint): {listed(missing)}")
    if unexpected:
        problems.append(f"unexpected keys (not in the model): {listed(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatches: {listed(mismatched)}")
    return problems


def optim_problems(saved: Mapping[str, Any], groups: list[list[str]]) -> list[str]:
    saved_groups = [list(g["params"]) for g in saved["param_groups"]]
    if len(saved_groups) != len(groups):
        return [f"optimizer has {len(groups)} param groups, the checkpoint {len(saved_groups)}"]
    problems = []
    for i, (old, now) in enumerate(zip(saved_groups, groups, strict=True)):
        missing, unexpected = sorted(set(now) - set(old)), sorted(set(old) - set(now))
        if missing or unexpected:
            problems.append(
                f"optimizer param group {i}: missing {listed(missing) or '-'}, "
                f"unexpected {listed(unexpected) or '-'}"
            )
    stray = sorted(set(saved["state"]) - {n for group in groups for n in group})
    if stray:
        problems.append(f"optimizer state for unknown parameters: {listed(stray)}")
    return problems


# ----------------------------------------------------------------------------- DCP path


def dcp_save(
    folder: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    trainable_only: bool = False,
) -> bool:
    """Collective save of model (+ optimizer, when it has state) under ``folder/dcp``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    # An empty optimizer is not given to get_state_dict: it would initialise it with a
    # zero-lr step (see the gradstep.checkpoint docstring); its hyperparameters go to the
    # manifest.
    with_optim = optimizer is not None and bool(optimizer.state)
    options = _options(trainable_only)
    if with_optim:
        msd, osd = get_state_dict(model, optimizer, options=options)
        payload = {"model": _dcp_model_state(model, trainable_only, msd), "optim": osd}
    else:
        payload = {"model": _dcp_model_state(model, trainable_only)}
    dcp.save(payload, storage_writer=dcp.FileSystemWriter(str(folder / "dcp")))
    return with_optim


def _dcp_load(payload: dict[str, Any], path: str) -> None:
    """DCP's load through the safe reader and planner (:mod:`.safe_dcp`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from .safe_dcp import SafeLoadPlanner, SafeReader

    reader, planner = SafeReader(path), SafeLoadPlanner(path)
    with warnings.catch_warnings():
        # Loading a multi-rank checkpoint into one process is what we mean to do here.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        try:
            dcp.load(
                payload, storage_reader=reader, planner=planner,
                no_dist=not collectives.is_initialized(),
            )  # fmt: skip
        except CheckpointException as exc:  # every rank's failures, gathered by DCP
            refused = [e for e, _ in exc.failures.values() if isinstance(e, CheckpointError)]
            if refused:
                raise CheckpointError(str(refused[0])) from None
            raise


def dcp_prepare(
    folder: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    optim_in_dcp: bool,
    trainable_only: bool = False,
) -> tuple[list[str], Callable[[], None]]:
    """Validate a DCP checkpoint against the model; return (problems, loader)."""
    from torch.distributed.checkpoint.state_dict import (
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    path = str(folder / "dcp")
    from .safe_dcp import check_entries, read_metadata

    metadata = read_metadata(path)
    check_entries(path, metadata)  # a forged entry is refused before anything is loaded
    meta = metadata.state_dict_metadata
    saved = {
        k.removeprefix("model."): tuple(v.size) if hasattr(v, "size") else None
        for k, v in meta.items()
        if k.startswith("model.")
    }
    if trainable_only:  # buffers are never loaded into a trainable-only model, even if saved
        saved = {k: v for k, v in saved.items() if k not in _buffer_names(model)}
    problems = module_problems(saved, expected_shapes(model, trainable_only))
    options = _options(trainable_only)
    if optimizer is not None and optim_in_dcp:
        n_groups = sum(bool(re.fullmatch(r"optim\.param_groups\.\d+\.params", k)) for k in meta)
        if n_groups != len(optimizer.param_groups):
            problems.append(
                f"optimizer has {len(optimizer.param_groups)} param groups, the checkpoint "
                f"{n_groups}"
            )

    def load() -> None:
        if optimizer is not None and optim_in_dcp:
            msd, osd = get_state_dict(model, optimizer, options=options)
            msd = _dcp_model_state(model, trainable_only, msd)
            payload = {"model": msd, "optim": osd}
            _dcp_load(payload, path)
            set_state_dict(
                model, optimizer, model_state_dict=msd, optim_state_dict=osd, options=options
            )
        else:
            payload = {"model": _dcp_model_state(model, trainable_only)}
            _dcp_load(payload, path)
            set_model_state_dict(model, payload["model"], options=options)

    return problems, load


# ---------------------------------------------------------------------------- file path


def file_prepare(
    folder: Path, entry: dict, model: nn.Module
) -> tuple[list[str], Callable[[], None]]:
    """Read and validate a single-process (safetensors) module state; return the loader.

    A ``trainable_only`` entry holds exactly the model's trainable parameters; loading it
    leaves frozen weights and buffers as they are."""
    trainable_only = bool(entry.get("trainable_only", False))
    state = read_tensor_file(folder / entry["file"], entry.get("aliases", {}))
    saved = {k: tuple(v.shape) for k, v in state.items()}
    problems = module_problems(saved, expected_shapes(model, trainable_only))

    def load() -> None:
        if uses_dcp(model):  # 1 -> N ranks: every rank holds the full tensors; shard them
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            options = _options(trainable_only, full_state_dict=True)
            set_model_state_dict(model, state, options=options)
        else:
            # strict=False only for trainable_only: the keys were checked against exactly
            # the trainable parameters above, so nothing is silently left out.
            collectives.unwrap(model).load_state_dict(state, strict=not trainable_only)

    return problems, load
