"""The budget ``--micro-batch-size auto`` and ``gradstep plan`` use when ``--memory-budget``
is not given, checked against /proc read here: on CPU, the memory the machine has available
plus what this process already holds, both in KiB (``kB`` in /proc), in bytes. A held-out
mutation audit found kB read as 1000 bytes surviving (issue 20, section 4): 2.3 % less
budget, hundreds of MiB on a machine with GiBs free.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from gradstep_cli.config.settings import TrainConfig
from gradstep_cli.plan.planning import device_budget

MiB = 2**20
DRIFT = 32 * MiB
"""How far the machine's available memory may move between two readings here (other
processes allocate and free); below the 2.3 % a wrong unit costs on any machine with more
than 3 GiB available (the test machine: over 20 GiB)."""


def kib(path: str, key: str) -> int:
    for line in Path(path).read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def available_bytes() -> int:
    return (kib("/proc/meminfo", "MemAvailable") + kib("/proc/self/status", "VmRSS")) * 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_without_a_budget_the_cpu_budget_is_available_plus_held_memory_in_bytes():
    cfg = TrainConfig(global_batch=8)
    assert cfg.memory_budget is None
    for _ in range(20):
        before = available_bytes()
        got = device_budget(cfg, torch.device("cpu"))
        after = available_bytes()
        if abs(after - before) <= DRIFT:
            break
    assert min(before, after) - DRIFT <= got <= max(before, after) + DRIFT


def test_a_given_budget_is_taken_as_given():
    cfg = TrainConfig(global_batch=8, memory_budget="1.5GiB")
    assert device_budget(cfg, torch.device("cpu")) == 3 * 2**29
