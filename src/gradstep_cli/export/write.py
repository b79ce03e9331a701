"""What ``gradstep export`` writes into its folder (:func:`write`): the model or adapter
(``save_pretrained``), the tokenizer, a generation config and ``gradstep_export.json``.

An adapter folder names its base in ``adapter_config.json``'s ``base_model_name_or_path``:
the base folder's absolute path, or ``--base-name NAME`` (a Hub id, or a path relative to
where the adapter will be loaded), which PEFT and ``AutoModelForCausalLM`` resolve when
they load the adapter. ``gradstep_export.json`` records both, and the base's fingerprint.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import nn

from gradstep import __version__
from gradstep.checkpoint import CheckpointInfo
from gradstep_cli.config.settings import TrainConfig
from gradstep_cli.models.hf import HF_PREFIX

__all__ = ["END_OF_TURN", "EXPORT_FILE", "KINDS", "no_progress_bars", "write"]

EXPORT_FILE = "gradstep_export.json"
KINDS = {"full": "the model", "lora-adapter": "the LoRA adapter", "lora-merged": "the merged model"}
"""What an export holds (``gradstep_export.json``'s ``kind``), in words."""
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|eom_id|>")
"""Chat templates' end-of-turn tokens: generation stops at them too when the template uses
them (a model fine-tuned on chats ends its turn with one, not with EOS)."""


def write(
    folder: Path,
    model: nn.Module,
    tokenizer: Any,
    cfg: TrainConfig,
    info: CheckpointInfo,
    kind: str,
    base_name: str | None = None,
) -> None:
    """Fill ``folder`` with the export of ``kind`` (:data:`KINDS`); an adapter names its base
    ``base_name`` (default: the base folder's absolute path)."""
    base = _base_model(model)
    base.config.use_cache = True  # the run turned it off for training; generation wants it
    base_path = str(Path(cfg.model[len(HF_PREFIX) :]).resolve())
    if kind == "lora-adapter":
        peft_config = model.peft_config["default"]
        peft_config.base_model_name_or_path = base_name or base_path
        peft_config.inference_mode = True
    try:
        model.save_pretrained(str(folder))
    except Exception as exc:  # safetensors' I/O error names no file: the weights' it is
        if getattr(exc, "filename", None) is None and "(os error" in str(exc):
            exc.filename = str(folder / _weights_name(model, kind))
        raise
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    _generation_config(base, tokenizer).save_pretrained(str(folder))
    fingerprint = info.base_fingerprint
    adapters = (p for p in model.parameters() if p.requires_grad)
    written = next(adapters if kind == "lora-adapter" else base.parameters())
    record = {
        "format": "gradstep-export",
        "kind": kind,
        "run_checkpoint": str(info.path.resolve()),
        "step": info.step,
        "model": cfg.model,
        "dtype": str(written.dtype).removeprefix("torch."),
        "base_fingerprint": None if fingerprint is None else fingerprint.digest,
        "base_path": base_path,
        "base_name": base_name if kind == "lora-adapter" else None,
        "tokenizer": tokenizer is not None,
        "gradstep_version": __version__,
    }
    (folder / EXPORT_FILE).write_text(json.dumps(record, indent=1) + "\n")


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """save_pretrained's "Writing model shards" bar: the export prints its own line."""
    from transformers.utils import logging

    enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            logging.enable_progress_bar()


def _weights_name(model: nn.Module, kind: str) -> str:
    """The file ``save_pretrained`` writes the weights to (past 50 GB, shards: a pattern)."""
    if kind == "lora-adapter":
        return "adapter_model.safetensors"
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return "model.safetensors" if size <= 50 * 10**9 else "model-*.safetensors"


def _base_model(model: nn.Module) -> Any:
    """The ``PreTrainedModel`` inside a PEFT model (or the model itself)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def _generation_config(model: Any, tokenizer: Any) -> Any:
    """The model's generation config with the tokenizer's EOS (and end-of-turn) and pad."""
    from transformers import GenerationConfig

    gen = GenerationConfig.from_model_config(model.config)
    if tokenizer is None:
        return gen
    eos = [tokenizer.eos_token_id]
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    vocab = tokenizer.get_vocab()
    eos += [vocab[t] for t in END_OF_TURN if t in vocab and t in template and vocab[t] not in eos]
    gen.eos_token_id = eos[0] if len(eos) == 1 else eos
    gen.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    if tokenizer.bos_token_id is not None:
        gen.bos_token_id = tokenizer.bos_token_id
    return gen
