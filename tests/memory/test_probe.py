"""probe_memory: the fit on synthetic peaks, the budget promise, and one real CPU probe."""

import pytest
import torch

from gradstep.memory import probe, probe_memory
from gradstep.memory.probe import ProbeResult


class FakeMemory:
    """Peaks of ``fixed + per_item * b`` (+ a one-time cost on the first call)."""

    def __init__(self, monkeypatch, fixed=1000, per_item=100, first_extra=0, baseline=None):
        self.fixed, self.per_item, self.first_extra = fixed, per_item, first_extra
        self.baseline = fixed if baseline is None else baseline
        self.calls: list[int] = []
        self.peak = self.baseline
        monkeypatch.setattr(probe, "reset_peak", self._reset)
        monkeypatch.setattr(probe, "peak_bytes", lambda device=None: self.peak)
        monkeypatch.setattr(probe, "current_bytes", lambda device=None: self.baseline)

    def _reset(self, device=None):
        self.peak = self.baseline
        return "fake"

    def run(self, b):
        extra = self.first_extra if not self.calls else 0
        self.calls.append(b)
        self.peak = max(self.peak, self.fixed + self.per_item * b + extra)


def test_fit_recovers_fixed_and_per_item(monkeypatch):
    mem = FakeMemory(monkeypatch, fixed=5000, per_item=300, first_extra=10_000)
    res = probe_memory(mem.run, (4, 1, 2), device="cpu")
    assert mem.calls == [1, 1, 2, 4]  # warm-up first, then ascending
    assert (res.fixed_bytes, res.per_item_bytes) == (5000, 300)  # warm-up kept out of the fit
    assert [p[:2] for p in res.points] == [(1, 5300), (2, 5600), (4, 6200)]
    assert res.warmup[:2] == (1, 15_300)
    assert res.predict(16) == 5000 + 300 * 16
    assert res.source == "fake"
    assert res.seconds_total >= 0 and res.seconds_per_item >= 0
    assert "probe (fake)" in res.describe()


def test_budget_stops_before_a_size_that_would_not_fit(monkeypatch):
    mem = FakeMemory(monkeypatch, fixed=1000, per_item=100)
    res = probe_memory(mem.run, (1, 2, 4, 8), device="cpu", budget_bytes=1500)
    # After 1, 2, 4 the line predicts 1800 for b=8 > 1500: never run.
    assert mem.calls == [1, 1, 2, 4]
    assert res.skipped == [8]
    assert max(p[1] for p in res.points) <= 1500
    assert (res.fixed_bytes, res.per_item_bytes) == (1000, 100)


def test_budget_from_one_point_is_an_upper_bound(monkeypatch):
    # Baseline 1000, warm-up b=1 peaks at 1100 -> b=2 predicted 1000 + 100*2 = 1200 (fits
    # 1250), then from two points b=4 -> 1400 > 1250: stop.
    mem = FakeMemory(monkeypatch, fixed=1000, per_item=100)
    res = probe_memory(mem.run, (1, 2, 4), device="cpu", budget_bytes=1250, warmup=False)
    assert mem.calls == [1, 2]
    assert res.skipped == [4]


def test_analytic_estimate_guards_the_first_run(monkeypatch):
    mem = FakeMemory(monkeypatch)
    with pytest.raises(ValueError, match="memory budget"):
        probe_memory(mem.run, device="cpu", budget_bytes=1200, estimate=lambda b: 5000)
    assert mem.calls == []
    with pytest.raises(ValueError, match="memory budget .* already exceeded"):
        probe_memory(mem.run, device="cpu", budget_bytes=500)


def test_agree_makes_every_rank_stop_together(monkeypatch):
    mem = FakeMemory(monkeypatch)
    votes = []

    def agree(fits):  # another rank says no from the second size on
        votes.append(fits)
        return fits and len(votes) < 2

    res = probe_memory(mem.run, (1, 2, 4), device="cpu", agree=agree)
    assert mem.calls == [1, 1] and res.skipped == [2, 4]
    assert res.per_item_bytes == 100 and res.fixed_bytes == 1000  # one point: upper bound


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match="sizes"):
        probe_memory(lambda b: None, (0, 1), device="cpu")


def test_predict_seconds():
    res = ProbeResult(0, 0, [], 0.0, "x", seconds_per_micro_batch=0.5, seconds_per_item=0.25)
    assert res.predict_seconds(4) == 1.5


def test_real_cpu_probe_grows_with_b_and_keeps_the_budget():
    if probe.reset_peak("cpu") != "vmhwm":
        pytest.skip("VmHWM cannot be reset here (/proc/self/clear_refs not writable)")
    weight = torch.nn.Parameter(torch.ones(1))
    item = 1 << 20  # 4 MiB of fp32 per item, twice (input and saved product)
    ran = []

    def run(b):
        ran.append(b)
        x = torch.rand(b, item)
        (x * weight).exp().sum().backward()

    res = probe_memory(run, (1, 2, 4), device="cpu")
    peaks = [p[1] for p in res.points]
    assert peaks == sorted(peaks) and peaks[-1] > peaks[0]
    assert res.per_item_bytes > 4 * 2**20  # at least the input itself
    ran.clear()
    budget = res.predict(4) + 2**20  # room for 4 but not 16
    res2 = probe_memory(run, (1, 4, 16), device="cpu", budget_bytes=budget)
    assert 16 not in ran and res2.skipped == [16]
