"""``--micro-batch-size auto`` and ``gradstep plan`` (gradstep_cli.plan.planning): the probe and
the analytic model's prediction of every candidate."""

from __future__ import annotations

import json

import pytest

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
