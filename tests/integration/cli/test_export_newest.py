"""`gradstep export RUN_DIR --out OUT` without ``--step`` writes the newest checkpoint that
verifies, whatever is wrong with the newer ones.

A tiny local Llama run (``train`` of tests/integration/cli/test_export.py) saves a checkpoint
at every one of its 4 steps, keeping all 4; each (full fine-tuning, and LoRA adapters) trains once.
Each example copies the run and damages some of its checkpoints the ways disks and people
do (a file truncated, one bit of a file flipped, the manifest deleted; any file of the
folder, the manifest and the files export never reads included), then exports.

Property, against the plain reference (the newest step left undamaged, and its tensors
read straight from the undamaged checkpoint's safetensors): the exported weights are that
checkpoint's, bitwise, every tensor; when every checkpoint is damaged the export is refused
(exit 2, one line, no traceback) and writes nothing. The 4 checkpoints differ from each
other, so exporting any other step fails the comparison.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from gradstep.checkpoint import MANIFEST  # noqa: E402
from gradstep_cli.cli import main  # noqa: E402
from tests.integration.cli.test_export import train  # noqa: E402

STEPS = (1, 2, 3, 4)
EVERY_STEP = ["--max-steps", "4", "--save-every", "1", "--keep-checkpoints", "4"]
LORA = ["--lora", "4", "--lora-alpha", "12", "--lora-targets", "q_proj,up_proj"]
DAMAGE = ("truncate", "flip", "no-manifest")
EXAMPLES = int(os.environ.get("GRADSTEP_HYPOTHESIS_EXAMPLES", "12"))
# A checkpoint's files, sorted: manifest.json, model.safetensors, optimizer.safetensors,
# rng-rank00000.json.
MODEL_FILE, OPTIMIZER_FILE = 1, 2


def only(**damaged: tuple[str, int, int]) -> dict[int, tuple[str, int, int] | None]:
    """``damaged`` by step (``s4=...``), the other steps intact."""
    return {s: damaged.get(f"s{s}") for s in STEPS}


def step_dir(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:06d}"


def step_tensors(run: Path, step: int) -> dict[str, torch.Tensor]:
    """The model tensors of one checkpoint, tied names (aliases) included, read from its
    safetensors file directly (no gradstep code)."""
    import json

    folder = step_dir(run, step)
    tensors = load_file(str(folder / "model.safetensors"))
    aliases = json.loads((folder / MANIFEST).read_text())["objects"]["model"]["aliases"]
    return {**tensors, **{alias: tensors[key] for alias, key in aliases.items()}}


@pytest.fixture(scope="module", params=["full", "lora"])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-step run with a checkpoint at every step; its checkpoints pairwise differ."""
    extra = EVERY_STEP + (LORA if request.param == "lora" else [])
    out = train(tmp_path_factory.mktemp(request.param), "run", *extra)
    tensors = [step_tensors(out, s) for s in STEPS]
    for i, a in enumerate(tensors):
        for b in tensors[i + 1 :]:
            assert a.keys() == b.keys() and any(not torch.equal(a[k], b[k]) for k in a)
    return out


def damage(folder: Path, how: str, which: int, where: int) -> None:
    """Damage one checkpoint folder: truncate or flip one bit of its ``which``-th file
    (sorted, the manifest and DCP's hidden files included), or delete its manifest."""
    if how == "no-manifest":
        (folder / MANIFEST).unlink()
        return
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    path = files[which % len(files)]
    data = bytearray(path.read_bytes())
    assert data, path
    if how == "truncate":
        del data[where % len(data) :]
    else:
        data[where % len(data)] ^= 1 << (where % 8)
    path.write_bytes(bytes(data))


def exported(out: Path) -> dict[str, torch.Tensor]:
    """The weights ``out`` holds, by the checkpoint's names (PEFT writes an adapter's
    tensors without the adapter name ``default``)."""
    if (out / "adapter_model.safetensors").is_file():
        tensors = load_file(str(out / "adapter_model.safetensors"))
        named = {}
        for name, t in tensors.items():
            stem, _, leaf = name.rpartition(".")
            named[f"{stem}.default.{leaf}"] = t
        return named
    return load_file(str(out / "model.safetensors"))


@settings(max_examples=EXAMPLES)
@given(
    damaged=st.fixed_dictionaries(
        {
            step: st.none()
            | st.tuples(st.sampled_from(DAMAGE), st.integers(0, 99), st.integers(0, 2**31))
            for step in STEPS
        }
    )
)
@example(damaged=only(s4=("truncate", MODEL_FILE, 100)))
@example(damaged=only(s4=("flip", OPTIMIZER_FILE, 12345)))  # a file export does not read
@example(damaged=only(s4=("no-manifest", 0, 0), s3=("flip", 0, 77)))  # 0: the manifest
@example(damaged=only(**{f"s{s}": ("truncate", s, 0) for s in STEPS}))  # nothing left
def test_export_without_step_writes_the_newest_checkpoint_that_verifies(
    run: Path, damaged: dict[int, tuple[str, int, int] | None]
) -> None:
    intact = [s for s in STEPS if damaged[s] is None]
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp, "run")
        shutil.copytree(run, copy)
        for step, how in damaged.items():
            if how is not None:
                damage(step_dir(copy, step), *how)
        out = Path(tmp, "export")
        rc = main(["export", str(copy), "--out", str(out)])
        if not intact:
            assert rc == 2 and not out.exists(), rc
            return
        assert rc == 0
        got = exported(out)
    want = step_tensors(run, max(intact))  # the plain way: the newest undamaged step
    assert got, "nothing exported"
    assert set(got) <= set(want), sorted(set(got) - set(want))
    for name, tensor in got.items():
        assert tensor.dtype == want[name].dtype, name
        assert torch.equal(tensor, want[name]), (name, "exported another step than", max(intact))
