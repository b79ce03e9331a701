"""Shared test settings: deterministic CPU, small hypothesis budgets (CI has 2 cores)."""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "gradstep",
    max_examples=int(os.environ.get("GRADSTEP_HYPOTHESIS_EXAMPLES", "12")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
settings.load_profile("gradstep")

# Tiny models: one intra-op thread is as fast, and 2-rank tests do not oversubscribe 2 cores.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
