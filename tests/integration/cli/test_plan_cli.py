"""`gradstep plan` plans a run `gradstep train` accepts, end to end (the refusals the two
commands share, and `plan --json`'s errors, are in test_cli.py)."""

from __future__ import annotations

import json

from gradstep_cli.cli import main

MODEL = ["--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16"]


def test_a_plan_that_train_accepts_still_plans(capsys):
    assert main(["plan", *MODEL, "--global-batch", "6", "--memory-budget", "4GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["global_batch"] == 6 and "error" not in plan
