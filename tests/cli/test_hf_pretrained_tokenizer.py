"""The run's tokenizer (issue 21 §1): DIR's own, ``--tokenizer`` overrides, a missing pad
token is handled, a tokenizer larger than the model's vocabulary is refused, no tokenizer
means bytes (vocab >= 256); the final sample is encoded and decoded with it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from gradstep_cli.config.settings import ConfigError, TrainConfig  # noqa: E402
from gradstep_cli.models.hf import load_tokenizer  # noqa: E402
from gradstep_cli.run import summary  # noqa: E402
from tests.support import hf_assets  # noqa: E402

TEXT = "def area(r):\n    return 3.14159 * r ** 2  # <|endoftext|> stays text\n"


def _cfg(folder: Path | str, **kw: object) -> TrainConfig:
    return TrainConfig(model=f"hf:{folder}", seq_len=32, **kw)


def _ids(tokenizer, text: str = TEXT) -> list[int]:
    return tokenizer(text)["input_ids"]


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


class _Spike(torch.nn.Module):
    """An HF-like model whose next token is always ``token``; records the contexts it saw."""

    def __init__(self, vocab: int, token: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.vocab, self.token, self.seen = vocab, token, []

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> SimpleNamespace:
        self.seen.append(input_ids[0].tolist())
        logits = torch.full((*input_ids.shape, self.vocab), -1e4)
        logits[..., self.token] = 0.0
        return SimpleNamespace(logits=logits + self.w)


def _run(model: torch.nn.Module, tokenizer, n: int = 3) -> SimpleNamespace:
    cfg = TrainConfig(model="hf:unused", seq_len=32, sample_tokens=n)
    return SimpleNamespace(cfg=cfg, model=model, tokenizer=tokenizer)


def test_the_sample_is_encoded_and_decoded_with_the_tokenizer() -> None:
    tokenizer = hf_assets.load_tokenizer()
    token = _ids(tokenizer, " return")
    assert len(token) == 1  # one BPE token (not one byte): decoding it proves the tokenizer
    model = _Spike(hf_assets.VOCAB, token[0])
    assert summary._sample(_run(model, tokenizer)) == " return" * 3
    assert model.seen[0] == _ids(tokenizer, summary.SAMPLE_PROMPT.decode())
    # Without a tokenizer an HF model reads and writes bytes; ids past 255 are no byte.
    assert summary._sample(_run(_Spike(hf_assets.VOCAB, ord("x")), None)) == "xxx"
    assert summary._sample(_run(_Spike(hf_assets.VOCAB, 300), None, 2)) == "\ufffd\ufffd"
    model = _Spike(hf_assets.VOCAB, ord("y"))
    summary._sample(_run(model, None, 40))  # prompt + 40 > --seq-len 32: the context is cut
    assert max(len(seen) for seen in model.seen) == 32
