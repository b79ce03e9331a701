"""State values <-> strict JSON, and tensors <-> safetensors files.

Non-tensor state goes into the manifest as JSON; tensors are replaced by ``{"__gradstep__":
"tensor", "key": K}`` references into a safetensors file. Tuples, non-finite floats, numpy
arrays, dtypes, bytes and dicts with non-string keys are tagged the same way, so the JSON
is strict and decodes to exactly what was encoded.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.torch
import torch

from .errors import CheckpointError, write_failed
from .layout import fsync

__all__ = ["decode", "encode", "read_tensor_file", "saved_state", "write_tensor_file"]

_TAG = "__gradstep__"


# ------------------------------------------------------------------------- tensor files


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
    try:
        safetensors.torch.save_file(out, str(path))
        fsync(path)
    except (OSError, safetensors.SafetensorError) as exc:  # disk full, file-size limit
        raise write_failed(path, exc) from exc
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


def saved_state(manifest: Mapping[str, Any], name: str) -> Any:
    """The state object ``name`` was checkpointed with, read from a checkpoint's
    ``manifest`` (``CheckpointInfo.manifest``: already verified, no file is read), for
    deciding before anything is built (a run's saved settings, a schedule's horizon).
    None when the checkpoint holds no such object or no state of it (a model, an
    optimizer). State holding tensors is refused: those are in the object's file."""
    entry = manifest.get("objects", {}).get(name)
    if entry is None or "state" not in entry:
        return None
    try:
        return decode(entry["state"], {})
    except KeyError:
        raise CheckpointError(
            f"the state of {name!r} holds tensors: load it with Checkpointer.load"
        ) from None
