"""``dcp/.metadata`` is read as data (gradstep.checkpoint.safe_dcp): a real DCP metadata file
reads back as torch's own reader reads it (every dtype included), and a metadata pickle that
names any other global of torch (a function that writes a file or unpickles one) is refused
before that global runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from gradstep.checkpoint import CheckpointError
from gradstep.checkpoint.safe_dcp import read_metadata

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.bool)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_real_metadata_reads_as_torchs_reader_reads_it(tmp_path: Path) -> None:
    state = {f"t{i}": torch.zeros(3, 2, dtype=dtype) for i, dtype in enumerate(DTYPES)}
    state["step"] = 7  # a non-tensor entry (BytesStorageMetadata)
    dcp.save(state, checkpoint_id=tmp_path)  # one process: no process group needed
    ours = read_metadata(tmp_path)
    theirs = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data
    dtypes = [ours.state_dict_metadata[f"t{i}"].properties.dtype for i in range(len(DTYPES))]
    assert dtypes == list(DTYPES)


def _global_call(module: str, name: str, *args: str) -> bytes:
    """A protocol-0 pickle that calls ``module.name(*args)`` when it is loaded."""
    strings = "".join(f"V{a}\n" for a in args)
    return f"c{module}\n{name}\n({strings}tR.".encode()


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("torch", "save"),  # the top-level module: a function, not a dtype
        ("torch.serialization", "save"),  # a submodule of torch
        ("torch.serialization", "load"),  # unpickles whatever file it is given
        ("torch.storage", "_load_from_bytes"),
    ],
)
def test_a_metadata_file_naming_another_torch_global_is_refused_before_it_runs(
    tmp_path: Path, module: str, name: str
) -> None:
    marker = tmp_path / "PWNED"
    folder = tmp_path / "dcp"
    folder.mkdir()
    (folder / ".metadata").write_bytes(_global_call(module, name, "payload", str(marker)))
    with pytest.raises(CheckpointError) as caught:
        read_metadata(folder)
    message = str(caught.value)
    assert "refused to read" in message and f"{module}.{name}" in message, message
    assert "would run code of its own" in message, message
    assert not marker.exists()
