"""The base fingerprint of adapter-only checkpoints (``Checkpointer(trainable_only=True)``).

hf-client-2 "Wrong base": adapters resumed onto a base built from another seed loaded in
silence. Now the manifest records a fingerprint of the frozen weights, and a load onto
another base is refused before anything changes; a checkpoint saved before fingerprints
still loads, with a warning. The bitwise resume on the same base is
tests/hf/test_peft.py::test_trainable_only_checkpoint_resumes_bitwise_and_holds_no_frozen_weight.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradstep.checkpoint import Checkpointer, CheckpointError, base_fingerprint, fingerprint
from gradstep.checkpoint.layout import MANIFEST, write_manifest
from tests.checkpoint.fingerprint_ranks import adapted, adapters, save_and_check
from tests.support.multiproc import run_ranks

FROZEN = ["blocks.0.base.bias", "blocks.0.base.weight", "blocks.1.base.bias",
          "blocks.1.base.weight", "embed.weight"]  # fmt: skip


def _save(folder: Path, model: torch.nn.Module, **others: object) -> Path:
    return Checkpointer(folder, trainable_only=True).save(3, model=model, **others)


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    model(torch.arange(6).view(2, 3)).square().sum().backward()
    opt.step()  # moments to restore (or, refused, to leave alone)
    return opt


def test_the_manifest_records_the_base_and_the_same_base_loads(tmp_path: Path) -> None:
    trained = adapted(0, adapter_seed=5)
    folder = _save(tmp_path, trained)
    info = Checkpointer(tmp_path).latest()
    assert info.base_fingerprint == base_fingerprint(adapted(0))  # a fresh, equal base
    assert sorted(info.base_fingerprint.tensors) == FROZEN
    entry = json.loads((folder / MANIFEST).read_text())["objects"]["model"]
    assert entry["base_fingerprint"]["algorithm"] == fingerprint.ALGORITHM
    fresh = adapted(0)
    Checkpointer(tmp_path, trainable_only=True).load_latest(model=fresh)
    want = adapters(trained)
    assert all(torch.equal(v, adapters(fresh)[k]) for k, v in want.items())


@pytest.mark.parametrize(
    ("base", "differs"),
    [
        (lambda: adapted(1), "5 frozen tensor(s) that differ"),
        (lambda: adapted(0, dtype=torch.float64), "checkpoint float32 [8] "),
    ],
    ids=["another-seed", "another-dtype"],
)
def test_another_base_is_refused_naming_both_fingerprints(tmp_path: Path, base, differs) -> None:  # noqa: ANN001
    trained = adapted(0, adapter_seed=5)
    _save(tmp_path, trained, optimizer=_optimizer(trained))
    other = base()
    opt = _optimizer(other)
    before = adapters(other), {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    with pytest.raises(CheckpointError) as err:
        Checkpointer(tmp_path, trainable_only=True).load_latest(model=other, optimizer=opt)
    message = str(err.value)
    saved, now = base_fingerprint(trained), base_fingerprint(other)
    assert saved.describe() in message and now.describe() in message
    assert saved.digest[:16] != now.digest[:16]
    assert "trained on another base" in message and differs in message
    assert "nothing was loaded" in message
    after = adapters(other), opt.state_dict()["state"][0]
    assert all(torch.equal(v, after[0][k]) for k, v in before[0].items())
    assert all(torch.equal(v, after[1][k]) for k, v in before[1].items())


def test_a_checkpoint_from_before_fingerprints_loads_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trained = adapted(0, adapter_seed=5)
    folder = _save(tmp_path, trained)
    raw = json.loads((folder / MANIFEST).read_text())
    del raw["checksum"], raw["objects"]["model"]["base_fingerprint"]
    write_manifest(folder, raw)  # what an older gradstep wrote: valid, no fingerprint
    info = Checkpointer(tmp_path).latest()
    assert info is not None and info.base_fingerprint is None
    fresh = adapted(1)  # unverifiable: even another base loads, as before
    with caplog.at_level(logging.WARNING, logger="gradstep.checkpoint"):
        Checkpointer(tmp_path, trainable_only=True).load(info, model=fresh)
    assert "records no base fingerprint" in caplog.text and str(folder) in caplog.text
    assert all(torch.equal(v, adapters(fresh)[k]) for k, v in adapters(trained).items())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    index=st.integers(0, 10_000),
    element=st.integers(0, 10_000),
    value=st.floats(-4, 4, allow_nan=False, width=32),
)
def test_the_fingerprint_changes_exactly_when_a_frozen_value_does(
    index: int, element: int, value: float
) -> None:
    """For any parameter and element: an in-place write (on the same model object, whose
    fingerprint was remembered) changes the fingerprint iff the parameter is frozen and the
    value's bits change; only that tensor is named; buffers never count."""
    model = adapted(0)
    before = base_fingerprint(model)
    name, p = sorted(model.named_parameters())[index % len(list(model.parameters()))]
    flat = p.detach().view(-1)
    i = element % flat.numel()
    bits_change = not torch.equal(flat[i], torch.tensor(value, dtype=p.dtype))
    with torch.no_grad():
        flat[i] = value
        model.blocks[0].scale.mul_(2)  # a buffer
    after = base_fingerprint(model)
    assert after == base_fingerprint(copy.deepcopy(model))  # remembered == computed afresh
    if p.requires_grad or not bits_change:
        assert after == before
    else:
        assert after.digest != before.digest
        assert f"1 frozen tensor(s) that differ ({name})" in fingerprint.mismatch(before, after)


def test_replacing_a_frozen_tensor_chunks_and_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    model = adapted(0)
    whole = base_fingerprint(model)
    monkeypatch.setattr(fingerprint, "_CHUNK", 7)  # bytes per update: 7 (odd on purpose)
    monkeypatch.setattr(fingerprint, "_THREADS", 1)
    assert base_fingerprint(adapted(0)) == whole  # chunks and threads: the same digest
    model.embed.weight.data = model.embed.weight.data + 1  # new storage: not the cached one
    assert base_fingerprint(model).digest != whole.digest


@pytest.mark.distributed
def test_ddp_and_fsdp2_ranks_agree_and_a_sharded_save_checks_in_one_process(
    tmp_path: Path,
) -> None:
    """2 gloo ranks: the fingerprint of the DDP-wrapped and of the FSDP2-sharded base equals
    one process's; their adapter-only checkpoints load onto the same base (the saved
    adapters) and are refused on every rank onto another one (nothing changed). The FSDP2
    checkpoint, resharded into one process, is checked the same way."""
    single = base_fingerprint(adapted(0)).digest
    want = adapters(adapted(0, adapter_seed=5))
    for strategy in ("ddp", "fsdp"):
        folder = tmp_path / strategy
        for res in run_ranks(save_and_check, 2, str(folder), strategy, timeout=240):
            assert res["digest"] == single, strategy
            assert res["same_error"] is None, strategy
            assert all(torch.equal(v, res["loaded"][k]) for k, v in want.items()), strategy
            assert "trained on another base" in res["other_error"], strategy
            assert res["other_untouched"], strategy
    fresh = adapted(0)
    Checkpointer(tmp_path / "fsdp", trainable_only=True).load_latest(model=fresh)
    assert all(torch.equal(v, adapters(fresh)[k]) for k, v in want.items())
    with pytest.raises(CheckpointError, match="trained on another base"):
        Checkpointer(tmp_path / "fsdp", trainable_only=True).load_latest(model=adapted(1))
