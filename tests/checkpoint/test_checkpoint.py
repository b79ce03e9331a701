"""Checkpoint and resume: exact (bitwise), atomic (SIGKILL at any point), verified, elastic.

Every claim is checked against the plain computation: the uninterrupted run for resume,
the previously saved state for fault cases, the single-process stream for elastic runs.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import gradstep
from gradstep.checkpoint import (
    MANIFEST,
    Checkpointer,
    CheckpointError,
    elastic_accum_steps,
)
from gradstep_cli.train import WarmupCosine
from tests.checkpoint.helpers import (
    LR,
    MAX_STEPS,
    WARMUP,
    Blob,
    assert_same_state,
    build,
    scramble_rng,
    snapshot_run,
    train,
)
from tests.support.batches import text_corpus

N = 4  # steps before and after the interruption


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models on a shared 2-core machine: more threads only add contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------- exact resume


def _adaptive_clips() -> list:
    from gradstep.policies import AutoClip, ZClip

    return [AutoClip(percentile=50.0), ZClip(warmup_steps=2, z_thresh=0.5)]


@pytest.mark.parametrize(
    ("precision", "adaptive"), [("fp32", False), ("fp16", False), ("fp32", True)]
)
def test_resume_is_bitwise_identical_to_uninterrupted(
    tmp_path: Path, precision: str, adaptive: bool
) -> None:
    """N steps, save, fresh objects + load, N steps == 2N uninterrupted steps, bit for bit:
    parameters, optimizer state, scheduler, Stepper counters, fp16 scaler and stateful clip
    policies (AutoClip history, ZClip EMA), data position, RNG (dropout is on), and every
    StepStats field of every step."""
    clip = _adaptive_clips if adaptive else lambda: None
    run = build(precision, clip=clip())
    first = train(run, N)
    Checkpointer(tmp_path, accum_steps=2).save(N, **run)
    rest = train(run, N)  # the uninterrupted run continues from the same RNG state
    expected = snapshot_run(run)

    resumed = build(precision, clip=clip())
    scramble_rng()
    assert Checkpointer(tmp_path).load_latest(**resumed) == N
    after = train(resumed, N)

    assert after == rest  # dataclass equality: every float exactly equal
    assert_same_state(snapshot_run(resumed), expected)
    assert [s.step for s in first + after] == list(range(1, 2 * N + 1))
    # The LR schedule continues from the global step: no second warm-up.
    schedule = WarmupCosine(WARMUP, MAX_STEPS, 0.1)
    assert [s.lr for s in after] == [LR * schedule(N + i) for i in range(N)]
    if precision == "fp16":
        assert all(s.loss_scale is not None for s in after)
    if adaptive:  # the restored policy state was used: they clipped after the resume
        assert any(p["acted"] for s in after for p in s.policies)
        assert resumed["stepper"].state_dict()["clip"] == run["stepper"].state_dict()["clip"]


def test_save_at_step_zero_keeps_the_optimizer_fresh(tmp_path: Path) -> None:
    """A checkpoint of an untrained run must not give the optimizer state (AdamW step 1)."""
    run = build()
    Checkpointer(tmp_path).save(0, **run)
    assert not run["optimizer"].state  # saving did not initialise the live optimizer
    expected = train(run, 3)

    resumed = build()
    assert Checkpointer(tmp_path).load_latest(**resumed) == 0
    assert not resumed["optimizer"].state
    assert train(resumed, 3) == expected


def test_manifest_records_the_run_and_checksums_every_file(tmp_path: Path) -> None:
    run = build()
    train(run, 2)
    path = Checkpointer(tmp_path, accum_steps=2, micro_batch_size=2).save(2, **run)
    assert path == tmp_path / "step-000002"
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["format"] == "gradstep-checkpoint" and manifest["step"] == 2
    assert (manifest["world_size"], manifest["accum_steps"], manifest["micro_batch_size"]) == (
        1,
        2,
        2,
    )
    assert manifest["global_batch"] == 4 and manifest["global_micro_batches"] == 2
    assert manifest["gradstep_version"] == gradstep.__version__
    assert manifest["torch_version"] == torch.__version__
    on_disk = {p.name for p in path.iterdir()} - {MANIFEST}
    assert on_disk == {"model.safetensors", "optimizer.safetensors", "rng-rank00000.json"}
    assert set(manifest["files"]) == on_disk
    kinds = {name: entry["kind"] for name, entry in manifest["objects"].items()}
    assert kinds == {
        "model": "module",
        "optimizer": "optimizer",
        "scheduler": "object",
        "stepper": "object",
        "data": "object",
    }
    # The tied head is stored once and restored as an alias of the embedding.
    assert manifest["objects"]["model"]["aliases"] == {"lm_head.weight": "embed.weight"}
    assert manifest["objects"]["data"]["state"]["index"] == 4


def test_keep_prunes_the_oldest(tmp_path: Path) -> None:
    run = build()
    checkpointer = Checkpointer(tmp_path, keep=2)
    for step in range(5):
        checkpointer.save(step, model=run["model"])
    assert sorted(os.listdir(tmp_path)) == ["step-000003", "step-000004"]
    assert checkpointer.checkpoints() == [tmp_path / "step-000004", tmp_path / "step-000003"]


def test_saving_a_step_again_replaces_it(tmp_path: Path) -> None:
    run = build()
    checkpointer = Checkpointer(tmp_path)
    checkpointer.save(1, model=run["model"])
    with torch.no_grad():
        run["model"].embed.weight.add_(1.0)
    checkpointer.save(1, model=run["model"])
    expected = run["model"].embed.weight.detach().clone()
    fresh = build()
    assert checkpointer.load_latest(model=fresh["model"]) == 1
    assert torch.equal(fresh["model"].embed.weight, expected)
    assert sorted(os.listdir(tmp_path)) == ["step-000001"]


def test_object_state_round_trips_exactly(tmp_path: Path) -> None:
    state = {
        "floats": [0.1, -0.0, 1e-310, math.inf, -math.inf, 2.0**60],
        "tuple": (1, "a", (2.5, None)),
        "int_keys": {0: "zero", 7: [True, False]},
        "counter": Counter({"nan loss": 2}),
        "bytes": b"\x00\xff",
        "array": np.arange(5, dtype=np.uint32),
        "tensor": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "dtype": torch.float16,
        "big": 2**70,
    }
    blob = Blob()
    blob.state = state
    Checkpointer(tmp_path).save(0, blob=blob)
    restored = Blob()
    Checkpointer(tmp_path).load_latest(blob=restored)
    got = restored.state
    assert got["floats"][:3] == [0.1, -0.0, 1e-310] and math.copysign(1, got["floats"][1]) < 0
    assert got["floats"][3:] == [math.inf, -math.inf, 2.0**60]
    assert got["tuple"] == (1, "a", (2.5, None)) and isinstance(got["tuple"][2], tuple)
    assert got["int_keys"] == {0: "zero", 7: [True, False]}
    assert got["counter"] == {"nan loss": 2} and got["bytes"] == b"\x00\xff"
    assert got["array"].dtype == np.uint32 and got["array"].tolist() == [0, 1, 2, 3, 4]
    assert got["tensor"].dtype == torch.bfloat16 and torch.equal(got["tensor"], state["tensor"])
    assert got["dtype"] is torch.float16 and got["big"] == 2**70
    nan_blob = Blob()
    nan_blob.state = {"x": math.nan}
    Checkpointer(tmp_path / "nan").save(0, blob=nan_blob)
    Checkpointer(tmp_path / "nan").load_latest(blob=restored)
    assert math.isnan(restored.state["x"])


def test_unsupported_state_is_named(tmp_path: Path) -> None:
    blob = Blob()
    blob.state = {"ok": 1, "inner": {"bad": object()}}
    with pytest.raises(CheckpointError, match=r"blob\.inner\.bad of type object"):
        Checkpointer(tmp_path).save(0, blob=blob)
    assert os.listdir(tmp_path) == []  # nothing half-written left behind


# ------------------------------------------------------------------- corruption and kills


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 7)


CORRUPTIONS = {
    "model flipped byte": ("model.safetensors", _flip_byte, "does not match its sha256"),
    "optimizer truncated": ("optimizer.safetensors", _truncate, "truncated"),
    "manifest flipped byte": (MANIFEST, _flip_byte, MANIFEST),
    "manifest truncated": (MANIFEST, _truncate, "not valid JSON"),
    "manifest deleted": (MANIFEST, Path.unlink, "missing"),
    "rng file flipped byte": ("rng-rank00000.json", _flip_byte, "does not match its sha256"),
    "file deleted": ("optimizer.safetensors", Path.unlink, "optimizer.safetensors is missing"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corrupted_newest_falls_back_to_the_previous(
    tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    filename, corrupt, reason = CORRUPTIONS[case]
    run = build()
    checkpointer = Checkpointer(tmp_path)
    train(run, 1)
    checkpointer.save(1, **run)
    expected = snapshot_run(run)
    train(run, 1)
    checkpointer.save(2, **run)
    corrupt(tmp_path / "step-000002" / filename)

    resumed = build()
    with caplog.at_level(logging.WARNING, logger="gradstep.checkpoint"):
        assert checkpointer.load_latest(**resumed) == 1
    assert_same_state(snapshot_run(resumed), expected)
    [record] = caplog.records  # exactly one line per unusable checkpoint
    message = record.getMessage()
    assert "\n" not in message and "step-000002" in message and reason in message
    assert "loading step-000001 instead" in message


def test_nothing_valid_returns_none(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = build()
    checkpointer = Checkpointer(tmp_path)
    assert checkpointer.load_latest(**run) is None  # no directory at all
    checkpointer.save(1, model=run["model"])
    checkpointer.save(2, model=run["model"])
    for step in (1, 2):
        _flip_byte(tmp_path / f"step-00000{step}" / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="gradstep.checkpoint"):
        assert checkpointer.load_latest(model=run["model"]) is None
    assert len(caplog.records) == 2
    assert all("no valid checkpoint left" in r.getMessage() for r in caplog.records)
    with pytest.raises(CheckpointError, match="does not match its sha256"):
        checkpointer.load(tmp_path / "step-000002", model=run["model"])


# ------------------------------------------------------------------------------ bad input


def test_bad_arguments_name_the_parameter(tmp_path: Path) -> None:
    run = build()
    for kwargs, match in [
        ({"keep": 0}, "keep must be an int >= 1, got 0"),
        ({"keep": 2.5}, "keep must be an int >= 1"),
        ({"accum_steps": 0}, "accum_steps must be an int >= 1"),
    ]:
        with pytest.raises(CheckpointError, match=match):
            Checkpointer(tmp_path, **kwargs)
    checkpointer = Checkpointer(tmp_path)
    with pytest.raises(CheckpointError, match="step must be an int >= 0, got -1"):
        checkpointer.save(-1, model=run["model"])
    with pytest.raises(CheckpointError, match="at least one object"):
        checkpointer.save(1)
    with pytest.raises(CheckpointError, match="x=int: checkpointed objects must be"):
        checkpointer.save(1, x=3)
    with pytest.raises(CheckpointError, match="at most one nn.Module"):
        checkpointer.save(1, a=run["model"], b=torch.nn.Linear(1, 1))
    with pytest.raises(CheckpointError, match="optimizer needs its model"):
        checkpointer.save(1, optimizer=run["optimizer"])
    assert not tmp_path.exists() or os.listdir(tmp_path) == []


# -------------------------------------------------------------------------------- elastic


@pytest.mark.parametrize(
    ("world", "k", "new_world", "saver"),
    [(2, 2, 1, 0), (1, 4, 2, 0), (2, 3, 3, 1), (4, 1, 2, 3), (3, 2, 2, 2)],
)
@pytest.mark.parametrize("steps", [1, 5, 8])
def test_data_position_is_global_across_world_sizes(
    world: int, k: int, new_world: int, saver: int, steps: int
) -> None:
    """W ranks take ``steps`` windows of k, rank ``saver``'s position is saved (through
    JSON); W' ranks resume with k' = k*W/W'. Interleaved by stride, everything consumed is
    the single-process stream exactly. The corpus is tiny (a few micro-batches per epoch)
    so saves land on and past epoch boundaries."""
    from gradstep_cli.data.sources import TrainBatches
    from tests.checkpoint.helpers import MICRO, SEQ, batch_id, docs

    corpus = docs(n=2, size=90)
    per_epoch = len(TrainBatches(corpus, SEQ, MICRO, seed=3)._epoch_plan(0))
    assert per_epoch <= 8  # so every case crosses several epochs
    new_k = elastic_accum_steps(k, world, new_world)
    after = 4
    total = (steps + after) * k * world
    stream = TrainBatches(corpus, SEQ, MICRO, seed=3)
    expected = [batch_id(next(stream)) for _ in range(total)]

    old = [TrainBatches(corpus, SEQ, MICRO, seed=3, rank=r, world_size=world) for r in range(world)]
    got = [batch_id(next(old[i % world])) for i in range(steps * k * world)]
    state = json.loads(json.dumps(old[saver].state_dict()))
    new = [
        TrainBatches(corpus, SEQ, MICRO, seed=3, rank=r, world_size=new_world)
        for r in range(new_world)
    ]
    for it in new:
        it.load_state_dict(state)
    got += [batch_id(next(new[i % new_world])) for i in range(after * new_k * new_world)]
    assert got == expected


def test_elastic_accum_steps_keeps_the_global_batch() -> None:
    assert elastic_accum_steps(4, 2, 1) == 8
    assert elastic_accum_steps(8, 1, 2) == 4
    assert elastic_accum_steps(3, 4, 6) == 2
    with pytest.raises(CheckpointError, match=r"world_size=2 x accum_steps=3 = 6 .* world_size=4"):
        elastic_accum_steps(3, 2, 4)
    with pytest.raises(CheckpointError, match="world_size must be an int >= 1"):
        elastic_accum_steps(3, 2, 0)


# ------------------------------------------------- several ranks (gloo, spawned processes)

ELASTIC_STEPS = (3, 2, 2)  # steps on 2 ranks (FSDP2), then 1 process, then 2 ranks
GLOBAL_MICRO_BATCHES = 4
ELASTIC_RTOL = 2e-6  # per-tensor relative error of the parameters vs the 1-process run


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_elastic_2_1_2_ranks_keeps_the_stream_and_the_state(tmp_path: Path) -> None:
    """Saved on 2 FSDP2 ranks (DCP, sharded) -> resumed on 1 process (k 2 -> 4) -> saved
    (safetensors) -> resumed on 2 FSDP2 ranks (k 4 -> 2). Every resume restores exactly the
    saved state; the micro-batches consumed over the whole run are the uninterrupted
    stream, each exactly once, in the same places; the DCP checkpoint of 2 ranks also loads
    into DDP on 2 ranks and, saved from DDP, into 1 process."""
    from gradstep_cli.data.sources import TrainBatches
    from tests.checkpoint.helpers import (
        MICRO,
        SEQ,
        assert_same_full_state,
        batch_id,
        docs,
        elastic_phase,
        elastic_phase_then_rewrap,
        full_state,
    )
    from tests.support.multiproc import run_ranks

    ckpt, ddp_ckpt = str(tmp_path / "run"), str(tmp_path / "ddp")
    s1, s2, s3 = ELASTIC_STEPS
    a = run_ranks(elastic_phase, 2, ckpt, "fsdp", s1, 2)
    b = elastic_phase(0, 1, ckpt, "none", s2, 0)
    c = run_ranks(elastic_phase_then_rewrap, 2, ckpt, ddp_ckpt, s3)

    assert [a[0]["k"], b["k"], c[0]["k"]] == [2, 4, 2]
    assert [a[0]["start"], b["start"], c[0]["start"]] == [0, s1, s1 + s2]
    assert_same_full_state(b["restored"], a[0]["final"])  # 2 ranks (DCP) -> 1
    for rank in range(2):
        assert_same_full_state(a[rank]["final"], a[0]["final"])
        assert_same_full_state(c[rank]["restored"], b["final"])  # 1 -> 2 ranks (sharded)
        assert_same_full_state(c[rank]["ddp_restored"], c[0]["final"])  # FSDP2 -> DDP

    # The data stream: step s of the run takes global micro-batches s*4 .. s*4+3; rank r of
    # W takes r, r+W, ... of them (the stride of TrainBatches).
    total = sum(ELASTIC_STEPS) * GLOBAL_MICRO_BATCHES
    stream = TrainBatches(docs(), SEQ, MICRO, seed=7)
    expected = [batch_id(next(stream)) for _ in range(total)]
    assert len(set(expected)) == total  # ids are unambiguous
    got: list[str | None] = [None] * total
    phases = [(a, 0, 2), ([b], s1, 1), (c, s1 + s2, 2)]
    for results, start, world in phases:
        for rank, result in enumerate(results):
            for step, seen in enumerate(result["seen"]):
                for j, ident in enumerate(seen):
                    position = (start + step) * GLOBAL_MICRO_BATCHES + rank + j * world
                    assert got[position] is None, f"micro-batch {position} consumed twice"
                    got[position] = ident
    assert got == expected  # no gap, no repeat, nothing out of place

    # And the training is the uninterrupted single-process one (k = 4): equal up to the
    # order of float32 sums across ranks.
    ref = build(dropout=0.0)
    train(ref, sum(ELASTIC_STEPS), GLOBAL_MICRO_BATCHES)
    ref_params = full_state(ref)["params"]
    for name, want in ref_params.items():
        got = c[0]["final"]["params"][name]
        assert float((got - want).norm() / want.norm()) <= ELASTIC_RTOL, name

    # The DDP-saved DCP checkpoint of 2 ranks loads in one process.
    d = build(dropout=0.0)
    assert Checkpointer(ddp_ckpt).load_latest(**d) == sum(ELASTIC_STEPS)
    assert_same_full_state(full_state(d), c[0]["final"])


# ------------------------------------------------------------------------------------ CLI

CLI_TINY = [
    "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16",
    "--micro-batch-size", "2", "--accum-steps", "2", "--eval-batches", "2",
    "--sample-tokens", "8", "--warmup", "2", "--dropout", "0.1", "--eval-every", "2",
    "--max-steps", "6", "--save-every", "3",
]  # fmt: skip


def test_cli_resume_errors_are_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gradstep_cli.cli import main

    args = [*CLI_TINY, "--data", str(text_corpus(tmp_path / "data"))]
    assert main(["train", *args, "--out", str(tmp_path / "a"), "--resume", "nope"]) == 2
    assert "--resume" in capsys.readouterr().err
    assert main(["train", *args, "--max-steps", "3", "--out", str(tmp_path / "a")]) == 0
    wider = [*args, "--max-steps", "3", "--d-model", "32", "--out", str(tmp_path / "a")]
    assert main(["train", *wider, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "shape mismatch" in err and "embed.weight" in err
