"""plan_step on synthetic predictions and step times."""

import json

import pytest
import torch

from gradstep.memory import (
    ProbeResult,
    TransformerShape,
    default_step_time,
    estimate_step_memory,
    plan_step,
    probe_step_time,
    step_predictor,
)
from gradstep.memory.plan import _default_sizes

MiB = 2**20


def linear(fixed_mib, per_item_mib, ckpt_per_item_mib=None):
    """peak = fixed + per_item * mbs; checkpointing shrinks the per-item cost."""
    ckpt = per_item_mib / 4 if ckpt_per_item_mib is None else ckpt_per_item_mib

    def predict(mbs, checkpointing):
        return int((fixed_mib + (ckpt if checkpointing else per_item_mib) * mbs) * MiB)

    return predict


def test_default_sizes_are_powers_of_two_and_divisors():
    assert _default_sizes(12) == [1, 2, 3, 4, 6, 8, 12]
    assert _default_sizes(1) == [1]
    assert _default_sizes(20) == [1, 2, 4, 5, 8, 10, 16, 20]


def test_global_batch_stays_exact_with_a_short_last_micro_batch():
    plan = plan_step(1000 * MiB, 10, predict=linear(100, 10), micro_batch_sizes=[4])
    assert (plan.micro_batch_size, plan.accum_steps, plan.last_micro_batch_size) == (4, 3, 2)
    for c in plan.candidates:
        assert (c.accum_steps - 1) * c.micro_batch_size + c.last_micro_batch_size == 10
    # Over ranks: each of 2 ranks takes 5 items.
    plan = plan_step(1000 * MiB, 10, world_size=2, predict=linear(100, 10))
    assert plan.per_rank_batch == 5
    assert all(c.micro_batch_size <= 5 for c in plan.candidates)
    assert {
        (c.micro_batch_size, c.accum_steps, c.last_micro_batch_size) for c in plan.candidates
    } >= {
        (4, 2, 1),
        (5, 1, 5),
    }


def test_margin_decides_what_fits():
    predict = linear(0, 100)  # mbs * 100 MiB
    plan = plan_step(1000 * MiB, 16, predict=predict, margin=0.1, checkpointing=(False,))
    fits = {c.micro_batch_size: c.fits for c in plan.candidates}
    assert fits[8] and not fits[16]  # 800 <= 900 < 1600
    assert plan.micro_batch_size == 8 and plan.predicted_peak_bytes == 800 * MiB
    tight = plan_step(1000 * MiB, 9, predict=predict, margin=0.1, micro_batch_sizes=[9])
    assert tight.candidates[0].fits  # 900 == 1000 * (1 - 0.1): the boundary fits
    loose = plan_step(1000 * MiB, 9, predict=predict, margin=0.2, checkpointing=(False,))
    assert not next(c for c in loose.candidates if c.micro_batch_size == 9).fits  # 900 > 800


def test_chosen_is_the_fastest_that_fits():
    plan = plan_step(1000 * MiB, 64, predict=linear(100, 50))
    # No checkpointing: mbs <= 16 fits (900 MiB usable); the largest amortises the overhead.
    assert (plan.micro_batch_size, plan.activation_checkpointing) == (16, False)
    chosen = next(
        c for c in plan.candidates if c.micro_batch_size == 16 and not c.activation_checkpointing
    )
    assert chosen.relative_throughput == 1.0
    assert all(c.relative_throughput <= 1.0 for c in plan.candidates if c.fits)
    # A step time that punishes large micro-batches (say, cache effects) flips the choice.
    plan = plan_step(1000 * MiB, 64, predict=linear(100, 50), step_time=lambda m, c: m * m)
    assert plan.micro_batch_size == 1


def test_checkpointing_only_when_needed():
    # No micro-batch fits without checkpointing: it must be on.
    plan = plan_step(1000 * MiB, 32, predict=linear(100, 1000, ckpt_per_item_mib=50))
    assert plan.activation_checkpointing and plan.micro_batch_size == 16
    # When time is per item (no per-micro-batch overhead), checkpointing is pure cost.
    per_item = default_step_time(overhead_items=0.0)
    plan = plan_step(1000 * MiB, 32, predict=linear(100, 100), step_time=per_item)
    assert not plan.activation_checkpointing and plan.micro_batch_size == 8
    # A large per-micro-batch overhead can make checkpointing + a bigger micro-batch win.
    heavy = default_step_time(overhead_items=50.0)
    plan = plan_step(1000 * MiB, 32, predict=linear(100, 400), step_time=heavy)
    assert plan.activation_checkpointing and plan.micro_batch_size == 8


def test_ties_prefer_no_checkpointing_then_larger_micro_batches():
    flat = lambda mbs, ckpt: 1.0 * mbs  # noqa: E731 - same items/s for every candidate
    plan = plan_step(1000 * MiB, 8, predict=lambda m, c: MiB, step_time=flat)
    assert (plan.micro_batch_size, plan.activation_checkpointing) == (8, False)


def test_nothing_fits_names_the_budget():
    with pytest.raises(ValueError, match=r"memory budget 100\.00 MiB is too small.*needs"):
        plan_step(100 * MiB, 8, predict=linear(200, 10))
    with pytest.raises(ValueError, match="memory budget"):
        plan_step("lots", 8, predict=linear(1, 1))


def test_bad_arguments():
    with pytest.raises(ValueError, match="global_batch"):
        plan_step(MiB, 0, predict=linear(0, 0))
    with pytest.raises(ValueError, match="world_size"):
        plan_step(MiB, 2, world_size=4, predict=linear(0, 0))
    with pytest.raises(ValueError, match="margin"):
        plan_step(MiB, 2, predict=linear(0, 0), margin=1.0)
    with pytest.raises(ValueError, match="micro-batch size"):
        plan_step(MiB, 2, predict=linear(0, 0), micro_batch_sizes=[5])


def test_json_and_table():
    plan = plan_step(
        "1GiB", 24, world_size=2, predict=linear(100, 50), step_time=default_step_time()
    )
    out = json.loads(json.dumps(plan.to_json()))
    for key in (
        "micro_batch_size",
        "accum_steps",
        "activation_checkpointing",
        "predicted_peak_bytes",
        "candidates",
    ):
        assert key in out
    assert out["budget_bytes"] == 2**30
    assert {"micro_batch_size", "relative_throughput", "fits"} <= set(out["candidates"][0])
    table = plan.table()
    chosen = [line for line in table.splitlines() if line.startswith("*")]
    assert len(chosen) == 1 and f" {plan.micro_batch_size} " in chosen[0]
    assert "1.00 GiB" in table and "chosen: micro-batch" in table
    widths = {len(line) for line in table.splitlines()[1:-1]}
    assert len(widths) == 1  # aligned


def test_step_predictor_uses_the_probe_and_the_analytic_checkpointing_difference():
    shape = TransformerShape(n_layer=2, d_model=8, n_head=2, vocab_size=16, seq_len=4, d_ff=16)
    probe = ProbeResult(
        fixed_bytes=10_000,
        per_item_bytes=5000,
        points=[],
        seconds_total=0.0,
        source="x",
        seconds_per_micro_batch=1.0,
        seconds_per_item=0.5,
    )
    predict = step_predictor(
        shape, probe=probe, per_rank_batch=8, probe_accum_steps=4, extra_bytes=7
    )
    assert predict(2, False) == 10_000 + 5000 * 2 + 7
    on = estimate_step_memory(shape, 2, activation_checkpointing=True, accum_steps=4).total
    off = estimate_step_memory(shape, 2, accum_steps=4).total
    assert predict(2, True) == predict(2, False) + on - off
    analytic = step_predictor(shape, param_dtype=torch.float32, fixed_bytes=123)
    assert analytic(2, False) == estimate_step_memory(shape, 2, fixed_bytes=123).total
    timer = probe_step_time(probe)
    assert timer(2, False) == 2.0 and timer(2, True) == pytest.approx(2.0 * 4 / 3)


def test_step_predictor_adds_the_gradients_a_one_micro_batch_probe_never_held():
    # The probe ran 1 micro-batch per step (its loss backward ran before any gradient
    # existed); a window of 4 holds all of them from the second micro-batch on.
    shape = TransformerShape(n_layer=2, d_model=8, n_head=2, vocab_size=16, seq_len=4, d_ff=16)
    probe = ProbeResult(10_000, 5000, [], 0.0, "x")
    predict = step_predictor(shape, probe=probe, per_rank_batch=8)  # probe_accum_steps=1
    assert predict(2, False) == probe.predict(2) + 1232 * 4  # P fp32 gradients
    assert predict(8, False) == probe.predict(8)  # 1 micro-batch: same as the probe


def test_near_ties_go_to_the_fixed_rule_not_to_the_timings():
    """Throughputs within TIE of the best are ties: no checkpointing, then the larger
    micro-batch (differences within the step-time model's resolution decide nothing)."""
    from gradstep.memory.plan import TIE

    def timed(noise):  # checkpointing at 8 items looks up to TIE faster than 4 without
        def step_time(mbs, ckpt):
            return (0.02 + mbs) / (1 + noise) if ckpt else 0.02 + mbs

        return step_time

    predict = linear(100, 100, ckpt_per_item_mib=10)  # without ckpt only mbs <= 4 fits
    for noise in (0.0, TIE / 4, TIE / 2):
        plan = plan_step(600 * MiB, 32, predict=predict, step_time=timed(noise))
        assert (plan.micro_batch_size, plan.activation_checkpointing) == (4, False), noise
    far = plan_step(600 * MiB, 32, predict=predict, step_time=timed(3 * TIE))
    assert far.activation_checkpointing  # a real gain still wins


def test_an_untimed_plan_prints_no_speed_column():
    plan = plan_step("1GiB", 8, predict=linear(100, 10))
    plan.timed = False
    rows = plan.table().splitlines()[2:-2]
    assert all(row.split()[-2] == "-" for row in rows)
    assert "speed: not modelled" in plan.table()


def test_nothing_fits_says_the_budget_that_would():
    with pytest.raises(ValueError, match=r"a budget of at least 386\.4MiB fits it") as err:
        plan_step(380 * MiB, 24, predict=lambda m, c: int(347.69 * MiB) + m)
    assert "10% safety margin" in str(err.value)


def test_one_size_probe_says_its_per_item_cost_is_an_upper_bound():
    one = ProbeResult(400 * MiB, 43 * MiB, [(1, 443 * MiB, 0.5)], 1.0, "vmhwm")
    assert one.one_size and "upper bound" in one.describe()
    two = ProbeResult(400 * MiB, 8 * MiB, [(1, 0, 0.5), (2, 0, 0.7)], 1.0, "vmhwm")
    assert not two.one_size and "upper bound" not in two.describe()


@pytest.mark.parametrize(
    "lengths", [[64] * 9, [5, 9, 9, 64, 33, 17], list(range(1, 200)), [3, 200, 7, 120, 7, 45, 90]]
)
def test_the_shape_sweep_runs_the_datas_other_lengths_spread_over_them(lengths):
    from gradstep.memory.plan import sweep_widths

    widths = sweep_widths(256, 6, lengths)
    assert widths == sorted(set(widths)) and 1 <= len(widths) <= 6
    shorter = set(lengths) - {max(lengths)}
    assert set(widths) <= (shorter or {max(lengths)})  # lengths the data yields, none longer
    if len(shorter) > 6:  # spread: the shortest and the longest of the shorter ones
        assert widths[0] == min(shorter) and widths[-1] == max(shorter)
    assert sweep_widths(256, 6) == sorted(set(sweep_widths(256, 6)))  # no data: 1..seq_len
    assert max(sweep_widths(256, 6)) < 256


def test_the_plan_reports_the_probes_own_peak_for_a_run_that_plans_itself():
    plan = plan_step("1GiB", 8, predict=linear(100, 10))
    assert plan.process_peak_bytes == plan.predicted_peak_bytes
    plan.probe_peak_bytes = plan.predicted_peak_bytes + 5 * MiB
    assert plan.process_peak_bytes == plan.probe_peak_bytes
    assert plan.to_json()["process_peak_bytes"] == plan.probe_peak_bytes
    assert "the probe itself peaked at" in plan.table()


def test_the_loss_chunking_is_planned_too_and_its_ties_go_to_the_runs_own_setting():
    """With ``loss_chunks``, every (size, checkpointing) comes chunked and whole; the whole
    logits cost memory (here 40 MiB an item more) and, by ``step_time``, may save time."""

    def predict(mbs, ckpt, chunk):
        return int((100 + (10 if chunk else 50) * mbs) * MiB)

    def step_time(faster):
        return lambda mbs, ckpt, chunk: (1 + mbs) * (1.0 if chunk else faster)

    plan = plan_step(
        1000 * MiB, 16, predict=predict, step_time=step_time(0.8), loss_chunks=[256, 0]
    )
    assert len(plan.candidates) == 2 * 2 * 5
    assert plan.key == (16, False, 0)  # 900 MiB: the whole logits fit at 16 and are faster
    assert "loss" in plan.table().splitlines()[1] and "whole" in plan.table()
    tight = plan_step(
        500 * MiB, 16, predict=predict, step_time=step_time(0.8), loss_chunks=[256, 0]
    )
    assert tight.key == (4, False, 0)  # 8 whole (500 MiB) does not fit; 4 whole beats 16 chunked
    tie = plan_step(
        1000 * MiB, 16, predict=predict, step_time=step_time(0.99), loss_chunks=[256, 0]
    )
    assert tie.key == (16, False, 256)  # within TIE: the first setting given, the run's own


def test_a_refusal_quotes_the_budget_the_caller_says_holds_a_candidate():
    def predict(mbs, ckpt):
        return (300 + 10 * mbs) * MiB

    with pytest.raises(ValueError, match=r"a budget of at least 400\.0MiB fits it") as err:
        plan_step(
            300 * MiB, 8, predict=predict, budget_for=lambda c: (399 + c.micro_batch_size) * MiB
        )
    assert err.value.needed_bytes == 400 * MiB
    assert "micro-batch 1," in str(err.value)


def test_a_short_last_micro_batchs_own_peak_is_weighed():
    """5 items at micro-batch 3 are a window of 3 and 2: the 2 is another input shape (on
    CPU, new kernels) and may peak above the 3; the candidate fits only if both do."""
    peaks = {3: 100 * MiB, 2: 900 * MiB}

    def predict(mbs, ckpt):
        return peaks[mbs]

    with pytest.raises(ValueError, match="too small"):
        plan_step(500 * MiB, 5, predict=predict, micro_batch_sizes=[3], checkpointing=(False,))
    plan = plan_step(1 * 2**30, 5, predict=predict, micro_batch_sizes=[3], checkpointing=(False,))
    assert plan.last_micro_batch_size == 2 and plan.predicted_peak_bytes == 900 * MiB


def test_the_probes_line_bends_where_the_analytic_model_stops_growing():
    """A 1024-token loss chunk fills at 4 rows of 256: a line through the peaks of 1, 2
    and 4 rows keeps growing by a chunk's quarter a row, the chunk does not. The prediction
    follows the model's bend (here the probe measured exactly the model: the prediction is
    the model), where the bare line over-predicted micro-batch 16 by 12 chunk-quarters."""
    from gradstep.memory.fit import _line

    shape = TransformerShape(n_layer=1, d_model=32, n_head=2, vocab_size=32_000, seq_len=256)

    def est(b):
        return estimate_step_memory(shape, b, accum_steps=1, loss_chunk_tokens=1024).total

    fixed, slope = _line([1, 2, 4], [est(b) for b in (1, 2, 4)])
    points = [(b, est(b), 0.0) for b in (1, 2, 4)]
    probe = ProbeResult(round(fixed), round(slope), points, 0.0, "x")
    predict = step_predictor(shape, probe=probe, per_rank_batch=16, loss_chunk_tokens=1024)
    assert abs(predict(16, False) - est(16)) <= 2
    quarter = 256 * 32_000 * 4  # a quarter chunk's float32 logits
    assert probe.predict(16) - est(16) > 10 * quarter  # the bare line
    one = ProbeResult(est(1) - 10**9, 10**9, points[:1], 0.0, "x")  # one size, any slope
    assert abs(step_predictor(shape, probe=one, per_rank_batch=16, loss_chunk_tokens=1024)(
        16, False) - est(16)) <= 2  # fmt: skip


def test_a_plan_of_the_loss_too_without_step_times_and_its_table_marks_the_choice():
    """``loss_chunks`` without ``step_time``: the default step time ignores the loss (the
    tie rule then takes the first setting); the table marks the chosen row whether the loss
    was planned or not."""

    def predict(mbs, ckpt, chunk=None):
        return (100 + 10 * mbs) * MiB

    plan = plan_step(2**30, 4, predict=predict, loss_chunks=[1024, 0])
    assert plan.loss_chunk_tokens == 1024 and not plan.timed
    assert sum(line.startswith("*") for line in plan.table().splitlines()) == 1
    kept = plan_step(2**30, 4, predict=lambda m, c: predict(m, c))
    kept.loss_chunk_tokens = 1024  # the run's own, not planned (the CLI sets it so)
    assert sum(line.lstrip().startswith("*") for line in kept.table().splitlines()) == 1
