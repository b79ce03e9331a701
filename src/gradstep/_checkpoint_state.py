"""State <-> files for :mod:`gradstep.checkpoint`: encoding, tensor files, RNG, model/optimizer.

The format and the reasons behind it are documented in :mod:`gradstep.checkpoint`.
"""

from __future__ import annotations

import base64
import hashlib
import math
import os
import random
import re
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
import torch.distributed as dist
from torch import nn

from .distributed import is_initialized, world_size

_TAG = "__gradstep__"
_CHUNK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint cannot be written or does not fit the objects it is loaded into."""


# --------------------------------------------------------------------------- distributed


def barrier() -> None:
    if is_initialized():
        dist.barrier()


def from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (identity on one process)."""
    if not is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def uses_dcp(model: nn.Module | None) -> bool:
    """Several ranks, or sharded (DTensor) parameters: model and optimizer go through DCP."""
    if not is_initialized() or model is None:
        return False
    if world_size() > 1:
        return True
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


# ------------------------------------------------------------------------ files and fsync


def fsync(path: Path) -> None:
    """Flush a file's or a folder's metadata/contents to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def write_tensor_file(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Write ``tensors`` with safetensors; return ``{alias: key}`` for tied tensors.

    safetensors refuses tensors sharing memory (tied weights): an exact duplicate is stored
    once and recorded as an alias, a partial overlap is stored as a copy.
    """
    out: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    storages: set[int] = set()
    for key, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(
                f"cannot store {key!r} of type {type(tensor).__name__} in a tensor file"
            )
        t = tensor.detach()
        ptr = t.untyped_storage().data_ptr() if t.numel() else 0
        ident = (t.device, ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if ptr and ident in seen:
            aliases[key] = seen[ident]
            continue
        if ptr and ptr in storages:
            t = t.clone()
        seen[ident] = key
        storages.add(ptr)
        out[key] = t.to("cpu").contiguous()
    safetensors.torch.save_file(out, str(path))
    fsync(path)
    return aliases


def read_tensor_file(path: Path, aliases: Mapping[str, str]) -> dict[str, torch.Tensor]:
    tensors = safetensors.torch.load_file(str(path), device="cpu")
    for alias, key in aliases.items():
        tensors[alias] = tensors[key]
    return tensors


# ------------------------------------------------------------------ state <-> strict JSON


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def encode(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON-able form of a state value; tensors are moved into ``tensors``."""
    if isinstance(value, torch.Tensor):
        key = path if path not in tensors else f"{path}#{len(tensors)}"
        tensors[key] = value
        return {_TAG: "tensor", "key": key}
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {_TAG: "float", "v": repr(value)}
    if isinstance(value, np.ndarray):
        return {_TAG: "ndarray", "dtype": value.dtype.str, "v": value.tolist()}
    if isinstance(value, np.generic):
        return encode(value.item(), path, tensors)
    if isinstance(value, torch.dtype):
        return {_TAG: "dtype", "v": str(value).removeprefix("torch.")}
    if isinstance(value, bytes):
        return {_TAG: "bytes", "v": base64.b64encode(value).decode()}
    if isinstance(value, tuple):
        return {
            _TAG: "tuple",
            "v": [encode(v, _join(path, i), tensors) for i, v in enumerate(value)],
        }
    if isinstance(value, list):
        return [encode(v, _join(path, i), tensors) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value) and _TAG not in value:
            return {k: encode(v, _join(path, k), tensors) for k, v in value.items()}
        pairs = [
            [encode(k, path, {}), encode(v, _join(path, k), tensors)] for k, v in value.items()
        ]
        return {_TAG: "dict", "v": pairs}
    raise CheckpointError(
        f"cannot checkpoint {path} of type {type(value).__name__}: state_dict values must be "
        "tensors, numbers, strings, bools, None, bytes, numpy arrays, lists, tuples or dicts"
    )


def decode(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    tag = value.get(_TAG)
    if tag is None:
        return {k: decode(v, tensors) for k, v in value.items()}
    if tag == "tensor":
        return tensors[value["key"]]
    if tag == "float":
        return float(value["v"])
    if tag == "ndarray":
        return np.array(value["v"], dtype=np.dtype(value["dtype"]))
    if tag == "dtype":
        return getattr(torch, value["v"])
    if tag == "bytes":
        return base64.b64decode(value["v"])
    if tag == "tuple":
        return tuple(decode(v, tensors) for v in value["v"])
    if tag == "dict":
        return {decode(k, tensors): decode(v, tensors) for k, v in value["v"]}
    raise CheckpointError(f"unknown tag {tag!r} in checkpoint state (newer gradstep?)")


# ----------------------------------------------------------------------------- RNG state


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state().numpy().tobytes(),
    }
    # Only when CUDA is already in use: querying it would initialise a CUDA context.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        cuda = [torch.frombuffer(bytearray(s), dtype=torch.uint8) for s in state["cuda"]]
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])


def rng_file(r: int) -> str:
    return f"rng-rank{r:05d}.json"


# --------------------------------------------------------------- model and optimizer state


def unwrap(model: nn.Module) -> nn.Module:
    """The module whose names are the checkpoint keys: no DDP ``module.`` or compile prefix."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod  # torch.compile's OptimizedModule
        else:
            return model


def param_fqns(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Names of the parameters of each optimizer group, in the optimizer's order."""
    names = {id(p): n for n, p in unwrap(model).named_parameters()}
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


def expected_shapes(model: nn.Module) -> dict[str, tuple | None]:
    if uses_dcp(model):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(model)  # DTensor.shape is the global shape
    else:
        state = unwrap(model).state_dict()
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


def dcp_save(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> bool:
    """Collective save of model (+ optimizer, when it has state) under ``folder/dcp``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    # An empty optimizer is not given to get_state_dict: it would initialise it with a
    # zero-lr step (see the module docstring); its hyperparameters go to the manifest.
    with_optim = optimizer is not None and bool(optimizer.state)
    if with_optim:
        msd, osd = get_state_dict(model, optimizer)
        payload = {"model": msd, "optim": osd}
    else:
        payload = {"model": get_model_state_dict(model)}
    dcp.save(payload, storage_writer=dcp.FileSystemWriter(str(folder / "dcp")))
    return with_optim


def _dcp_load(payload: dict[str, Any], path: str) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        # Loading a multi-rank checkpoint into one process is what we mean to do here.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(payload, checkpoint_id=path, no_dist=not is_initialized())


def dcp_prepare(
    folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, optim_in_dcp: bool
) -> tuple[list[str], Callable[[], None]]:
    """Validate a DCP checkpoint against the model; return (problems, loader)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    path = str(folder / "dcp")
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    saved = {
        k.removeprefix("model."): tuple(v.size) if hasattr(v, "size") else None
        for k, v in meta.items()
        if k.startswith("model.")
    }
    problems = module_problems(saved, expected_shapes(model))
    if optimizer is not None and optim_in_dcp:
        n_groups = sum(bool(re.fullmatch(r"optim\.param_groups\.\d+\.params", k)) for k in meta)
        if n_groups != len(optimizer.param_groups):
            problems.append(
                f"optimizer has {len(optimizer.param_groups)} param groups, the checkpoint "
                f"{n_groups}"
            )

    def load() -> None:
        if optimizer is not None and optim_in_dcp:
            msd, osd = get_state_dict(model, optimizer)
            payload = {"model": msd, "optim": osd}
            _dcp_load(payload, path)
            set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
        else:
            payload = {"model": get_model_state_dict(model)}
            _dcp_load(payload, path)
            set_model_state_dict(model, payload["model"])

    return problems, load


def file_prepare(
    folder: Path, entry: dict, model: nn.Module
) -> tuple[list[str], Callable[[], None]]:
    """Read and validate a single-process (safetensors) module state; return the loader."""
    state = read_tensor_file(folder / entry["file"], entry.get("aliases", {}))
    saved = {k: tuple(v.shape) for k, v in state.items()}
    problems = module_problems(saved, expected_shapes(model))

    def load() -> None:
        if uses_dcp(model):  # 1 -> N ranks: every rank holds the full tensors; shard them
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
            )

            set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
        else:
            unwrap(model).load_state_dict(state)

    return problems, load
