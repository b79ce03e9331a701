"""The data stage: the run's tokenizer and data, read and tokenized once (:class:`Data`).

The planner measures the rows' lengths on it and holds it while probing (the run will hold
it too); the run cuts its rank's training stream and validation batches from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gradstep_cli.data.sources import TextSource, load_source
from gradstep_cli.models.hf import load_tokenizer

if TYPE_CHECKING:
    from gradstep_cli.run.start import Checked

__all__ = ["Data", "load_data"]


@dataclass(frozen=True)
class Data:
    """The run's data: both sides of the split, as tokens (or bytes)."""

    tokenizer: Any
    """The HF model's tokenizer (None: bytes, the toy GPT's and a tokenizer-less model's)."""
    source: TextSource


def load_data(checked: Checked) -> Data:
    """The data ``--data``/``--val-data`` name, tokenized as the model reads it."""
    tokenizer = load_tokenizer(checked.cfg, checked.hf_config)
    return Data(tokenizer, load_source(checked.cfg, tokenizer))
