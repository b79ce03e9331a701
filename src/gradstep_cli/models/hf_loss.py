"""The loss of an HF model on a run's batches (:class:`HFLoss`), its item count, and the
logits alone for the summary's sampler."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from gradstep import LossSum
from gradstep.hf import causal_lm_loss, chunkable, count_tokens
from gradstep.packing import mask_for
from gradstep.parallel import unwrap
from gradstep_cli.config.preflight import note
from gradstep_cli.data.sources import Batch

__all__ = ["HFLoss", "LogitsOnly", "count_batch"]


def count_batch(batch: Batch) -> int:
    """``count=`` of a run's batches: their labels are already shifted."""
    return count_tokens(batch, shifted=True)


@dataclass(frozen=True)
class HFLoss:
    """``loss_fn`` for an HF model on a run's batches (pre-shifted labels, right padding:
    no attention mask is needed for a causal model): :func:`gradstep.hf.causal_lm_loss`,
    ``chunk_tokens`` positions at a time (``--loss-chunk-tokens``; 0: the whole logits).
    A model whose head :func:`gradstep.hf.chunkable` refuses (LoRA-adapted, soft-capped)
    gets the whole logits, with a one-line note the first time."""

    device: torch.device
    chunk_tokens: int = 0
    _refused: dict[int, str | None] = field(default_factory=dict, compare=False, repr=False)

    def chunk_for(self, model: nn.Module) -> int | None:
        """The ``chunk_tokens=`` of ``model``'s loss (None: the whole logits)."""
        if not self.chunk_tokens:
            return None
        key = id(model)
        if key not in self._refused:
            why = chunkable(model)
            self._refused[key] = why
            if why is not None:
                note(
                    f"note: --loss-chunk-tokens {self.chunk_tokens} is not used: {why}; "
                    "the loss is computed from the whole logits"
                )
        return None if self._refused[key] is not None else self.chunk_tokens

    def __call__(self, model: nn.Module, batch: Batch) -> LossSum:
        moved = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        if "seq_ids" in moved:  # --packing: the 4-D block-causal mask its attention reads
            dtype = unwrap(model).get_input_embeddings().weight.dtype
            moved = mask_for(model, moved, dtype)
        return causal_lm_loss(model, moved, shifted=True, chunk_tokens=self.chunk_for(model))


class LogitsOnly(nn.Module):
    """``model(ids) -> logits`` for the summary's sampler, around an HF model."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits
