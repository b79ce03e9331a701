"""What autograd saves in one forward of a tiny HF model, and the shapes to build one.

Shared by the HF memory-model tests: the distinct non-parameter storages a forward + loss
saves for backward (``saved_tensors_hooks``), as the activation formula counts them.
"""

from __future__ import annotations

from typing import Any

import torch

from gradstep.hf import causal_lm_loss
from tests.support.hf_assets import config_for

LOSS_SCALAR = 4  # the fp32 loss sum's own 0-dim tensor


def config(family: str, layers: int = 2, **overrides: Any) -> Any:
    """A tiny config of ``family`` with ``layers`` layers (rebuilt, so that derived fields
    such as ``layer_types`` follow)."""
    base = config_for(family)
    fields = base.to_dict()
    fields.pop("layer_types", None)
    fields.update(num_hidden_layers=layers, **overrides)
    return type(base).from_dict(fields)


def build(cfg: Any, lora: dict | None = None, seed: int = 0) -> torch.nn.Module:
    """The model of ``cfg`` (float32, training mode), LoRA-wrapped with ``lora`` kwargs."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**lora))
    return model.train()


def saved_bytes(model: torch.nn.Module, rows: int, seq: int, amp: bool) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in one forward + loss."""
    vocab = model.get_input_embeddings().num_embeddings
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, seq), generator=gen)
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1)}
    storages: dict[int, int] = {}
    keep = []  # alive until counted: no storage is freed and its address reused

    def pack(t: torch.Tensor) -> torch.Tensor:
        keep.append(t)
        storage = t.untyped_storage()
        storages[storage._cdata] = storage.nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with hooks, torch.autocast("cpu", torch.bfloat16, enabled=amp):
        causal_lm_loss(model, batch, shifted=True)
    owned = [*model.parameters(), *model.buffers()]
    params = {p.untyped_storage()._cdata for p in owned}
    return sum(n for key, n in storages.items() if key not in params)
