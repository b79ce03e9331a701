"""Forge a several-rank (DCP) checkpoint the way an attacker would (robustness-3 S4, S11):
a pickle payload in ``dcp/.metadata``, or in one non-tensor entry of a ``.distcp`` file,
and every checksum of the manifest recomputed so that the folder verifies."""

from __future__ import annotations

import io
import json
import os
import pickle
from dataclasses import replace
from pathlib import Path

import torch

from gradstep.checkpoint.layout import MANIFEST, file_table, write_manifest
from gradstep.checkpoint.safe_dcp import read_metadata


class Payload:
    """Unpickling this runs ``touch MARKER`` (``os.system``): proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def reseal(step: Path) -> None:
    """Recompute every file's sha256 and the manifest's own checksum."""
    manifest = json.loads((step / MANIFEST).read_text())
    manifest.pop("checksum")
    manifest["files"] = file_table(step)
    write_manifest(step, manifest)  # with its checksum over the rest, as gradstep writes it


def forge_metadata(step: Path, marker: Path) -> None:
    """``dcp/.metadata`` replaced by a payload."""
    (step / "dcp" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    reseal(step)


def forge_entry(step: Path, marker: Path, fqn: str = "optim.param_groups.0.lr") -> None:
    """One non-tensor entry (torch saves it as a pickle inside a ``.distcp`` file) pointed at
    an appended payload; the metadata itself stays plain data."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    meta = read_metadata(step / "dcp")
    index = MetadataIndex(fqn)
    info = meta.storage_data[index]
    buffer = io.BytesIO()
    torch.save(Payload(marker), buffer)
    target = step / "dcp" / info.relative_path
    offset = target.stat().st_size
    with open(target, "ab") as fh:
        fh.write(buffer.getvalue())
    meta.storage_data[index] = replace(info, offset=offset, length=len(buffer.getvalue()))
    (step / "dcp" / ".metadata").write_bytes(pickle.dumps(meta))
    reseal(step)
