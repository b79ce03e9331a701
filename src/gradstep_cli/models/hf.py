"""``gradstep train --model hf:PATH``: a Hugging Face causal LM as the run's model.

Nothing is ever downloaded. ``hf:DIR`` loads DIR's weights when it holds any, else (and
with ``--init random``, and for ``hf:path/to/config.json``) random weights from ``--seed``;
the tokenizer is DIR's own (``--tokenizer`` overrides; none: the data is bytes). Parameters
are float32, except the frozen base of ``--lora --precision bf16`` (bfloat16; PEFT keeps
the adapters float32): an AdamW update of ~lr rounded into bf16 storage is lost for most
weights at fine-tuning learning rates, so trained weights stay float32 under autocast
(docs/guide/fine-tuning.md, "The model folder"). ``--lora`` adds PEFT adapters
(:mod:`gradstep_cli.models.lora`); ``--aux-loss-coef`` turns on a mixture of experts' router
loss.
"""

from __future__ import annotations

import contextlib
import pickle
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradstep_cli.config.preflight import note
from gradstep_cli.config.settings import ConfigError, TrainConfig
from gradstep_cli.models.gpt import GPT, GPTConfig
from gradstep_cli.models.hf_loss import HFLoss, LogitsOnly, count_batch

__all__ = [
    "HFLoss", "LogitsOnly", "build_model", "count_batch", "gpt_config", "hf_config",
    "load_tokenizer", "param_dtype",
]  # fmt: skip

HF_PREFIX = "hf:"
BYTE_VOCAB = 256
WEIGHT_FILES = (
    "model.safetensors", "model.safetensors.index.json",
    "pytorch_model.bin", "pytorch_model.bin.index.json",
)  # fmt: skip
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def build_model(cfg: TrainConfig, config: Any = None) -> nn.Module:
    """The run's model on the CPU: the toy GPT, or the HF model ``cfg.model`` names, of
    ``config`` (:func:`gpt_config`'s or :func:`hf_config`'s; made here when not given)."""
    if not cfg.is_hf:
        return GPT(gpt_config(cfg) if config is None else config)
    model = _pretrained_or_random(cfg, hf_config(cfg) if config is None else config)
    if cfg.lora:
        from gradstep_cli.models.lora import (
            add_lora,  # it reads this module's notes: imported when used
        )

        model = add_lora(model, cfg)
        _rank_note(model, cfg.lora)
    if cfg.packing:
        check_packing(model, segments=not cfg.compile)
    return model


def check_packing(model: nn.Module, segments: bool = True) -> None:
    """``--packing`` on an HF model: refused (naming its family and attention
    implementation) unless packed rows are shown exact for it (gradstep.packing). With
    ``segments`` an ``sdpa`` model attends one sequence at a time where that is shown exact
    on it (``gradstep.packing.use_segments``: no T x T mask; not under ``--compile``, whose
    graphs want the mask's fixed shapes)."""
    from gradstep.packing import check_exact, use_segments

    try:
        check_exact(model)
    except ValueError as exc:
        raise ConfigError(f"--packing: {str(exc).removeprefix('packing: ')}") from None
    used = segments and use_segments(model)
    way = (
        "one sequence at a time (gradstep.packing.segment_attention)"
        if used
        else f"a 4-D block-causal mask under {model.config._attn_implementation!r}"
    )
    _note_once(f"packing: the model attends {way}")


_SAID: set[str] = set()


def _note_once(line: str) -> None:
    """A note said once a process (the planner's probe builds the model too)."""
    if line not in _SAID:
        _SAID.add(line)
        note(line)


def _rank_note(model: nn.Module, rank: int) -> None:
    """A note when ``--lora`` exceeds every adapted layer's rank: the update B @ A of an
    (out x in) layer has rank at most min(out, in), so the extra rank only adds parameters."""
    from peft.tuners.lora import LoraLayer

    sizes = [
        min(module.in_features, module.out_features)
        for module in model.modules()
        if isinstance(module, LoraLayer)
        and isinstance(getattr(module, "in_features", None), int)
        and isinstance(getattr(module, "out_features", None), int)
    ]
    if sizes and rank > max(sizes):
        note(
            f"note: --lora {rank} is above the rank of every adapted layer (at most "
            f"{max(sizes)}, the smaller of a layer's input and output sizes): the adapters "
            f"learn no update that --lora {max(sizes)} could not, and hold more parameters"
        )


def gpt_config(cfg: TrainConfig) -> GPTConfig:
    """The demo GPT's shape from the run's flags (``--n-layer``, ``--seq-len``, ...)."""
    return GPTConfig(
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        d_model=cfg.d_model,
        max_seq_len=cfg.seq_len,
        dropout=cfg.dropout,
        loss_chunk_tokens=cfg.loss_chunk_tokens or None,
    )


def param_dtype(cfg: TrainConfig) -> torch.dtype:
    """The dtype the HF model's base parameters are held in (the module docstring: why)."""
    return torch.bfloat16 if cfg.lora and cfg.precision == "bf16" else torch.float32


def _path(cfg: TrainConfig) -> Path:
    return Path(cfg.model[len(HF_PREFIX) :]).expanduser()


def _weights(path: Path) -> str | None:
    """The weight file of folder ``path`` from_pretrained would read (None: none)."""
    if path.is_dir():
        return next((name for name in WEIGHT_FILES if (path / name).is_file()), None)
    return None


def _pretrained_or_random(cfg: TrainConfig, config: Any) -> nn.Module:
    path, dtype = _path(cfg), param_dtype(cfg)
    weights = _weights(path)
    if weights is not None and cfg.init == "pretrained":
        model = _from_pretrained(cfg, path, config, dtype)
        count = sum(p.numel() for p in model.parameters())
        note(f"loaded pretrained weights from {path} ({count:,} parameters)")
        return model.train()  # from_pretrained returns eval mode: dropout would be off
    note(_random_initnote(cfg, path, weights))
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.seed)  # the seed's init, whatever ran before
    # Drawn in float32 and rounded once, so a bf16 base is the float32 init's rounding.
    return AutoModelForCausalLM.from_config(config).to(dtype)


def _random_initnote(cfg: TrainConfig, path: Path, weights: str | None) -> str:
    seed = f"random init (--seed {cfg.seed})"
    if not path.is_dir():
        beside = _weights(path.parent)
        hint = f"; hf:{path.parent} would load its {beside}" if beside else ""
        return f"model {cfg.model!r} is a config alone: {seed}{hint}"
    if weights is None:
        return f"no weights in {path}: random init"
    return f"--init random: {weights} in {path} is not loaded: {seed}"


def _from_pretrained(cfg: TrainConfig, path: Path, config: Any, dtype: torch.dtype) -> nn.Module:
    """DIR's weights into a model of ``config``; weights of another config are an error."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    unreadable = (OSError, ValueError, RuntimeError, KeyError, EOFError, SafetensorError)
    try:
        with _quiet_transformers():
            model, info = AutoModelForCausalLM.from_pretrained(
                str(path),
                config=config,  # ours: router loss and use_cache already set
                dtype=dtype,
                local_files_only=True,
                trust_remote_code=False,
                output_loading_info=True,
                ignore_mismatched_sizes=True,  # reported below, with the folder's name
            )
    except (*unreadable, pickle.UnpicklingError) as exc:
        raise _unloadable(cfg, path, exc) from None
    problems = {
        "missing from the files": sorted(info.get("missing_keys", ())),
        "in the files but not in the model": sorted(info.get("unexpected_keys", ())),
        "of another shape": sorted(str(k) for k in info.get("mismatched_keys", ())),
    }
    some = lambda keys: ", ".join(keys[:3]) + (", ..." if len(keys) > 3 else "")  # noqa: E731
    found = [f"{len(keys)} {what} ({some(keys)})" for what, keys in problems.items() if keys]
    if found:
        raise ConfigError(
            f"model {cfg.model!r}: the weights in {path} are not those of the model its "
            f"config.json describes: parameters {'; '.join(found)}. Point --model at a folder "
            "whose config.json and weights belong together (save_pretrained writes both), or "
            "pass --init random to start from random weights"
        )
    return model


def _unloadable(cfg: TrainConfig, path: Path, exc: BaseException) -> ConfigError:
    """Why DIR's weights did not load. torch's own refusal of a pickle that names code
    advises loading it with weights_only=False, which would run that code: said here
    instead is what the file refers to and how to get weights that load."""
    text = str(exc)
    if "Weights only load failed" not in text:
        return ConfigError(f"model {cfg.model!r}: cannot load the weights in {path} ({exc})")
    names = re.findall(r"GLOBAL (\S+)", text)
    refers = f" (it refers to {names[0]})" if names else ""
    return ConfigError(
        f"model {cfg.model!r}: the weights in {path} are a pickle that holds more than "
        f"tensors{refers}; it was not loaded and nothing in it was run. Load only weights "
        "you trust, saved as safetensors (save_pretrained writes model.safetensors)"
    )


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No progress bar or load report while loading: what matters is checked and said here."""
    from transformers.utils import logging

    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "model 'hf:PATH' needs transformers (and peft for --lora): pip install 'gradstep[hf]'"
        ) from None
    return transformers


def _read_config(cfg: TrainConfig) -> Any:
    """The HF config ``hf:PATH`` names, as saved."""
    transformers = _transformers()
    path = _path(cfg)
    if not path.exists():
        resumed = " (the run resumed here was trained on it)" if cfg.resume else ""
        raise ConfigError(
            f"model {cfg.model!r}: the folder {str(path)!r}{resumed} is missing (moved or "
            "deleted?): put it back at this path; nothing is ever downloaded"
        )
    if not (path.is_file() or (path / "config.json").is_file()):
        adapter = (path / "adapter_config.json").is_file()
        hint = " (a PEFT adapter folder: point --model at its base model)" if adapter else ""
        raise ConfigError(
            f"model {cfg.model!r}: {str(path)!r} is neither a config.json file nor a folder "
            f"holding one (save_pretrained){hint}; nothing is ever downloaded"
        )
    try:
        # trust_remote_code=False: a folder's own code is never run, and transformers never
        # asks (on a terminal it would ask whether to run it).
        return transformers.AutoConfig.from_pretrained(
            str(path), local_files_only=True, trust_remote_code=False
        )
    except (OSError, ValueError, KeyError) as exc:
        if "trust_remote_code" in str(exc):
            raise ConfigError(
                f"model {cfg.model!r}: its config.json needs the Python code in {path} (an "
                "auto_map for a model type transformers does not know); gradstep never runs "
                "a model folder's code: use a model whose type transformers ships"
            ) from None
        raise ConfigError(f"model {cfg.model!r}: not a usable HF config ({exc})") from None


def hf_config(cfg: TrainConfig) -> Any:
    """The HF config from ``hf:PATH``, checked against the run and adjusted for training."""
    config = _read_config(cfg)
    positions = getattr(config, "max_position_embeddings", None) or getattr(
        config, "n_positions", None
    )
    if isinstance(positions, int) and positions < cfg.seq_len:
        raise ConfigError(
            f"model {cfg.model!r} holds {positions} positions, fewer than seq_len="
            f"{cfg.seq_len}; pass --seq-len {positions} or less"
        )
    if cfg.aux_loss_coef is not None:
        if not hasattr(config, "router_aux_loss_coef"):
            raise ConfigError(
                f"--aux-loss-coef: model {cfg.model!r} ({config.model_type}) has no router loss "
                "(no router_aux_loss_coef in its config): it is not a mixture of experts"
            )
        config.output_router_logits = True
        config.router_aux_loss_coef = cfg.aux_loss_coef
    routed = hasattr(config, "router_aux_loss_coef")
    if routed and cfg.aux_loss_coef is None and not getattr(config, "output_router_logits", False):
        note(
            f"model {cfg.model!r} is a mixture of experts whose config has "
            "output_router_logits false: its router load-balancing loss is off; pass "
            f"--aux-loss-coef COEF (the config's is {config.router_aux_loss_coef}) to turn it on"
        )
    config.use_cache = False  # training: no KV cache built in every forward
    return config


def load_tokenizer(cfg: TrainConfig, config: Any = None) -> Any:
    """The run's tokenizer: ``--tokenizer``, else DIR's own, else None (the data is read as
    bytes; so for the toy GPT). It has a pad token (EOS when it has none: padding is masked
    by length and labels, never by id) and fits the vocabulary of the model's ``config``
    (read here when not given)."""
    if not cfg.is_hf:
        return None
    config = _read_config(cfg) if config is None else config
    path = _path(cfg)
    folder = path if path.is_dir() else path.parent
    vocab = getattr(config, "vocab_size", None)
    if cfg.tokenizer is not None:
        source, what = Path(cfg.tokenizer).expanduser(), f"--tokenizer {cfg.tokenizer}"
    elif any((folder / name).is_file() for name in TOKENIZER_FILES):
        source, what = folder, f"the tokenizer in {folder}"
    else:
        if not isinstance(vocab, int) or vocab < BYTE_VOCAB:
            raise ConfigError(
                f"model {cfg.model!r}: vocab_size must be >= {BYTE_VOCAB} to read the data as "
                f"bytes (no tokenizer in {folder}), got {vocab}; pass --tokenizer PATH"
            )
        note(
            f"no tokenizer in {folder} and no --tokenizer: the data is read as bytes "
            "(token ids 0-255)"
        )
        return None
    tokenizer = _auto_tokenizer(source, what)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if isinstance(vocab, int) and len(tokenizer) > vocab:
        raise ConfigError(
            f"{what} holds {len(tokenizer)} tokens but model {cfg.model!r} has vocab_size "
            f"{vocab}: ids from {vocab} on have no embedding. Use the model's own tokenizer "
            "(or a model whose vocabulary holds this tokenizer's)"
        )
    return tokenizer


def _auto_tokenizer(source: Path, what: str) -> Any:
    """A tokenizer folder (AutoTokenizer) or a ``tokenizer.json`` file, with an EOS token."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if not source.exists():
        raise ConfigError(f"{what}: no such file or folder")
    if source.name == "tokenizer.json" and (source.parent / "tokenizer_config.json").is_file():
        source = source.parent  # its special tokens (EOS, pad, chat template) are there
    try:
        with _quiet_transformers():
            if source.is_dir():
                tokenizer = AutoTokenizer.from_pretrained(
                    str(source), local_files_only=True, trust_remote_code=False
                )
            else:
                tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(source))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"{what}: not a usable Hugging Face tokenizer ({exc})") from None
    if tokenizer.eos_token is None:
        raise ConfigError(
            f"{what} has no EOS token (it ends documents and completions): use a tokenizer "
            "folder whose tokenizer_config.json sets eos_token"
        )
    return tokenizer
