"""The model stage: the run's model as its flags and an ``hf:`` model's ``config.json``
make it, resolved once (:class:`ModelSpec`).

The planner sizes it (:mod:`gradstep_cli.plan.estimate`) and probes throwaway instances of
it; the run builds it once (:mod:`gradstep_cli.run.build`). The probe builds its own
instance rather than a copy of the run's: a budget is a promise for the whole process, the
probe included, and a copy would hold two models at the probe's peak.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from gradstep_cli.config.settings import TrainConfig
from gradstep_cli.models.hf import build_model, gpt_config

if TYPE_CHECKING:
    from gradstep_cli.run.start import Checked

__all__ = ["ModelSpec", "resolve_model"]


@dataclass(frozen=True)
class ModelSpec:
    """The run's model: the toy GPT of ``--n-layer``/``--n-head``/``--d-model``, or the
    Hugging Face model ``hf:PATH`` (with ``--lora``)."""

    cfg: TrainConfig
    config: Any
    """Its shape: the toy GPT's :class:`GPTConfig`, or the HF config as the run adjusts it
    (router loss, no KV cache)."""

    @classmethod
    def of(cls, cfg: TrainConfig, hf_config: Any = None) -> ModelSpec:
        """``cfg``'s model: the toy GPT's shape from the flags, or ``hf_config``
        (:func:`~gradstep_cli.models.hf.hf_config`'s) for an hf: model."""
        if not cfg.is_hf:
            return cls(cfg, gpt_config(cfg))
        if hf_config is None:
            raise ValueError(f"model {cfg.model!r}: its config is needed (models.hf.hf_config)")
        return cls(cfg, hf_config)

    @property
    def hf_config(self) -> Any:
        """The HF config (None: the toy GPT)."""
        return self.config if self.cfg.is_hf else None

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def build(self) -> nn.Module:
        """A new instance on the CPU (pretrained weights or the seed's init, adapters)."""
        # Loading may annotate the config it is given (attention kernel, dtype): a copy keeps
        # this one as read, for the planner's shapes and the next instance.
        return build_model(self.cfg, copy.deepcopy(self.config))


def resolve_model(checked: Checked) -> ModelSpec:
    """The model stage: the checked settings' model (an hf: model's config, as checked)."""
    return ModelSpec.of(checked.cfg, checked.hf_config)
