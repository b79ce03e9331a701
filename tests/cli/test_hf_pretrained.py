"""``--model hf:DIR`` loads DIR's pretrained weights (issue 21 §1): every weight format gives
the saved parameters bitwise, ``--init random`` and weight-less folders give the seed's
init, a folder whose weights belong to another config is a clear error, and the dtype
follows the precision. Folders come from tests/support/hf_assets.py (nothing downloaded)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from gradstep import Stepper  # noqa: E402
from gradstep_cli.cli import main  # noqa: E402
from gradstep_cli.config.settings import ConfigError, TrainConfig  # noqa: E402
from gradstep_cli.models.hf import HFLoss, build_model, count_batch, param_dtype  # noqa: E402
from tests.support import hf_assets  # noqa: E402

CASES = [(family, "safetensors") for family in ("llama", *hf_assets.REVIEW_FAMILIES)] + [
    ("llama", "sharded"), ("llama", "bin"), ("qwen2_moe", "sharded"), ("opt", "bin"),
]  # fmt: skip


def _cfg(folder: Path | str, **kw: object) -> TrainConfig:
    return TrainConfig(model=f"hf:{folder}", seq_len=32, **kw)


def _assert_bitwise(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert set(state) == set(expected)
    differ = [k for k in expected if not torch.equal(state[k], expected[k])]
    assert not differ, differ


@pytest.mark.parametrize(("family", "weights"), CASES)
def test_each_weight_format_loads_the_saved_parameters_bitwise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], family: str, weights: str
) -> None:
    folder = hf_assets.model_dir(tmp_path / "m", family, seed=3, weights=weights)
    capsys.readouterr()
    model = build_model(_cfg(folder, seed=0))  # the run's seed does not matter: the files do
    saved = hf_assets.build_model(family, seed=3)
    _assert_bitwise(model, saved.state_dict())
    assert model.training  # from_pretrained returns eval mode; training needs dropout on
    n = sum(p.numel() for p in saved.parameters())
    err = capsys.readouterr().err
    assert f"loaded pretrained weights from {folder} ({n:,} parameters)\n" in err
    assert "Loading weights" not in err and "LOAD REPORT" not in err  # transformers kept quiet


def test_init_random_starts_from_the_seed_even_when_weights_exist(tmp_path, capsys) -> None:
    folder = hf_assets.model_dir(tmp_path / "m", "qwen2", seed=0)
    capsys.readouterr()
    model = build_model(_cfg(folder, init="random", seed=7))
    _assert_bitwise(model, hf_assets.build_model("qwen2", seed=7).state_dict())
    err = capsys.readouterr().err
    assert f"--init random: model.safetensors in {folder} is not loaded: random init" in err
    assert "loaded pretrained" not in err
    # The seed's init, whatever drew from the global generator before build_model.
    torch.manual_seed(12345)
    torch.rand(100)
    _assert_bitwise(build_model(_cfg(folder, init="random", seed=7)), model.state_dict())


def test_a_folder_without_weights_is_random_init_from_the_seed(tmp_path, capsys) -> None:
    folder = hf_assets.model_dir(tmp_path / "m", "phi3", weights="none")
    capsys.readouterr()
    model = build_model(_cfg(folder, seed=5))
    _assert_bitwise(model, hf_assets.build_model("phi3", seed=5).state_dict())
    assert f"no weights in {folder}: random init\n" in capsys.readouterr().err


def test_a_config_json_path_is_the_config_alone(tmp_path, capsys) -> None:
    folder = hf_assets.model_dir(tmp_path / "m", "llama", seed=0)
    capsys.readouterr()
    model = build_model(_cfg(folder / "config.json", seed=2))
    _assert_bitwise(model, hf_assets.build_model("llama", seed=2).state_dict())
    err = capsys.readouterr().err
    assert "is a config alone: random init (--seed 2)" in err
    assert f"hf:{folder} would load its model.safetensors" in err


@pytest.mark.parametrize(
    ("change", "what"),
    [
        ({"num_hidden_layers": 3}, "missing from the files"),
        ({"num_hidden_layers": 1}, "in the files but not in the model"),
        ({"intermediate_size": 48}, "of another shape"),
    ],
)
def test_weights_of_another_config_are_a_clear_error(tmp_path, change, what) -> None:
    folder = hf_assets.model_dir(tmp_path / "m", "llama", tokenizer=False)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConfigError) as err:
        build_model(_cfg(folder))
    text = str(err.value)
    assert f"the weights in {folder} are not those of the model its config.json" in text
    assert what in text and "--init random" in text
    build_model(_cfg(folder, init="random"))  # the way out the message names works


def test_unreadable_weights_are_a_clear_error_in_the_cli(tmp_path, capsys) -> None:
    folder = hf_assets.model_dir(tmp_path / "m", "llama")
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    data = tmp_path / "data.txt"
    data.write_text("def f(x):\n    return x\n" * 200)
    run = ["train", "--model", f"hf:{folder}", "--data", str(data), "--seq-len", "32"]
    assert main([*run, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"cannot load the weights in {folder}" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("precision", "lora", "base"),
    [
        ("bf16", 4, torch.bfloat16),  # frozen base: half the memory, never updated
        ("bf16", 0, torch.float32),  # trained weights: float32 master copy under autocast
        ("fp16", 4, torch.float32),  # GradScaler needs float32 parameters
        ("fp32", 4, torch.float32),
    ],
)
def test_the_parameter_dtype_follows_the_precision(tmp_path, precision, lora, base) -> None:
    folder = hf_assets.model_dir(tmp_path / "m", "qwen2", tokenizer=False)
    cfg = _cfg(folder, precision=precision, lora=lora)
    assert param_dtype(cfg) == base
    model = build_model(cfg)
    saved = hf_assets.build_model("qwen2").state_dict()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.dtype == torch.float32, name  # adapters (or the whole model) in float32
        else:
            assert p.dtype == base, name
            key = name.replace("base_model.model.", "").replace(".base_layer", "")
            assert torch.equal(p, saved[key].to(base)), name  # one rounding of the files


def test_a_bf16_step_on_a_bf16_base_trains_only_the_adapters(tmp_path) -> None:
    """The Stepper under bf16 autocast with a bf16 frozen base and float32 adapters: finite
    loss, adapters move, the base stays bitwise (no accumulation buffers are involved)."""
    folder = hf_assets.model_dir(tmp_path / "m", "llama", tokenizer=False)
    model = build_model(_cfg(folder, precision="bf16", lora=4))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    stepper = Stepper(model, opt, precision="bf16")
    ids = torch.randint(0, hf_assets.VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    stats = stepper.step([batch, batch], HFLoss(torch.device("cpu")), count=count_batch)
    assert math.isfinite(stats.loss) and not stats.skipped
    for name, p in model.named_parameters():
        if "lora_B" in name:
            assert not torch.equal(p, before[name]), name
        elif not p.requires_grad:
            assert torch.equal(p, before[name]), name


def _zero_head_folder(dest: Path) -> Path:
    """A pretrained folder whose output layer is zero: every logit is 0, so the loss of any
    data is exactly ln(vocab) when (and only when) these weights are the ones loaded."""
    model = hf_assets.build_model("llama", seed=0)
    with torch.no_grad():
        model.lm_head.weight.zero_()
    model.save_pretrained(dest)
    hf_assets.load_tokenizer().save_pretrained(dest)
    return dest


def test_the_cli_trains_from_the_folders_weights(tmp_path, capsys) -> None:
    """hf-client friction 1: the folder's weights were silently ignored (random init)."""
    folder = _zero_head_folder(tmp_path / "zero_head")
    data = tmp_path / "data.txt"
    data.write_text(hf_assets.training_text(40_000)[0][:40_000])
    tiny = [
        "train", "--model", f"hf:{folder}", "--data", str(data), "--seq-len", "32",
        "--micro-batch-size", "2", "--max-steps", "1", "--eval-batches", "1",
        "--sample-tokens", "0", "--lr", "1e-9",
    ]  # fmt: skip
    capsys.readouterr()
    assert main([*tiny, "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    n = sum(p.numel() for p in hf_assets.build_model("llama").parameters())
    assert f"loaded pretrained weights from {folder} ({n:,} parameters)" in err
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["initial_val_loss"] == pytest.approx(math.log(hf_assets.VOCAB), abs=2e-6)
    assert main([*tiny, "--init", "random", "--out", str(tmp_path / "b")]) == 0
    assert "--init random: model.safetensors" in capsys.readouterr().err
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert abs(summary["initial_val_loss"] - math.log(hf_assets.VOCAB)) > 1e-3


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_fsdp_bf16_lora_on_pretrained_weights_runs_and_rank0_speaks_once(tmp_path) -> None:
    """The bf16 frozen base with float32 adapters under FSDP2's bf16 policy on 2 gloo ranks
    (FSDP2 needs one dtype among the trainable parameters only); the notes come from rank 0."""
    import os
    import subprocess
    import sys

    from tests.support.multiproc import free_port

    folder = hf_assets.model_dir(tmp_path / "m", "llama")
    data = tmp_path / "data.txt"
    data.write_text(hf_assets.training_text(40_000)[0][:40_000])
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        f"--master_port={free_port()}", "-m", "gradstep", "train", "--device", "cpu",
        "--strategy", "fsdp", "--precision", "bf16", "--lora", "4", "--model", f"hf:{folder}",
        "--data", str(data), "--seq-len", "32", "--micro-batch-size", "2", "--max-steps", "2",
        "--eval-batches", "2", "--sample-tokens", "4", "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr.count("loaded pretrained weights from") == 1, proc.stderr
    assert proc.stderr.count("LoRA rank 4, alpha 8") == 1, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trainable_parameters"] == 896 and summary["world_size"] == 2
    assert math.isfinite(summary["final_val_loss"]) and summary["sample"]
