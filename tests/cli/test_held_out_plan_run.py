"""``gradstep plan --no-probe``: every candidate is predicted for the accumulation steps it
would run with, against the analytic model called directly.

A window of one micro-batch (micro-batch size = the per-rank batch) starts its backward with
no gradient allocated; a window of several holds every gradient during the later
backwards; a short last micro-batch is predicted at its own size too. Up to the runtime's
fixed cost (this process's resident set: the same for every candidate) the plan's peaks
must equal the model's for each candidate's (micro-batch size, accumulation steps, last
size). A held-out mutation audit found the predictor built without the per-rank batch
surviving (every candidate charged as if its accumulation were unknown; issue 20, §4).
"""

from __future__ import annotations

import json

from gradstep.memory import TransformerShape, estimate_step_memory
from gradstep_cli.cli import main

MODEL = ["--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16"]
SHAPE = TransformerShape(n_layer=1, n_head=2, d_model=16, seq_len=16, vocab_size=256)
"""The demo GPT those flags build (its byte vocabulary: 256)."""


def analytic(mbs: int, steps: int, checkpointing: bool) -> int:
    """The model's total for the demo GPT with the default flags (fp32, AdamW, one
    process, no dropout), without the runtime's fixed cost."""
    est = estimate_step_memory(
        SHAPE, mbs, accum_steps=steps, activation_checkpointing=checkpointing, optimizer="adamw"
    )
    return est.total


def test_no_probe_predicts_each_candidate_for_its_own_accumulation_steps(capsys):
    argv = ["plan", *MODEL, "--global-batch", "6", "--no-probe", "--device", "cpu"]
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
