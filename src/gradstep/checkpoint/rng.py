"""Each rank's random number generators (python, numpy, torch CPU and CUDA) as plain state.

The state goes through :mod:`.codec` into ``rng-rankNNNNN.json``, one file per rank.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["rng_file", "rng_state", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state().numpy().tobytes(),
    }
    # Only when CUDA is already in use: querying it would initialise a CUDA context.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        cuda = [torch.frombuffer(bytearray(s), dtype=torch.uint8) for s in state["cuda"]]
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])


def rng_file(r: int) -> str:
    return f"rng-rank{r:05d}.json"
