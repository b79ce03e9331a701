"""`gradstep export`: round trips of a trained hf: run into folders Hugging Face loads.

Every model and tokenizer is local (tests/support/hf_assets.py): a tiny Llama saved with
its weights and a tokenizer trained here. Each kind of run trains once (module fixtures);
the tests export it and reload the folder the way users do, offline:

- full fine-tuning: ``AutoModelForCausalLM.from_pretrained`` holds the checkpoint's weights
  bitwise, in the run's dtype; the tokenizer gives the same ids; generation runs and stops
  at the tokenizer's EOS;
- LoRA adapter: ``PeftModel.from_pretrained(base, OUT)`` (and ``AutoModelForCausalLM`` on
  OUT) holds the checkpoint's adapters bitwise and gives the logits of the trained model
  rebuilt by hand (base + LoraConfig + the checkpoint's tensors): equal, not close;
- merged LoRA: weights without adapters are bitwise the base's, adapted ones equal
  W + (alpha / r) B A to float32 rounding (4 ulp of the largest term; measured: 0), and
  its logits equal the adapter model's to 2e-6 (measured 9e-8).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from safetensors.torch import load_file  # noqa: E402

from gradstep_cli.cli import main  # noqa: E402
from tests.support import hf_assets  # noqa: E402

RANK, ALPHA = 4, 12.0
FLAGS = [
    "--seq-len", "32", "--micro-batch-size", "2", "--accum-steps", "2", "--eval-batches", "1",
    "--eval-every", "0", "--sample-tokens", "0", "--warmup", "1", "--max-steps", "2",
    "--save-every", "2", "--lr", "3e-2", "--device", "cpu",
]  # fmt: skip
TEXT = "def add(a, b):\n    return a + b\n"


def corpus(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "code.py").write_text(TEXT * 150)
    return folder


def train(tmp: Path, name: str, *extra: str, base: Path | None = None) -> Path:
    """A 2-step run of the local Llama with its checkpoint at step 2."""
    base = base or hf_assets.model_dir(tmp / f"{name}-base", "llama", seed=0)
    out = tmp / name
    argv = ["train", *FLAGS, "--model", f"hf:{base}", "--data", str(corpus(tmp / "data"))]
    assert main([*argv, *extra, "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(tmp_path_factory.mktemp("full"), "run")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    lora = ["--lora", str(RANK), "--lora-alpha", str(ALPHA), "--lora-targets", "q_proj,up_proj"]
    return train(tmp_path_factory.mktemp("lora"), "run", *lora)


def checkpoint_tensors(run: Path) -> dict[str, torch.Tensor]:
    """The model tensors of the run's step-2 checkpoint, tied names (aliases) included."""
    step = run / "checkpoints" / "step-000002"
    tensors = load_file(str(step / "model.safetensors"))
    aliases = json.loads((step / "manifest.json").read_text())["objects"]["model"]["aliases"]
    return {**tensors, **{alias: tensors[key] for alias, key in aliases.items()}}


def base_dir(run: Path) -> Path:
    model = json.loads((run / "config.json").read_text())["model"]
    return Path(model.removeprefix("hf:"))


def export(run: Path, out: Path, *extra: str) -> Path:
    assert main(["export", str(run), "--out", str(out), *extra]) == 0
    return out


def auto_model(folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()


def logits(model: torch.nn.Module) -> torch.Tensor:
    ids = hf_assets.load_tokenizer()(TEXT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_full_fine_tuning_round_trips(full_run: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    out = export(full_run, tmp_path / "export")
    model = auto_model(out)
    saved = checkpoint_tensors(full_run)
    state = model.state_dict()
    assert set(state) == set(saved)
    for name, tensor in saved.items():  # bitwise, and in the run's dtype (float32)
        assert state[name].dtype == tensor.dtype == torch.float32, name
        assert torch.equal(state[name], tensor), name
    base = auto_model(base_dir(full_run)).state_dict()
    assert any(not torch.equal(base[k], v) for k, v in saved.items())  # it did train
    assert json.loads((out / "config.json").read_text())["use_cache"] is True

    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    source = hf_assets.load_tokenizer()
    assert tokenizer(TEXT)["input_ids"] == source(TEXT)["input_ids"]
    assert tokenizer.chat_template == source.chat_template
    gen = GenerationConfig.from_pretrained(str(out), local_files_only=True)
    vocab = source.get_vocab()
    assert gen.eos_token_id == [vocab[hf_assets.EOS], vocab[hf_assets.IM_END]]
    prompt = tokenizer("def add(", return_tensors="pt")
    new = model.generate(**prompt, max_new_tokens=3, do_sample=False)
    assert new.shape[1] - prompt["input_ids"].shape[1] in (1, 2, 3)
    record = json.loads((out / "gradstep_export.json").read_text())
    assert (record["kind"], record["step"], record["dtype"]) == ("full", 2, "float32")


def _by_hand(run: Path) -> torch.nn.Module:
    """The trained LoRA model built without gradstep: the base folder, PEFT's LoraConfig of
    the run's flags, and the checkpoint's adapter tensors loaded by name."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["q_proj", "up_proj"])
    model = get_peft_model(auto_model(base_dir(run)), lora)
    missing, unexpected = model.load_state_dict(checkpoint_tensors(run), strict=False)
    assert not unexpected and all("lora_" not in k for k in missing)
    return model.eval()


def test_lora_adapter_loads_on_its_base_with_the_trained_logits(
    lora_run: Path, tmp_path: Path
) -> None:
    from peft import PeftModel

    out = export(lora_run, tmp_path / "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    peft_model = PeftModel.from_pretrained(auto_model(base_dir(lora_run)), str(out)).eval()
    state = peft_model.state_dict()
    saved = checkpoint_tensors(lora_run)
    assert saved and all("lora_" in k for k in saved)
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name
    want = logits(_by_hand(lora_run))
    assert torch.equal(logits(peft_model), want)
    assert torch.equal(logits(auto_model(out)), want)  # transformers' own PEFT loading
    assert not torch.equal(logits(auto_model(base_dir(lora_run))), want)  # adapters matter
    record = json.loads((out / "gradstep_export.json").read_text())
    assert record["kind"] == "lora-adapter" and len(record["base_fingerprint"]) == 64


def test_merged_lora_keeps_the_base_and_adds_the_scaled_product(
    lora_run: Path, tmp_path: Path
) -> None:
    out = export(lora_run, tmp_path / "merged", "--merge-lora")
    assert not (out / "adapter_config.json").exists()
    merged = auto_model(out).state_dict()
    base = auto_model(base_dir(lora_run)).state_dict()
    saved = checkpoint_tensors(lora_run)
    assert set(merged) == set(base)
    adapted = 0
    for name, w in base.items():
        stem = "base_model.model." + name.removesuffix(".weight")
        a = saved.get(f"{stem}.lora_A.default.weight")
        if a is None:
            assert torch.equal(merged[name], w), name  # frozen: bitwise the base's
            continue
        adapted += 1
        delta = (ALPHA / RANK) * (saved[f"{stem}.lora_B.default.weight"] @ a)
        ulp = torch.finfo(torch.float32).eps * float((w.abs() + delta.abs()).max())
        assert float((merged[name] - (w + delta)).abs().max()) <= 4 * ulp, name
        assert float(delta.abs().max()) > 100 * ulp, name  # the adapters did move
    assert adapted == 2 * 2  # q_proj and up_proj in each of the 2 layers
    diff = (logits(auto_model(out)) - logits(_by_hand(lora_run))).abs().max()
    assert float(diff) <= 2e-6  # the same function, rounded differently (measured 9e-8)


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run ``argv``; it must exit 2 with one error line and no traceback. The line."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_refusals_name_the_argument_and_leave_everything_as_it_was(
    full_run: Path, lora_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "out")
    err = _refused(capsys, ["export", str(full_run), "--out", out, "--step", "7"])
    assert "--step 7" in err and "holds step(s) 2" in err
    err = _refused(capsys, ["export", str(full_run), "--out", out, "--merge-lora"])
    assert "--merge-lora" in err and "no --lora" in err
    err = _refused(capsys, ["export", str(tmp_path / "nowhere"), "--out", out])
    assert "RUN_DIR" in err and "no such folder" in err
    (tmp_path / "empty-run").mkdir()
    (tmp_path / "empty-run" / "config.json").write_text("{}")
    err = _refused(capsys, ["export", str(tmp_path / "empty-run"), "--out", out])
    assert "holds no checkpoints" in err and "--save-every" in err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    err = _refused(capsys, ["export", str(lora_run), "--out", str(busy)])
    assert "--out" in err and "not empty" in err
    assert [p.name for p in busy.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy", "empty-run"]  # no out, no tmp
    # A step-N folder is a RUN_DIR too, and --step must then be its own.
    step2 = lora_run / "checkpoints" / "step-000002"
    err = _refused(capsys, ["export", str(step2), "--out", out, "--step", "1"])
    assert "--step 1" in err and "step 2" in err
    nested = tmp_path / "new" / "folders" / "out"  # parents are made, as mkdir -p
    assert main(["export", str(step2), "--out", str(nested), "--step", "2"]) == 0
    assert (nested / "adapter_config.json").is_file()
    assert not list(nested.parent.glob(".*"))  # nothing left beside it
