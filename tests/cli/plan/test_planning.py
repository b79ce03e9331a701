"""``--micro-batch-size auto`` and ``gradstep plan`` (gradstep_cli.plan.planning): the probe and
the analytic model's prediction of every candidate."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from gradstep.memory import TransformerShape, estimate_step_memory
from gradstep_cli.cli import main

MODEL = ["--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16"]

SHAPE = TransformerShape(n_layer=1, n_head=2, d_model=16, seq_len=16, vocab_size=256)
"""The demo GPT those flags build (its byte vocabulary: 256)."""


def analytic(mbs: int, steps: int, checkpointing: bool) -> int:
    """The model's total for the demo GPT with the default flags (fp32, AdamW, one
    process, no dropout, the whole logits: --loss-chunk-tokens 0), without the
    runtime's fixed cost."""
    est = estimate_step_memory(
        SHAPE,
        mbs,
        accum_steps=steps,
        activation_checkpointing=checkpointing,
        optimizer="adamw",
    )
    return est.total


pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _sum(out):  # a LossSum of every output element
    from gradstep import LossSum

    return LossSum(out.pow(2).sum(), out.numel())


def test_no_probe_predicts_each_candidate_for_its_own_accumulation_steps(capsys):
    argv = ["plan", *MODEL, "--global-batch", "6", "--no-probe", "--device", "cpu"]
    argv += ["--loss-chunk-tokens", "0"]  # analytic()'s whole logits (the default chunks)
    assert main([*argv, "--memory-budget", "8GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    offsets = {}
    for c in plan["candidates"]:
        mbs, steps, last = c["micro_batch_size"], c["accum_steps"], c["last_micro_batch_size"]
        ckpt = c["activation_checkpointing"]
        assert (steps - 1) * mbs + last == 6
        want = max(analytic(mbs, steps, ckpt), analytic(last, steps, ckpt))
        offsets[(mbs, ckpt)] = c["predicted_peak_bytes"] - want
    assert {(6, False), (4, False), (1, False)} <= offsets.keys()  # one window, a short last
    fixed = offsets[(6, False)]
    assert fixed > 0  # the process's own resident set
    assert all(offset == fixed for offset in offsets.values()), offsets


def test_no_probe_counts_the_runtime_the_process_already_holds(capsys):
    from gradstep.memory import current_bytes

    argv = ["plan", *MODEL, "--global-batch", "8", "--no-probe", "--device", "cpu"]
    assert main([*argv, "--memory-budget", "4GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    # The analytic prediction includes this process's resident set (interpreter, torch):
    # the tiny model's tensors alone are a few MiB.
    assert plan["predicted_peak_bytes"] >= current_bytes("cpu") * 0.9
    assert main([*argv, "--memory-budget", "20MiB"]) == 2
    err = capsys.readouterr().err
    assert "memory budget 20.00 MiB" in err and "--memory-budget" in err


def test_a_budget_below_the_process_names_the_budget_it_needs(capsys):
    argv = ["plan", *MODEL, "--global-batch", "8", "--device", "cpu", "--memory-budget", "5MiB"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "already exceeded before probing" in err
    needed = err.split("give --memory-budget ")[1].split()[0]
    from gradstep.memory import current_bytes, parse_size

    assert parse_size(needed) > current_bytes("cpu")


def test_the_probe_lets_its_ddp_model_go(tmp_path):
    """Under DDP the Stepper's communication hook (registered by the clipped step's norm)
    holds its strategy, which holds the model: a cycle through DDP's C++ reducer that gc
    cannot see. Without the probe's release the model stays alive (that is what leaked the
    probe's model, gradients and AdamW state into a DDP auto run: +177 MiB measured)."""
    import gc
    import weakref

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from gradstep import Stepper
    from gradstep_cli.plan.planning import _release

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        alive = {}
        for release in (False, True):
            model = DistributedDataParallel(torch.nn.Linear(8, 8))
            stepper = Stepper(model, torch.optim.AdamW(model.parameters()), norm_in_backward=True)
            stepper.step([torch.randn(4, 8)], lambda m, x: _sum(m(x)))
            ref = weakref.ref(model.module)
            if release:
                _release(stepper)
            del model, stepper
            gc.collect()
            alive[release] = ref() is not None
        assert alive == {False: True, True: False}
    finally:
        dist.destroy_process_group()


def test_a_refusal_after_a_sweep_that_could_not_run_quotes_the_room_it_needs():
    """When the budget left the probe no room for the data's other lengths, the plan
    charges the smallest step's whole cost for them (a 400 MiB budget was refused with "at
    least 451.4MiB" while 420 MiB planned at 374 MiB and ran). The quote holds the step
    and the room the sweep needs instead, with the slack another process needs."""
    from gradstep.memory import ProbeResult, needed_budget
    from gradstep.memory.candidates import Candidate
    from gradstep.memory.probe import SHAPE_GUESS_BYTES
    from gradstep_cli.plan.budget import MARGIN
    from gradstep_cli.plan.quote import QUOTE_SLACK, needed, room

    mib = 2**20
    unmeasured = ProbeResult(
        300 * mib, 9 * mib, [(1, 352 * mib, 1.0)], 1.0, "vmhwm",
        baseline_bytes=300 * mib, shape_bytes=52 * mib, shapes_unmeasured=True,
    )  # fmt: skip
    cand = Candidate(1, 16, True, 406 * mib, 1.0, False, 1, 1.0)  # 352 + 52 + 2
    spare = room(torch.device("cpu"), packed=False)
    assert spare == SHAPE_GUESS_BYTES and room(torch.device("cpu"), packed=True) == 0
    want = needed_budget((406 - 52) * mib * (1 + QUOTE_SLACK) + SHAPE_GUESS_BYTES * 1.02, MARGIN)
    assert abs(needed(cand, unmeasured, spare) - want) <= 1
    assert needed(cand, unmeasured, spare) < needed_budget(406 * mib, MARGIN)  # not 451 MiB
    # A candidate predicted below the probe's own first step (checkpointing where the probe
    # ran without): the quote still holds that step and the sweep's room.
    low = dataclasses.replace(cand, predicted_peak_bytes=380 * mib)  # 380 - 52 < 352
    assert needed(low, unmeasured, spare) == needed_budget(
        (352 * mib + SHAPE_GUESS_BYTES) * (1 + QUOTE_SLACK), MARGIN
    )
    measured = dataclasses.replace(unmeasured, shapes_unmeasured=False, shape_bytes=5 * mib)
    assert needed(cand, measured, spare) == needed_budget(406 * mib * (1 + QUOTE_SLACK), MARGIN)


def test_the_same_flags_give_the_same_plan_and_the_tie_rule_decides_near_ties(capsys):
    """Without timings in the ranking, two plannings of the same flags agree on every
    candidate's speed, and among near-ties (within TIE) the rule picks: no checkpointing,
    the run's own loss setting, the larger micro-batch."""
    from gradstep.memory.plan import TIE

    argv = ["plan", *MODEL, "--global-batch", "8", "--no-probe", "--device", "cpu"]
    plans = []
    for _ in range(2):
        assert main([*argv, "--memory-budget", "8GiB", "--json"]) == 0
        plans.append(json.loads(capsys.readouterr().out))
    speeds = [[c["relative_throughput"] for c in p["candidates"]] for p in plans]
    assert speeds[0] == speeds[1]
    plan = plans[0]
    key = ("micro_batch_size", "activation_checkpointing", "loss_chunk_tokens")
    near = [c for c in plan["candidates"] if c["fits"] and c["relative_throughput"] >= 1 - TIE]
    rule = min(near, key=lambda c: (c[key[1]], c[key[2]] != 1024, -c[key[0]]))
    assert tuple(plan[k] for k in key) == tuple(rule[k] for k in key)
    assert {c["loss_chunk_tokens"] for c in plan["candidates"]} == {1024, 0}
    for chunk in ("512", "1024"):  # given on the command line, the default too: kept
        given = [*argv, "--memory-budget", "8GiB", "--json", "--loss-chunk-tokens", chunk]
        assert main(given) == 0
        kept = json.loads(capsys.readouterr().out)
        assert {c["loss_chunk_tokens"] for c in kept["candidates"]} == {None}
        assert kept["loss_chunk_tokens"] == int(chunk)


@pytest.mark.slow
def test_plan_and_train_choose_the_same_plan_for_the_same_flags(tmp_path, capsys):
    flags = [*MODEL, "--global-batch", "8", "--device", "cpu", "--memory-budget", "4GiB"]
    assert main(["plan", *flags, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    run = ["--max-steps", "1", "--warmup", "0", "--eval-batches", "1", "--sample-tokens", "0"]
    out = tmp_path / "run"
    assert main(["train", *flags, *run, "--micro-batch-size", "auto", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    key = ("micro_batch_size", "activation_checkpointing", "loss_chunk_tokens")
    assert tuple(config[k] for k in key) == tuple(plan[k] for k in key)


@pytest.mark.slow
def test_the_budget_a_refusal_quotes_plans_and_trains_within_itself(tmp_path, capsys):
    """A budget this process already nearly fills is refused with a budget to give;
    ``train --micro-batch-size auto`` at the quoted budget plans, trains, and peaks within
    it (the run's own high-water mark of the resident set). bench/planner.py checks a
    refusal after probing the same way, from outside."""
    from gradstep.memory import current_bytes, format_bytes, parse_size

    model = ["--n-layer", "2", "--n-head", "4", "--d-model", "128", "--seq-len", "256"]
    flags = [*model, "--global-batch", "8", "--device", "cpu"]
    # Below what this process holds with the margin: refused whatever the session loaded.
    low = format_bytes(current_bytes("cpu") / 0.95).replace(" ", "")
    assert main(["plan", *flags, "--memory-budget", low]) == 2
    err = capsys.readouterr().err
    marker = next(m for m in ("a budget of at least ", "give --memory-budget ") if m in err)
    quoted = err.split(marker, 1)[1].split()[0]
    run = ["--max-steps", "2", "--warmup", "0", "--eval-batches", "1", "--sample-tokens", "0"]
    out = tmp_path / "run"
    argv = ["train", *flags, *run, "--micro-batch-size", "auto", "--memory-budget", quoted]
    assert main([*argv, "--out", str(out)]) == 0, capsys.readouterr().err
    peaks = [json.loads(line)["peak_memory_mb"] for line in (out / "metrics.jsonl").open()]
    assert max(peaks) * 2**20 <= parse_size(quoted)


def test_planning_runs_with_the_runs_threads(monkeypatch, capsys):
    """``gradstep plan`` probes with ``--threads`` (default 1), as ``train`` runs: with
    torch's default (every core) its probe measured other thread pools than train's, and on
    a shared 2-core machine the walk's plan took 42 s instead of 7."""
    from gradstep_cli.plan import planning

    seen = []
    real = planning._plan

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(planning, "_plan", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        argv = ["plan", *MODEL, "--global-batch", "4", "--no-probe", "--device", "cpu"]
        assert main([*argv, "--memory-budget", "4GiB", "--threads", "1"]) == 0
        assert seen == [1] and torch.get_num_threads() == 2  # restored afterwards
    finally:
        torch.set_num_threads(before)
    capsys.readouterr()


def _gpt_cfg(**kw):
    from gradstep_cli.config.settings import TrainConfig

    base = dict(n_layer=1, n_head=2, d_model=16, seq_len=64, global_batch=8,
                micro_batch_size="auto", memory_budget="8GiB", device="cpu")  # fmt: skip
    return TrainConfig(**{**base, **kw})


def _sft_source():
    """Unpacked rows of 10-64 tokens, a quarter of whose tokens train (prompt/completion)."""
    import numpy as np

    from tests.cli.plan.test_rows import Source

    return Source([10, 20, 40, 64, 64], np.array([False, False, False, True] * 40))


def _step_times(cfg, source):
    """What each candidate's step must cost: the speed model of the run's rows and loss."""
    from gradstep.memory import step_time_model
    from gradstep_cli.models.spec import ModelSpec
    from gradstep_cli.plan.estimate import model_shape

    shape = model_shape(ModelSpec.of(cfg, None), 64)
    return step_time_model(shape, 64, [10, 20, 40, 64], [1, 1, 1, 2], "cpu", trained=0.25)


@pytest.mark.parametrize("chunk", [None, 64])
def test_each_candidate_is_timed_on_the_runs_rows_and_its_loss(chunk):
    """The step time of every candidate is the count for the data's lengths and the share
    of tokens that train (a quarter here: the chunked loss projects only those), with the
    candidate's loss (planned: chunked or whole) or the run's (``--loss-chunk-tokens``
    given: kept)."""
    from gradstep_cli.plan.planning import plan_run

    cfg = _gpt_cfg() if chunk is None else _gpt_cfg(loss_chunk_tokens=chunk)
    plan = plan_run(cfg, torch.device("cpu"), probe=False, source=_sft_source()).plan
    time = _step_times(cfg, None)
    seen = set()
    for c in plan.candidates:
        loss = chunk if chunk is not None else c.loss_chunk_tokens
        seen.add(loss)
        key = (c.activation_checkpointing, loss)
        want = (c.accum_steps - 1) * time(c.micro_batch_size, *key) + time(
            c.last_micro_batch_size, *key
        )
        assert c.step_seconds == pytest.approx(want, rel=1e-12), c
    assert seen == ({1024, 0} if chunk is None else {64})


def test_the_probe_measures_two_sizes_even_when_one_row_is_fastest():
    """Unpacked ragged rows make micro-batch 1 the fastest: the probe still runs 2 (a
    measured line, not the analytic slope through one point), but nothing larger."""
    from types import SimpleNamespace

    from gradstep_cli.plan.planning import _probe_sizes

    def run(per_rank, cost):
        return SimpleNamespace(chunk=1024, per_rank=per_rank,
                               speed=lambda m, ckpt, chunk: cost(m))  # fmt: skip

    assert _probe_sizes(run(16, lambda m: m * m)) == [1, 2]  # padding: 1 is fastest
    assert _probe_sizes(run(16, lambda m: m + 10)) == [1, 2, 4]  # packed: larger is faster
    assert _probe_sizes(run(3, lambda m: m + 10)) == [1, 2]
    assert _probe_sizes(run(1, lambda m: m)) == [1]


def test_train_runs_the_loss_the_plan_chose(monkeypatch):
    """``--micro-batch-size auto`` takes the plan's micro-batch, checkpointing and loss:
    a plan of the whole logits (0) trains the whole logits, not the default chunks."""
    from types import SimpleNamespace

    from gradstep import parallel
    from gradstep.memory import Plan
    from gradstep_cli.models.spec import ModelSpec
    from gradstep_cli.plan import batch as stage
    from gradstep_cli.plan import planning
    from gradstep_cli.run.launch import Launch
    from gradstep_cli.run.start import Checked

    cfg = _gpt_cfg()
    chosen = Plan(micro_batch_size=2, accum_steps=4, activation_checkpointing=True,
                  predicted_peak_bytes=1, budget_bytes=2, global_batch=8,
                  loss_chunk_tokens=0)  # fmt: skip
    planned = planning.Planned(chosen, None, 0, 64, 0)
    monkeypatch.setattr(planning, "plan_for", lambda *a, **k: planned)
    monkeypatch.setattr(stage, "_say_plan", lambda p: None)
    launch = Launch.of(cfg, parallel.DistEnv(0, 1, 0, torch.device("cpu"), None))
    out = stage.plan_batch(Checked(cfg, launch), SimpleNamespace(source=None),
                           ModelSpec.of(cfg, None))  # fmt: skip
    assert cfg.loss_chunk_tokens == 1024
    assert (out.cfg.micro_batch_size, out.cfg.activation_checkpointing) == (2, True)
    assert out.cfg.loss_chunk_tokens == 0 and out.cfg.accum_steps == 4
