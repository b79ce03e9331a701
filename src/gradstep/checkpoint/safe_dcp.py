"""Reading a DCP checkpoint as data, never as code.

``torch.distributed.checkpoint`` keeps two pickles in a checkpoint: the ``dcp/.metadata``
file (read with plain ``pickle.load``) and the non-tensor entries of the state (optimizer
hyperparameters, read with ``torch.load(weights_only=False)``). Either runs whatever a
forged file asks for, and the manifest's checksums cannot stop that: they are sha256 sums
anyone can recompute, so they detect corruption, not tampering.

Every DCP read of gradstep goes through :class:`SafeReader` (the metadata, through an
unpickler that builds only the classes DCP's metadata is made of) and
:class:`SafeLoadPlanner` (the non-tensor entries, through ``torch.load(weights_only=True)``,
as DCP already reads the tensors). Anything else is refused with a
:class:`~gradstep.checkpoint.CheckpointError` naming the file, before it runs.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from .errors import CheckpointError

__all__ = [
    "ALLOWED",
    "SafeLoadPlanner",
    "SafeReader",
    "check_entries",
    "load_plain",
    "read_metadata",
]

_METADATA = "torch.distributed.checkpoint.metadata"
ALLOWED: frozenset[tuple[str, str]] = frozenset({
    *((_METADATA, name) for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "TensorProperties", "ChunkStorageMetadata",
        "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING",
    )),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
})  # fmt: skip
"""``(module, name)`` pairs a DCP ``.metadata`` may name (torch 2.6-2.13), besides torch's
dtypes: the metadata dataclasses, their enum, paths, sizes and layouts. None of them runs
anything when built."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, path: Path) -> None:
        super().__init__(io.BytesIO(data))
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"refused to read {self.path}: it asks to build {module}.{name}, which is not "
            "part of torch.distributed.checkpoint's metadata. A DCP .metadata file is a "
            "pickle, and this one would run code of its own: it was forged or written by "
            "another tool. Nothing of it was run or loaded; do not open this checkpoint "
            "with plain torch or pickle either"
        )


def read_metadata(path: str | Path) -> Any:
    """The ``Metadata`` of the DCP folder ``path``, unpickled with :data:`ALLOWED` only."""
    path = Path(path) / ".metadata"
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return _MetadataUnpickler(data, path).load()
    except CheckpointError:
        raise
    except Exception as exc:  # truncated or not a pickle at all
        raise CheckpointError(f"{path} is not a DCP metadata file ({exc})") from None


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read by :func:`read_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("rank") is not None:  # a per-rank metadata layout gradstep never writes
            raise CheckpointError(f"{self.path}: per-rank DCP metadata is not read by gradstep")
        metadata = read_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def check_entries(path: str | Path, metadata: Any) -> None:
    """Read every non-tensor entry of the DCP folder ``path`` as plain data, before anything
    is loaded: a forged entry is refused while the model is still untouched (DCP copies
    tensors into the model as it reads them, entry by entry)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    path = Path(path)
    for fqn, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, BytesStorageMetadata):
            continue
        info = metadata.storage_data.get(MetadataIndex(fqn))
        if info is None or getattr(info, "transform_descriptors", None):
            raise CheckpointError(
                f"{path}: entry {fqn!r} is stored in a way gradstep never writes (missing, or "
                "transformed); the checkpoint was written by another tool"
            )
        try:
            with open(path / info.relative_path, "rb") as fh:
                fh.seek(info.offset)
                data = fh.read(info.length)
        except OSError as exc:
            raise CheckpointError(f"cannot read {path / info.relative_path}: {exc}") from None
        load_plain(io.BytesIO(data), fqn, path)


def load_plain(value: io.BytesIO, fqn: str, path: Path) -> Any:
    """One non-tensor entry, unpickled with ``weights_only=True`` (plain data only)."""
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as exc:
        lines = str(exc).splitlines()
        why = next((ln.strip() for ln in lines if "GLOBAL" in ln), lines[0] if lines else "")
        raise CheckpointError(
            f"refused to read entry {fqn!r} of {path}: it is not plain data ({why}). "
            "Nothing of it was run or loaded; the checkpoint was forged or written by another "
            "tool"
        ) from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, reading non-tensor entries with ``weights_only=True``."""

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.path = Path(path)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        load_plain(value, read_item.dest_index.fqn, self.path)
        # Plain data, as weights_only just proved: DCP's own loader may unpickle it now.
        value.seek(0)
        super().load_bytes(read_item, value)
