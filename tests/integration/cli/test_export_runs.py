"""`gradstep export` of runs saved on several ranks, of a LoRA run on a random base, of a
demo-GPT run; and the base fingerprint from the command line: a LoRA run whose base
folder's weights changed is refused by `train --resume` and by `export` (hf-client-2,
"Wrong base")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from gradstep_cli.cli import main  # noqa: E402
from tests.checkpoint.cli_ranks import cli_rank  # noqa: E402
from tests.integration.cli.test_export import (  # noqa: E402
    FLAGS,
    _refused,
    auto_model,
    checkpoint_tensors,
    corpus,
    export,
    train,
)
from tests.support import hf_assets  # noqa: E402
from tests.support.multiproc import run_ranks  # noqa: E402


def _dcp_model(step: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a several-rank (DCP) checkpoint, read with torch's own converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    tmp.mkdir()
    dcp_to_torch_save(str(step / "dcp"), str(tmp / "full.pt"))
    return torch.load(tmp / "full.pt", weights_only=False)["model"]


@pytest.mark.distributed
def test_runs_saved_by_ddp_and_fsdp2_ranks_export(tmp_path: Path) -> None:
    """A LoRA run under DDP and a full fine-tuning under FSDP2, 2 gloo ranks each: the
    exported weights are the checkpoint's, bitwise."""
    from peft import PeftModel

    base = hf_assets.model_dir(tmp_path / "base", "llama", seed=0)
    data = str(corpus(tmp_path / "data"))
    common = ["train", *FLAGS, "--model", f"hf:{base}", "--data", data]
    runs = {"ddp": ["--lora", "4"], "fsdp": []}
    for strategy, extra in runs.items():
        argv = [*common, *extra, "--strategy", strategy, "--eval-batches", "2"]
        argv += ["--out", str(tmp_path / strategy)]
        assert run_ranks(cli_rank, 2, argv, timeout=300) == [0, 0]
        step = tmp_path / strategy / "checkpoints" / "step-000002"
        saved = _dcp_model(step, tmp_path / f"{strategy}-read")
        out = export(tmp_path / strategy, tmp_path / f"{strategy}-export")
        if extra:
            state = PeftModel.from_pretrained(auto_model(base), str(out)).state_dict()
            assert saved and all("lora_" in k for k in saved)
        else:
            state = auto_model(out).state_dict()
            assert set(saved) == set(state)
        for name, tensor in saved.items():
            assert torch.equal(state[name], tensor), (strategy, name)


def test_a_changed_base_is_refused_by_resume_and_by_export(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The base folder re-saved with other weights (same architecture, same path): every
    key and shape still fits, only the fingerprint tells."""
    base = hf_assets.model_dir(tmp_path / "base", "llama", seed=0)
    run = train(tmp_path, "run", "--lora", "4", base=base)
    hf_assets.build_model("llama", seed=1).save_pretrained(base)  # weights replaced
    argv = ["train", *FLAGS, "--model", f"hf:{base}", "--data", str(tmp_path / "data")]
    err = _refused(capsys, [*argv, "--lora", "4", "--max-steps", "4", "--out", str(run),
                            "--resume"])  # fmt: skip
    assert "trained on another base" in err and err.count("sha256 ") == 2, err
    err = _refused(capsys, ["export", str(run), "--out", str(tmp_path / "export")])
    assert "cannot export" in err and "trained on another base" in err, err
    assert not (tmp_path / "export").exists()


def test_lora_on_a_random_base_exports_merged_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--init random: the base is the seed's, which no folder holds. The export rebuilds it
    (the checkpoint's fingerprint confirms it is the same) and merges."""
    run = train(tmp_path, "run", "--lora", "4", "--init", "random")
    err = _refused(capsys, ["export", str(run), "--out", str(tmp_path / "adapter")])
    assert "randomly initialised base" in err and "--merge-lora" in err
    out = export(run, tmp_path / "merged", "--merge-lora")
    assert (out / "model.safetensors").is_file()


def test_a_demo_gpt_run_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gpt = ["--n-layer", "1", "--n-head", "2", "--d-model", "16", "--model", "gpt"]
    argv = ["train", *FLAGS, *gpt, "--data", str(corpus(tmp_path / "data"))]
    assert main([*argv, "--seq-len", "16", "--out", str(tmp_path / "gpt")]) == 0
    err = _refused(capsys, ["export", str(tmp_path / "gpt"), "--out", str(tmp_path / "x")])
    assert "demo GPT" in err and "hf:DIR" in err


@pytest.mark.parametrize("family", [f for f in hf_assets.FAMILIES if f != "llama"])
def test_every_family_round_trips(family: str, tmp_path: Path) -> None:
    """Full fine-tuning and all-linear LoRA (expert weights of the MoEs included) of each
    family: the reloaded weights are the checkpoint's, bitwise; merged, the weights
    without adapters are the base's, bitwise."""
    from peft import PeftModel

    base = hf_assets.model_dir(tmp_path / "base", family, seed=0)
    full = train(tmp_path, "full", base=base)
    state = auto_model(export(full, tmp_path / "full-export")).state_dict()
    saved = checkpoint_tensors(full)
    assert set(state) == set(saved)
    assert all(torch.equal(state[k], v) for k, v in saved.items())

    lora = train(tmp_path, "lora", "--lora", "4", "--lora-targets", "all-linear", base=base)
    adapter = export(lora, tmp_path / "adapter")
    state = PeftModel.from_pretrained(auto_model(base), str(adapter)).state_dict()
    saved = checkpoint_tensors(lora)
    assert saved and all(torch.equal(state[k], v) for k, v in saved.items())
    merged = auto_model(export(lora, tmp_path / "merged", "--merge-lora")).state_dict()
    original = auto_model(base).state_dict()
    adapted = {k.removeprefix("base_model.model.").split(".lora_")[0] for k in saved}
    kept = [k for k in original if not any(k.startswith(a + ".") for a in adapted)]
    assert kept and all(torch.equal(merged[k], original[k]) for k in kept)
    assert any(not torch.equal(merged[k], original[k]) for k in original if k not in kept)


def test_a_bf16_lora_run_exports_in_the_dtypes_it_trained_in(tmp_path: Path) -> None:
    """--precision bf16 keeps a LoRA run's frozen base in bfloat16 and its adapters in
    float32: the adapter folder is float32, the merged model bfloat16 (config.json too)."""
    from safetensors.torch import load_file

    run = train(tmp_path, "run", "--lora", "4", "--precision", "bf16")
    adapter = export(run, tmp_path / "adapter")
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    assert {v.dtype for v in tensors.values()} == {torch.float32}
    merged = export(run, tmp_path / "merged", "--merge-lora")
    assert auto_model(merged).dtype == torch.bfloat16
    assert json.loads((merged / "config.json").read_text())["dtype"] == "bfloat16"
