"""The tests of tests/memory/test_probe.py that start processes or run the CLI end to end; its
other tests stay there.
"""

import json
import subprocess
import sys

import pytest

REAL_PROBE = """
import json, torch
from gradstep.memory import current_bytes, pin_mmap_threshold, probe_memory, reset_peak
torch.set_num_threads(1)
pinned = pin_mmap_threshold()
weight = torch.nn.Parameter(torch.ones(1))
ran = []

def run(b):  # 4 MiB per item: input, product, exp, backward temporaries (~12 MiB at peak)
    ran.append(b)
    x = torch.rand(b, 1 << 20)
    (x * weight).exp().sum().backward()

first = probe_memory(run, (1, 2, 4), device="cpu")
ran.clear()
budget = current_bytes("cpu") + 6 * first.per_item_bytes  # room for 4 items, not 16
second = probe_memory(run, (1, 4, 16), device="cpu", budget_bytes=budget)
print(json.dumps({"source": reset_peak("cpu"), "pinned": pinned, "fit": first.fit,
                  "peaks": [p[1] for p in first.points], "per_item": first.per_item_bytes,
                  "ran": ran, "skipped": second.skipped, "budget": budget,
                  "max_peak": max(p[1] for p in second.points),
                  "highest": second.highest_bytes}))
"""


def test_real_cpu_probe_grows_with_b_and_keeps_the_budget():
    # A fresh interpreter, as a probe runs at the start of training: this process's heap
    # already holds what earlier tests freed, which later allocations would reuse.
    proc = subprocess.run(
        [sys.executable, "-c", REAL_PROBE], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if out["source"] != "vmhwm":
        pytest.skip("VmHWM cannot be reset here (/proc/self/clear_refs not writable)")
    peaks = out["peaks"]
    assert peaks == sorted(peaks) and peaks[-1] > peaks[0]
    assert out["per_item"] > 8 * 2**20  # at least two of the kept 4 MiB tensors
    assert out["fit"] == "peaks"  # CPU RSS: absolute peaks (see probe._fit_mode)
    assert 16 not in out["ran"] and out["skipped"] == [16]
    assert out["max_peak"] <= out["budget"]
    # What a process that probes before it trains peaks at: every measured run, warm-ups too.
    assert out["max_peak"] <= out["highest"] <= out["budget"]
