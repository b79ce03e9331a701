"""probe_memory: the fit on synthetic peaks, the budget promise, and one real CPU probe."""

import pytest

from gradstep.memory import TransformerShape, probe, probe_memory
from gradstep.memory.plan import step_predictor
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
    assert mem.calls == [1, 1, 2, 2, 4, 4]  # ascending, each size warmed up once
    assert (res.fixed_bytes, res.per_item_bytes) == (5000, 300)  # warm-up kept out of the fit
    assert [p[:2] for p in res.points] == [(1, 5300), (2, 5600), (4, 6200)]
    assert res.warmup[:2] == (1, 15_300)
    assert res.predict(16) == 5000 + 300 * 16
    assert res.source == "fake"
    assert res.seconds_total >= 0 and res.seconds_per_item >= 0
    assert "probe (fake)" in res.describe()


def test_budget_stops_before_a_size_that_would_not_fit(monkeypatch):
    mem = FakeMemory(monkeypatch, fixed=1000, per_item=100)
    res = probe_memory(mem.run, (1, 2, 4, 8), device="cpu", budget_bytes=1500, warmup="first")
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


def test_the_analytic_cost_per_item_lets_a_tight_budget_measure_a_second_size(monkeypatch):
    """A big fixed cost above the baseline (model, optimizer state) made the one-point upper
    bound charge it all to the items: b=2 predicted 1000 + 2 * 600 = 2200 > 1800 MiB, so a
    tight budget measured one size and every larger one looked as if it would not fit."""
    mib = 2**20
    mem = FakeMemory(monkeypatch, fixed=1500 * mib, per_item=100 * mib, baseline=1000 * mib)
    upper = probe_memory(mem.run, (1, 2, 4), device="cpu", budget_bytes=1800 * mib, warmup=False)
    assert upper.one_size and upper.per_item_source == "upper bound"
    assert upper.per_item_bytes == 600 * mib and upper.predict(2) == 2200 * mib
    mem = FakeMemory(monkeypatch, fixed=1500 * mib, per_item=100 * mib, baseline=1000 * mib)
    res = probe_memory(
        mem.run, (1, 2, 4), device="cpu", budget_bytes=1800 * mib, warmup=False,
        per_item_bytes=110 * mib,
    )  # fmt: skip
    # b=2: 1600 + 1.5 * 110 + 16 (a new shape's kernels) = 1781 fits; then the measured
    # line stops b=4 (1900 > 1800).
    assert mem.calls == [1, 2] and res.skipped == [4]
    assert (res.fixed_bytes, res.per_item_bytes) == (1500 * mib, 100 * mib)
    assert res.per_item_source == "measured"


def test_a_one_size_probe_takes_the_analytic_cost_per_item_through_its_point(monkeypatch):
    mem = FakeMemory(monkeypatch, fixed=1500, per_item=100, baseline=1000)
    res = probe_memory(
        mem.run, (1, 2), device="cpu", budget_bytes=1700, warmup=False, per_item_bytes=110
    )
    assert mem.calls == [1] and res.one_size and res.per_item_source == "analytic"
    assert res.predict(1) == 1600 and res.per_item_bytes == 110  # the point is on the line
    assert res.predict(4) == 1600 + 3 * 110  # not 1000 + 4 * 600
    assert "the per-item cost is the analytic model's" in res.describe()


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


def test_both_fits_ignore_what_earlier_sizes_left_behind(monkeypatch):
    # Each new size leaves 50 bytes behind for good (a per-shape kernel cache): the peaks
    # creep by 50 per shape on top of fixed + 100 per item.
    mem = FakeMemory(monkeypatch, fixed=1000, per_item=100)
    seen = set()

    def run(b):
        if b not in seen:
            seen.add(b)
            mem.baseline += 50
        mem.peak = max(mem.peak, mem.baseline + 100 * b)

    def probe_from_scratch(sizes, fit):
        seen.clear()
        mem.baseline = 1000
        return probe_memory(run, sizes, device="cpu", fit=fit)

    clean = probe_from_scratch((1, 2, 4), "increments")  # what CUDA uses
    assert (clean.per_item_bytes, clean.fixed_bytes) == (100, 1050)  # fixed + one shape
    peaks = probe_from_scratch((1, 2, 4), "peaks")  # CPU: peak = F + J * shapes + a * b
    assert (peaks.per_item_bytes, peaks.per_shape_bytes, peaks.fixed_bytes) == (100, 50, 1050)
    two = probe_from_scratch((1, 4), "peaks")  # too few sizes to separate the two
    assert two.per_item_bytes > 100 and two.per_shape_bytes == 0
    with pytest.raises(ValueError, match="fit must be"):
        probe_memory(run, device="cpu", fit="slope")


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="sizes"):
        probe_memory(lambda b: None, (0, 1), device="cpu")
    with pytest.raises(ValueError, match="warmup"):
        probe_memory(lambda b: None, device="cpu", warmup="twice")


def test_predict_seconds():
    res = ProbeResult(0, 0, [], 0.0, "x", seconds_per_micro_batch=0.5, seconds_per_item=0.25)
    assert res.predict_seconds(4) == 1.5


def test_time_fit_takes_the_fastest_run_and_stays_non_negative():
    from gradstep.memory.fit import _fit_seconds

    clean = [(1, 0, 1.5), (2, 0, 2.0), (4, 0, 3.0)]
    assert _fit_seconds(clean, []) == pytest.approx((1.0, 0.5))
    noisy_warmups = [(1, 0, 9.0), (2, 0, 1.9), (4, 0, 9.0)]  # slower warm-ups are ignored
    assert _fit_seconds(clean, noisy_warmups)[1] > 0.5
    assert _fit_seconds([(1, 0, 3.0), (4, 0, 1.0)], []) == (2.0, 0.0)  # slope < 0: flat
    fixed, per_item = _fit_seconds([(1, 0, 0.1), (4, 0, 1.0)], [])  # intercept < 0
    assert fixed == 0.0 and per_item == pytest.approx((0.1 + 4.0) / 17)


def test_per_shape_growth_is_corrected_only_when_it_does_not_rise_with_the_size():
    from gradstep.memory.fit import _per_shape

    # in use before each measured run / before each size's warm-up (its first run)
    assert _per_shape([100, 160, 210], [50, 150, 200]) == 10  # 10, 10: kernel caches
    assert _per_shape([100, 171, 228], [50, 160, 220]) == 8  # 11, 8: the smaller
    assert _per_shape([100, 150, 240], [50, 130, 200]) == 0  # 20, 40: heap retention
    assert _per_shape([100, 150], [50, 140]) == 0  # one growth: cannot tell
    assert _per_shape([100, 150, 200], [None, None, None]) == 0  # no warm-ups


def test_bound_kernel_caches_sets_what_the_user_did_not(monkeypatch):
    from gradstep.memory import bound_kernel_caches

    # setenv first: a delenv of an absent variable records nothing, so the value the
    # function sets would stay for the rest of the test process.
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")  # the user's choice stands
    assert bound_kernel_caches(32) is True
    import os

    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "32"
    assert os.environ["LRU_CACHE_CAPACITY"] == "7"
    assert bound_kernel_caches(32) is False  # nothing left to set
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="capacity must be an int >= 1"):
            bound_kernel_caches(bad)


def test_the_shape_sweep_stops_when_new_shapes_stop_growing_the_process(monkeypatch):
    mem = FakeMemory(monkeypatch, fixed=1000, per_item=100)
    grows = [40, 30, 0, 0, 0, 0]  # bytes each new shape leaves resident: the cache fills
    ran = []

    def shape(i):
        ran.append(i)
        mem.baseline += grows[i] * 2**20  # MiB, above the settle threshold at first

    res = probe_memory(mem.run, (1, 2), device="cpu", shapes=shape, max_shapes=6)
    assert ran == [0, 1, 2, 3] and res.shapes_run == 4 and res.shapes_settled
    assert res.shape_bytes == 70 * 2**20
    assert "4 more input shapes keep 70.00 MiB resident" in res.describe()
    mem.baseline = 1000
    endless = probe_memory(mem.run, (1, 2), device="cpu", shapes=lambda i: shape(0), max_shapes=3)
    assert endless.shapes_run == 3 and not endless.shapes_settled
    assert "kernel caches not bounded" in endless.describe()


def test_the_shape_sweep_keeps_the_budget(monkeypatch):
    mib = 2**20
    mem = FakeMemory(monkeypatch, fixed=100 * mib, per_item=10 * mib)
    ran = []

    def shape(i):
        ran.append(i)
        mem.baseline += 50 * mib

    res = probe_memory(
        mem.run, (1, 2), device="cpu", budget_bytes=240 * mib, shapes=shape, max_shapes=8
    )
    # Before each shape: in use + a step's 10 MiB + the largest growth seen (or a step's):
    # 100 + 10 + 10, 150 + 10 + 50 = 210 <= 240, then 200 + 10 + 50 = 260 > 240: stop.
    assert ran == [0, 1] and not res.shapes_settled
    assert not res.shapes_unmeasured  # two shapes measured: their growth is the charge


def test_a_sweep_the_budget_stops_at_once_charges_the_shapes_it_could_not_run(monkeypatch):
    """Outside re-check of memory-2 finding 1 (bf16, micro-batch 1, a tight budget): the
    budget stopped the sweep before its first shape, the plan charged nothing for the
    data's other lengths, and the run grew past the prediction (-10%) and the budget. The
    shapes not run are charged one step's increment, and a plan holds it."""
    mib = 2**20
    mem = FakeMemory(monkeypatch, fixed=100 * mib, per_item=10 * mib)
    ran = []
    res = probe_memory(
        mem.run, (1, 2), device="cpu", budget_bytes=115 * mib, shapes=ran.append, max_shapes=4
    )
    # b=1 peaks at 110 MiB over 100 in use; a shape could add a step's 10 more: 120 > 115.
    assert ran == [] and res.shapes_run == 0 and res.shapes_unmeasured
    assert res.shape_bytes == 10 * mib  # the b=1 peak above the baseline
    assert "no room in the budget to run the data's other input shapes" in res.describe()
    shape = TransformerShape(n_layer=1, n_head=2, d_model=16, seq_len=16, vocab_size=256)
    predict = step_predictor(shape, probe=res, per_rank_batch=1)
    assert predict(1, False) == res.predict(1) + 10 * mib  # the probe ran this candidate
