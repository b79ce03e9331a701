"""Local Hugging Face assets for tests: a tokenizer trained here and pretrained model folders.

Nothing is downloaded. The tokenizer is a byte-level BPE trained with the ``tokenizers``
library on Python standard-library sources (the demo's default corpus), saved with
``PreTrainedTokenizerFast.save_pretrained`` so ``AutoTokenizer.from_pretrained(folder)``
loads it, with a chat template whose assistant turns sit inside ``{% generation %}`` (what
``return_assistant_tokens_mask`` reads). A model folder is ``save_pretrained`` of a tiny
model of one of several families, built from a config with a fixed seed, so its weights are
known to the test that made it.

Everything is built once per process and copied on request (each test may change its copy).
"""

from __future__ import annotations

import functools
import shutil
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

EOS = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
PAD = "<|pad|>"
SPECIAL = [EOS, IM_START, IM_END, PAD]
VOCAB = 512

# ChatML, with the assistant's content and its end-of-turn token marked for training.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_ROOT = Path(tempfile.mkdtemp(prefix="gradstep-hf-assets-"))


def training_text(max_bytes: int = 400_000) -> list[str]:
    """Standard-library sources: the text the tokenizer is trained on."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="ignore")
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


def train_tokenizer(
    texts: list[str], dest: Path, vocab_size: int = VOCAB, *, pad: bool = False, chat: bool = True
) -> Path:
    """A byte-level BPE of ``vocab_size`` trained on ``texts``, saved at ``dest`` so that
    ``AutoTokenizer.from_pretrained(dest)`` loads it: EOS ``<|endoftext|>`` (id 0), the
    ChatML tokens, a pad token only with ``pad``, the chat template with ``chat``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    kwargs: dict[str, Any] = {"eos_token": EOS}
    if pad:
        kwargs["pad_token"] = PAD
    if chat:
        kwargs["chat_template"] = CHAT_TEMPLATE
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)
    fast.save_pretrained(dest)
    return Path(dest)


@functools.cache
def _tokenizer_folder(pad: bool, chat: bool) -> Path:
    folder = _ROOT / f"tokenizer-pad{int(pad)}-chat{int(chat)}"
    return train_tokenizer(training_text(), folder, pad=pad, chat=chat)


def tokenizer_dir(dest: Path, *, pad: bool = False, chat: bool = True) -> Path:
    """A copy of the local tokenizer at ``dest`` (no pad token unless ``pad``)."""
    shutil.copytree(_tokenizer_folder(pad, chat), dest)
    return dest


def load_tokenizer(*, pad: bool = False, chat: bool = True) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(_tokenizer_folder(pad, chat)))


def config_for(family: str, vocab_size: int = VOCAB, **overrides: Any) -> Any:
    """A tiny config of ``family`` (hidden 32, 2 layers, 4 heads, dropout 0)."""
    import transformers as tf

    eos = SPECIAL.index(EOS)
    common = dict(vocab_size=vocab_size, eos_token_id=eos, bos_token_id=eos)
    llama_like = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    moe = dict(num_experts=4, num_experts_per_tok=2, output_router_logits=False)
    builders = {
        "llama": lambda: tf.LlamaConfig(**common, **llama_like),
        "qwen2": lambda: tf.Qwen2Config(**common, **llama_like),
        "phi3": lambda: tf.Phi3Config(**common, **llama_like, pad_token_id=None),
        "gpt_neox": lambda: tf.GPTNeoXConfig(
            **common,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
        ),  # fmt: skip
        "opt": lambda: tf.OPTConfig(
            **common,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
            word_embed_proj_dim=32,
            pad_token_id=None,
        ),  # fmt: skip
        "qwen2_moe": lambda: tf.Qwen2MoeConfig(
            **common,
            **llama_like,
            **moe,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        ),  # fmt: skip
        "olmoe": lambda: tf.OlmoeConfig(**common, **llama_like, **moe),
        # The rest of hf-client-2's families (LoRA must place adapters in each).
        "phi": lambda: tf.PhiConfig(**common, **llama_like, resid_pdrop=0.0, embd_pdrop=0.0),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(
            **common, **llama_like, **moe, moe_intermediate_size=32
        ),
        "granitemoe": lambda: tf.GraniteMoeConfig(
            **common,
            **llama_like,
            num_local_experts=4,
            num_experts_per_tok=2,
            output_router_logits=False,
        ),  # fmt: skip
    }
    if family not in builders:
        raise ValueError(f"family must be one of {', '.join(builders)}, got {family!r}")
    config = builders[family]()
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


FAMILIES = ("llama", "qwen2", "phi3", "gpt_neox", "opt", "qwen2_moe", "olmoe")
REVIEW_FAMILIES = (
    "qwen2", "phi3", "phi", "gpt_neox", "opt", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe",
)  # fmt: skip
"""The 9 families hf-client-2 tried (FAMILIES is unchanged: other tests iterate over it)."""


def build_model(family: str = "llama", seed: int = 0, **overrides: Any) -> Any:
    """The tiny ``family`` model with weights drawn from ``seed`` (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    # The implementation is from_config's argument: a config key of that name is ignored.
    impl = overrides.pop("attn_implementation", None)
    config = config_for(family, **overrides)
    return AutoModelForCausalLM.from_config(config, attn_implementation=impl)


def model_dir(
    dest: Path,
    family: str = "llama",
    *,
    seed: int = 0,
    weights: str = "safetensors",
    tokenizer: bool = True,
    pad: bool = False,
    **overrides: Any,
) -> Path:
    """A ``save_pretrained`` folder at ``dest``: config.json, the weights (``weights``:
    safetensors, sharded (several safetensors files and an index), bin, or none) and,
    with ``tokenizer``, the local tokenizer's files."""
    if weights not in ("safetensors", "sharded", "bin", "none"):
        raise ValueError(f"weights must be safetensors, sharded, bin or none, got {weights!r}")
    model = build_model(family, seed, **overrides)
    if weights in ("none", "bin"):
        model.config.save_pretrained(dest)
        if weights == "bin":  # transformers 5 writes safetensors only: the legacy file by hand
            import torch

            torch.save(model.state_dict(), Path(dest) / "pytorch_model.bin")
    else:
        model.save_pretrained(dest, max_shard_size="40KB" if weights == "sharded" else "50GB")
    if tokenizer:
        load_tokenizer(pad=pad).save_pretrained(dest)
    return dest
