"""`gradstep plan`, `--micro-batch-size auto`, `--global-batch`, `--activation-checkpointing`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from gradstep_cli.cli import main
from tests.support.batches import text_corpus

MODEL = ["--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16"]
RUN = [*MODEL, "--eval-batches", "1", "--sample-tokens", "0", "--warmup", "1",
       "--eval-every", "0", "--max-steps", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return text_corpus(tmp_path_factory.mktemp("data") / "corpus")


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_plan_json_has_the_contract_keys(capsys):
    argv = ["plan", *MODEL, "--global-batch", "12", "--memory-budget", "4GiB", "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    for key in ("micro_batch_size", "accum_steps", "activation_checkpointing",
                "predicted_peak_bytes", "candidates"):  # fmt: skip
        assert key in plan, key
    # The chosen row is among the candidates, fits, and covers the global batch exactly.
    chosen = [c for c in plan["candidates"]
              if (c["micro_batch_size"], c["activation_checkpointing"])
              == (plan["micro_batch_size"], plan["activation_checkpointing"])]  # fmt: skip
    assert len(chosen) == 1 and chosen[0]["fits"]
    c = chosen[0]
    assert (c["accum_steps"] - 1) * c["micro_batch_size"] + c["last_micro_batch_size"] == 12
    assert plan["predicted_peak_bytes"] <= 4 * 2**30


def test_plan_table_and_a_budget_nothing_fits(capsys):
    assert main(["plan", *MODEL, "--global-batch", "8", "--memory-budget", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "chosen: micro-batch" in out and "mbs" in out
    assert main(["plan", *MODEL, "--global-batch", "8", "--memory-budget", "1MB"]) == 2
    assert "memory budget" in capsys.readouterr().err
    assert main(["plan", *MODEL, "--memory-budget", "1GiB"]) == 2  # no global batch
    assert main(["plan", *MODEL, "--global-batch", "8", "--memory-budget", "lots"]) == 2
    assert "--memory-budget: " in capsys.readouterr().err


def test_auto_micro_batch_plans_records_and_keeps_the_global_batch(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", *RUN, "--data", str(corpus), "--out", str(out), "--global-batch", "6",
            "--micro-batch-size", "auto", "--memory-budget", "4GiB"]  # fmt: skip
    assert main(argv) == 0
    assert "chosen: micro-batch" in capsys.readouterr().err
    plan = json.loads((out / "plan.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert config["micro_batch_size"] == plan["micro_batch_size"]
    assert config["accum_steps"] == plan["accum_steps"]
    for row in rows(out):
        assert row["planned_peak_mb"] == pytest.approx(plan["predicted_peak_bytes"] / 2**20)
        assert row["micro_batches"] == plan["accum_steps"]


def test_global_batch_is_exact_and_its_split_does_not_change_the_update(corpus, tmp_path):
    """6 sequences as 4 + 2, as 3 + 3, or with checkpointing: the same updates (the loss is
    normalised by tokens; checkpointing recomputes the same values)."""
    finals = {}
    splits = {
        "4": ["--micro-batch-size", "4"],
        "3": ["--micro-batch-size", "3"],
        "ckpt": ["--micro-batch-size", "4", "--activation-checkpointing"],
    }
    for name, extra in splits.items():
        out = tmp_path / name
        argv = ["train", *RUN, "--data", str(corpus), "--out", str(out), "--global-batch", "6",
                "--save-every", "2", *extra]  # fmt: skip
        assert main(argv) == 0
        metrics = rows(out)
        assert [r["micro_batches"] for r in metrics] == [2, 2]
        finals[name] = (metrics, out / "checkpoints" / "step-000002" / "model.safetensors")
    from safetensors.torch import load_file

    ref_rows, ref_file = finals["4"]
    ref = load_file(ref_file)
    for name in ("3", "ckpt"):
        got_rows, got_file = finals[name]
        assert [r["items"] for r in got_rows] == [r["items"] for r in ref_rows]
        got = load_file(got_file)
        for key, value in ref.items():
            tol = 0 if name == "ckpt" else 1e-6
            torch.testing.assert_close(got[key], value, rtol=tol, atol=tol)


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


def _fixed_cfg(budget: str | None, mbs: int = 4):
    from gradstep_cli.config.settings import TrainConfig

    return TrainConfig(
        n_layer=1, n_head=2, d_model=16, seq_len=16, micro_batch_size=mbs,
        global_batch=8, memory_budget=budget,
    )  # fmt: skip


def test_a_budget_settles_the_process_and_a_fixed_choice_is_predicted(monkeypatch):
    from gradstep_cli.plan import planning

    calls = []
    monkeypatch.setattr(planning, "pin_mmap_threshold", lambda: calls.append("pin"))
    monkeypatch.setattr(planning, "bound_kernel_caches", lambda: calls.append("caches"))
    cpu = torch.device("cpu")
    assert planning.prepare_process(_fixed_cfg(None), cpu) == [] and calls == []
    notes = planning.prepare_process(_fixed_cfg("8GiB"), cpu)
    assert calls == ["pin", "caches"]  # whenever a budget is given, not only under auto
    assert len(notes) == 1 and "--micro-batch-size 4 is predicted to peak at" in notes[0]
    assert "within --memory-budget 8.00 GiB" in notes[0]
    (warning,) = planning.prepare_process(_fixed_cfg("64MiB"), cpu)
    assert warning.startswith("warning:") and "over --memory-budget 64.00 MiB" in warning
    from gradstep.memory import parse_size

    need = parse_size(warning.split("a budget of ")[1].split()[0])
    peak = planning.predict_fixed(_fixed_cfg("64MiB"), cpu, 1)
    assert need * 0.9 >= peak  # the named budget holds the prediction with the margin


def test_the_planners_shape_is_the_model_the_run_builds():
    """``estimate.shape_of`` (the one mapping of a run's flags to the analytic model's
    shape) counts exactly the parameters ``build_model`` makes, for any demo GPT shape."""
    from gradstep_cli.config.settings import TrainConfig
    from gradstep_cli.models.gpt import GPT, GPTConfig
    from gradstep_cli.models.hf import build_model
    from gradstep_cli.plan.estimate import gpt_shape, shape_of

    for layers, heads, width in [(4, 4, 160), (1, 2, 16), (3, 6, 96)]:
        cfg = TrainConfig(n_layer=layers, n_head=heads, d_model=width, seq_len=24)
        shape = shape_of(cfg)
        assert shape.params == build_model(cfg).num_parameters(), (layers, heads, width)
        assert (shape.n_layer, shape.d_model, shape.seq_len) == (layers, width, 24)
        assert shape_of(cfg, width=7).seq_len == 7
    assert gpt_shape(GPTConfig()).params == GPT(GPTConfig()).num_parameters()


@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "lars", "lamb"])
def test_the_planner_estimates_the_runs_optimizer(optimizer):
    """The analytic model counts the state the run's ``--optimizer`` really keeps: one real
    step of ``build_optimizer`` on the run's model, its state tensors counted."""
    from gradstep.memory import estimate_step_memory
    from gradstep_cli.models.hf import build_model
    from gradstep_cli.plan.estimate import estimate_kwargs, shape_of
    from gradstep_cli.train import build_optimizer

    cfg = dataclasses.replace(_fixed_cfg(None), optimizer=optimizer)
    model = build_model(cfg)
    opt = build_optimizer(model, cfg)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    state_bytes = sum(
        t.numel() * t.element_size()
        for p in model.parameters()
        for t in opt.state[p].values()
        if torch.is_tensor(t) and t.shape == p.shape
    )
    kwargs = estimate_kwargs(cfg, torch.device("cpu"), 1)
    est = estimate_step_memory(shape_of(cfg), 1, **kwargs)
    assert est.optimizer == state_bytes > 0
