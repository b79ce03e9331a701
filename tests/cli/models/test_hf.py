"""``--model hf:DIR`` (gradstep_cli.models.hf): DIR's pretrained weights bitwise in every format,
``--init random`` and weight-less folders from the seed, the dtype the precision asks for,
the run's tokenizer, and clear errors for folders, weights and code that do not fit.
Folders come from tests/support/hf_assets.py (nothing downloaded)."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from gradstep import Stepper  # noqa: E402
from gradstep_cli.cli import main  # noqa: E402
from gradstep_cli.config.settings import ConfigError, TrainConfig  # noqa: E402
from gradstep_cli.models.hf import (  # noqa: E402
    HFLoss,
    build_model,
    count_batch,
    load_tokenizer,  # noqa: E402
    param_dtype,
)
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


TEXT = "def area(r):\n    return 3.14159 * r ** 2  # <|endoftext|> stays text\n"


def _ids(tokenizer, text: str = TEXT) -> list[int]:
    return tokenizer(text)["input_ids"]


def _word_tokenizer(dest: Path, words: list[str]) -> Path:
    """A word-level tokenizer of len(words) + 2 tokens: fewer than the 256 byte values."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "[EOS]", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]")
    fast.save_pretrained(dest)
    return dest


TINY = [
    "--seq-len", "32", "--micro-batch-size", "2", "--accum-steps", "2", "--eval-batches", "2",
    "--eval-every", "0", "--sample-tokens", "4", "--warmup", "1",
]  # fmt: skip

SHAPE = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip


def _config(folder: Path, kind: str, vocab: int = 256) -> Path:
    from transformers import LlamaConfig, MixtralConfig

    if kind == "llama":
        config = LlamaConfig(vocab_size=vocab, **SHAPE)
    else:
        config = MixtralConfig(
            vocab_size=vocab, num_local_experts=4, num_experts_per_tok=2, **SHAPE
        )
    config.save_pretrained(folder / kind)
    return folder / kind


def _notes(tmp_path: Path, capsys: pytest.CaptureFixture[str], model: Path, **cfg: object) -> str:
    from gradstep_cli.config.settings import TrainConfig
    from gradstep_cli.models.hf import hf_config

    capsys.readouterr()
    hf_config(TrainConfig(model=f"hf:{model}", seq_len=32, **cfg))
    return capsys.readouterr().err


GPT = [
    "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16",
    "--micro-batch-size", "2", "--accum-steps", "1", "--eval-batches", "1",
    "--sample-tokens", "0", "--warmup", "1", "--max-steps", "1",
]  # fmt: skip

HF = [
    "--seq-len", "32", "--micro-batch-size", "2", "--accum-steps", "1", "--eval-batches", "1",
    "--sample-tokens", "0", "--warmup", "1", "--max-steps", "1",
]  # fmt: skip


def jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def pairs(n: int) -> list[dict[str, str]]:
    return [{"prompt": f"q{i}: ", "completion": f"a{i} b"} for i in range(n)]  # fits --seq-len 16


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run the CLI, expect exit status 2 and one error line; return that line."""
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if " error: " in line]
    assert len(lines) == 1, err
    return lines[0]


def train(capsys: Any, tmp_path: Path, *flags: str, model: Path | None = None) -> str:
    """``refused`` for a tiny run into ``tmp_path/run``: the demo GPT, or ``hf:model``."""
    size = GPT if model is None else ["--model", f"hf:{model}", *HF]
    return refused(capsys, "train", *size, "--out", str(tmp_path / "run"), *flags)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("transformers")
    from tests.support import hf_assets

    root = tmp_path_factory.mktemp("hf")
    return {
        "llama": hf_assets.model_dir(root / "llama", "llama", seed=0),
        "notok": hf_assets.model_dir(root / "notok", "llama", seed=0, tokenizer=False),
    }


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


def test_the_tokenizer_comes_from_the_model_folder(tmp_path) -> None:
    folder = hf_assets.model_dir(tmp_path / "m", "llama", weights="none")
    tokenizer = load_tokenizer(_cfg(folder))
    reference = hf_assets.load_tokenizer()
    assert _ids(tokenizer) == _ids(reference) and len(tokenizer) == len(reference)
    assert tokenizer.decode(_ids(tokenizer)) == TEXT  # byte-level BPE: a round trip
    assert tokenizer.chat_template == hf_assets.CHAT_TEMPLATE
    # A config.json path takes the tokenizer beside it.
    assert _ids(load_tokenizer(_cfg(folder / "config.json"))) == _ids(reference)


def test_the_tokenizer_is_the_one_autotokenizer_loads_from_the_folder(tmp_path) -> None:
    """What the ecosystem loads from DIR, quirks included: transformers 5 loads a qwen2
    folder's tokenizer as Qwen2Tokenizer (its own pre-tokenizer), whatever the folder's
    tokenizer_config.json says, so hf_assets' tokenizer splits differently there."""
    from transformers import AutoTokenizer

    folder = hf_assets.model_dir(tmp_path / "m", "qwen2", weights="none")
    auto = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    tokenizer = load_tokenizer(_cfg(folder))
    assert type(tokenizer) is type(auto) and _ids(tokenizer) == _ids(auto)
    assert _ids(auto) != _ids(hf_assets.load_tokenizer())  # the quirk is real


def test_a_missing_pad_token_reuses_eos(tmp_path, capsys) -> None:
    folder = hf_assets.model_dir(tmp_path / "m", "llama", weights="none", pad=False)
    capsys.readouterr()
    tokenizer = load_tokenizer(_cfg(folder))
    assert tokenizer.pad_token == tokenizer.eos_token == hf_assets.EOS
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    assert capsys.readouterr().err == ""  # handled, not worth a line
    padded = hf_assets.model_dir(tmp_path / "p", "llama", weights="none", pad=True)
    assert load_tokenizer(_cfg(padded)).pad_token == hf_assets.PAD  # its own pad is kept


def test_tokenizer_flag_overrides_the_folders(tmp_path) -> None:
    folder = hf_assets.model_dir(tmp_path / "m", "llama", weights="none", pad=False)
    other = hf_assets.tokenizer_dir(tmp_path / "tok", pad=True)
    assert load_tokenizer(_cfg(folder, tokenizer=str(other))).pad_token == hf_assets.PAD
    assert load_tokenizer(_cfg(folder)).pad_token == hf_assets.EOS
    bare = hf_assets.model_dir(tmp_path / "bare", "llama", weights="none", tokenizer=False)
    from_file = load_tokenizer(_cfg(bare, tokenizer=str(other / "tokenizer.json")))
    assert _ids(from_file) == _ids(hf_assets.load_tokenizer())
    assert from_file.pad_token == hf_assets.PAD  # read with the tokenizer_config.json beside
    alone = tmp_path / "alone" / "tokenizer.json"
    alone.parent.mkdir()
    alone.write_bytes((other / "tokenizer.json").read_bytes())
    with pytest.raises(ConfigError, match="has no EOS token"):
        load_tokenizer(_cfg(bare, tokenizer=str(alone)))
    with pytest.raises(ConfigError, match="--tokenizer .*nothing: no such file or folder"):
        load_tokenizer(_cfg(folder, tokenizer=str(tmp_path / "nothing")))
    with pytest.raises(ConfigError, match="not a usable Hugging Face tokenizer"):
        load_tokenizer(_cfg(folder, tokenizer=str(bare)))  # a folder with no tokenizer


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path) -> None:
    folder = hf_assets.model_dir(tmp_path / "m", "llama", weights="none", vocab_size=300)
    with pytest.raises(ConfigError) as err:
        load_tokenizer(_cfg(folder))
    text = str(err.value)
    assert f"holds {hf_assets.VOCAB} tokens" in text and "vocab_size 300" in text
    assert str(folder) in text


def test_without_a_tokenizer_the_data_is_bytes_and_needs_256_ids(tmp_path, capsys) -> None:
    bare = hf_assets.model_dir(tmp_path / "m", "llama", weights="none", tokenizer=False)
    capsys.readouterr()
    assert load_tokenizer(_cfg(bare)) is None
    assert f"no tokenizer in {bare} and no --tokenizer: the data is read as bytes" in (
        capsys.readouterr().err
    )
    small = hf_assets.model_dir(tmp_path / "s", "llama", weights="none", tokenizer=False,
                                vocab_size=100)  # fmt: skip
    with pytest.raises(ConfigError, match="vocab_size must be >= 256 to read the data as bytes"):
        load_tokenizer(_cfg(small))
    # With a tokenizer the byte rule is gone: only the tokenizer has to fit.
    words = _word_tokenizer(tmp_path / "words", ["def", "return", "x", ":", "(", ")"])
    tokenizer = load_tokenizer(_cfg(small, tokenizer=str(words)))
    assert len(tokenizer) == 8 and tokenizer.pad_token == "[EOS]"
    assert TrainConfig().is_hf is False and load_tokenizer(TrainConfig()) is None  # demo GPT


def test_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    small = _config(tmp_path, "llama", vocab=100)
    assert main(["train", *TINY, "--model", f"hf:{small}", "--out", str(tmp_path / "a")]) == 2
    assert "vocab_size must be >= 256" in capsys.readouterr().err
    missing = f"hf:{tmp_path / 'nothing'}"
    assert main(["train", *TINY, "--model", missing, "--out", str(tmp_path / "b")]) == 2
    assert f"the folder {str(tmp_path / 'nothing')!r} is missing" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["train", *TINY, "--model", f"hf:{empty}", "--out", str(tmp_path / "e")]) == 2
    assert "neither a config.json" in capsys.readouterr().err
    assert main(["train", *TINY, "--lora", "2", "--out", str(tmp_path / "c")]) == 2
    assert "--lora needs --model hf:PATH" in capsys.readouterr().err


def test_a_moe_without_its_router_loss_says_so_once(tmp_path, capsys):
    """hf-client friction 4: a MoE config ships output_router_logits false; without
    --aux-loss-coef the run trained with no load balancing and no word about it."""
    moe = _config(tmp_path, "mixtral")
    err = _notes(tmp_path, capsys, moe)
    assert err.count("\n") == 1 and "router load-balancing loss is off" in err
    assert "--aux-loss-coef" in err and "0.001" in err  # Mixtral's default coefficient
    assert _notes(tmp_path, capsys, moe, aux_loss_coef=0.02) == ""  # turned on: no note
    from transformers import AutoConfig

    on = AutoConfig.from_pretrained(str(moe))
    on.output_router_logits = True  # the config's own loss is on
    on.save_pretrained(tmp_path / "moe_on")
    assert _notes(tmp_path, capsys, tmp_path / "moe_on") == ""
    assert _notes(tmp_path, capsys, _config(tmp_path, "llama")) == ""  # dense: nothing to say


def test_lora_rank_and_aux_loss_say_what_is_true(capsys, hf_dirs) -> None:
    """LR9: --lora 100000 on a 32-wide model ran without a word. M6: the refusal of
    --aux-loss-coef on a dense model named the field aux_loss_coef, not the flag."""
    pytest.importorskip("peft")
    from gradstep_cli.config.settings import ConfigError
    from gradstep_cli.models.hf import build_model, hf_config

    for rank in (100_000, 8):
        build_model(TrainConfig(model=f"hf:{hf_dirs['llama']}", seq_len=32, lora=rank))
        note = f"note: --lora {rank} is above the rank of every adapted layer (at most 32"
        assert (note in capsys.readouterr().err) == (rank > 32)
    cfg = TrainConfig(model=f"hf:{hf_dirs['llama']}", seq_len=32, aux_loss_coef=0.1)
    with pytest.raises(ConfigError, match=r"^--aux-loss-coef: model .* has no router loss"):
        hf_config(cfg)


def test_a_model_folders_code_is_refused_and_never_run(tmp_path, capsys, monkeypatch, hf_dirs):
    """S5: transformers asked '[y/N]' on a terminal (a 'y' ran the folder's code), and the
    refusal said to pass trust_remote_code=True, which no flag does. S1: a pickled .bin
    naming code was refused with torch's advice to load it with weights_only=False."""
    import torch

    remote, evil, marker = tmp_path / "remote", tmp_path / "evil", tmp_path / "ran"
    for folder in (remote, evil):
        shutil.copytree(hf_dirs["llama"], folder)
    config = json.loads((remote / "config.json").read_text())
    config.update(model_type="evilllama", auto_map={"AutoConfig": "modeling_evil.EvilConfig"})
    (remote / "config.json").write_text(json.dumps(config))
    (remote / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (evil / "model.safetensors").unlink()
    torch.save({"x": os.system}, evil / "pytorch_model.bin")  # a pickle naming code
    monkeypatch.setattr("builtins.input", lambda *a: "y")  # a user answering the prompt
    data = jsonl(tmp_path / "pc.jsonl", pairs(8))
    line = train(capsys, tmp_path, "--data", str(data), model=remote)
    assert "gradstep never runs a model folder's code" in line and "trust_remote" not in line
    line = train(capsys, tmp_path, "--data", str(data), model=evil)
    assert f"the weights in {evil} are a pickle that holds more than tensors (it refers to" in line
    assert "posix.system" in line or "os.system" in line, line
    assert "nothing in it was run" in line and "weights_only" not in line, line
    assert not marker.exists()
