"""The all-pairs cover of ``gradstep train``'s flags and the invariants every run must meet.

Used by tests/cli/test_combinations.py; the reasoning behind each invariant (and where the
docs state it) is in that module's docstring.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import combinations, product
from pathlib import Path
from typing import Any

from allpairspy import AllPairs

from gradstep_cli.data.sources import IGNORE_INDEX, TrainBatches, load_corpus
from tests.support.multiproc import free_port

# Every factor of the cover and its values (issue 20 §3), plus --warmup given or not: the
# issue's contract that defaults never refuse a short run. The order is the generator's
# input order, so it fixes the cover (allpairspy is deterministic: no random choices).
FACTORS: OrderedDict[str, list[Any]] = OrderedDict(
    clip=["none", "norm:1.0", "agc", "autoclip", "zclip"],
    optimizer=["adamw", "sgd", "lars", "lamb"],
    precision=["fp32", "bf16", "fp16"],
    strategy=["none", "ddp", "fsdp"],
    batch_ramp=[None, "1:3", "gns"],
    lr_scaling=["none", "linear", "sqrt"],
    accum=[1, 3],
    micro_batch=["fixed", "auto"],
    spike_guard=[False, True],
    gns=[False, True],
    checkpointing=[False, True],
    resume=[False, True],
    warmup=[None, 2],
)
# The factors the refusals below involve: a pair is coverable iff some setting of these
# (the others do not matter to the filter) makes a row the CLI accepts.
CONSTRAINED = ("batch_ramp", "accum", "micro_batch")

TINY = [
    "--device", "cpu", "--n-layer", "1", "--d-model", "32", "--n-head", "2",
    "--seq-len", "32", "--eval-every", "0", "--eval-batches", "2", "--sample-tokens", "0",
]  # fmt: skip
SEQ_LEN = 32
MAX_STEPS = 5
MICRO_BATCH = 2  # rows per micro-batch of the fixed layout
RESUME_AT = 2  # the checkpoint (taken steps) a resumed row continues from
LR = 3e-3  # docs/guide/cli.md: the default --lr
BUDGET = "2GiB"  # far above what the tiny model needs: the plan never has to squeeze
SEED = 0
# metrics.jsonl fields that measure the machine, not the step: a resumed run differs there.
VOLATILE = frozenset(
    {
        "tokens_per_s",
        "step_time_s",
        "elapsed_s",
        "peak_memory_mb",
        "memory_source",
        "processed_tokens_per_s",
        "rss_mb",
    }
    | {"planned_peak_mb"}
)
RUN_TIMEOUT_S = 240


@dataclass(frozen=True)
class Row:
    """One combination of the cover: one value per factor of :data:`FACTORS`."""

    clip: str
    optimizer: str
    precision: str
    strategy: str
    batch_ramp: str | None
    lr_scaling: str
    accum: int
    micro_batch: str
    spike_guard: bool
    gns: bool
    checkpointing: bool
    resume: bool
    warmup: int | None

    @property
    def world(self) -> int:
        return 1 if self.strategy == "none" else 2

    @property
    def global_batch(self) -> int:
        """Sequences per step with ``--micro-batch-size auto``: what the fixed layout of the
        same accumulation takes, so the two layouts train on comparable batches."""
        return MICRO_BATCH * self.accum * self.world

    @property
    def id(self) -> str:
        parts = [self.precision, self.strategy, self.optimizer, f"clip:{self.clip}"]
        parts += ["spike-guard"] * self.spike_guard + [f"ramp:{self.batch_ramp}"] * bool(
            self.batch_ramp
        )
        parts += ["gns"] * self.gns + ["ckpt"] * self.checkpointing + [f"accum:{self.accum}"]
        parts += [f"lr-scaling:{self.lr_scaling}", self.micro_batch]
        parts += ["resume"] * self.resume + [f"warmup:{self.warmup}"] * (self.warmup is not None)
        return "-".join(parts)


def accepted(values: Sequence[Any]) -> bool:
    """allpairspy's filter (called with a prefix of a row): False for the combinations the
    docs say the CLI refuses, so the cover never asks for them.

    - ``--batch-ramp`` with ``--global-batch`` (which ``--micro-batch-size auto`` needs):
      docs/guide/cli.md "A ramp needs --accum-steps (not --global-batch)";
    - ``--batch-ramp gns`` with ``--accum-steps 1``: the gns ramp "starts at ... 2
      micro-batches on one process" and "never above --accum-steps"; the CLI refuses it on
      any number of ranks (asserted by test_combinations' refusal test).
    """
    row = dict(zip(FACTORS, values, strict=False))
    ramp = row.get("batch_ramp")
    if ramp == "gns" and row.get("accum") == 1:
        return False
    return not (ramp is not None and row.get("micro_batch") == "auto")


Pair = tuple[str, Any, str, Any]


def pairs_of(values: Sequence[Any]) -> set[Pair]:
    names = list(FACTORS)
    return {
        (names[i], values[i], names[j], values[j]) for i, j in combinations(range(len(names)), 2)
    }


def coverable_pairs() -> set[Pair]:
    """Every pair of factor values that some accepted row holds."""
    names, firsts = list(FACTORS), [v[0] for v in FACTORS.values()]
    found: set[Pair] = set()
    for i, j in combinations(range(len(names)), 2):
        for a, b in product(FACTORS[names[i]], FACTORS[names[j]]):
            for setting in product(*(FACTORS[c] for c in CONSTRAINED)):
                row = dict(zip(names, firsts, strict=True))
                row.update(zip(CONSTRAINED, setting, strict=True))
                row[names[i]], row[names[j]] = a, b
                if accepted(list(row.values())):
                    found.add((names[i], a, names[j], b))
                    break
    return found


def cover() -> list[Row]:
    """The pairwise cover: allpairspy's rows, then, for a pair its greedy search left out
    (it can stop early under a filter), one more allpairspy row with that pair fixed."""
    rows = [list(r) for r in AllPairs(FACTORS, filter_func=accepted)]
    for missing in sorted(coverable_pairs(), key=repr):
        if any(missing in pairs_of(r) for r in rows):
            continue
        fa, a, fb, b = missing
        pinned = OrderedDict(
            (k, [a] if k == fa else [b] if k == fb else v) for k, v in FACTORS.items()
        )
        rows.append(list(next(iter(AllPairs(pinned, filter_func=accepted)))))
    return [Row(*r) for r in rows]


# ---------------------------------------------------------------- running a row


def write_data(path: Path) -> Path:
    """One small, fixed text file (~5 KB): the last tenth becomes validation."""
    gen = random.Random(SEED)
    words = ["def", "return", "self", "value", "for", "in", "if", "else:", "None", "(x)", "+="]
    lines = [" ".join(gen.choices(words, k=gen.randint(2, 12))) for _ in range(160)]
    path.write_text("\n".join(lines) + "\n")
    return path


def train_argv(row: Row, data: Path, out: Path) -> list[str]:
    """``gradstep train`` flags of ``row`` (without the launcher)."""
    argv = ["train", *TINY, "--data", str(data), "--out", str(out), "--max-steps", str(MAX_STEPS)]
    argv += ["--seed", str(SEED), "--precision", row.precision, "--strategy", row.strategy]
    argv += ["--optimizer", row.optimizer, "--clip", row.clip]
    if row.micro_batch == "auto":
        argv += ["--micro-batch-size", "auto", "--global-batch", str(row.global_batch)]
        argv += ["--memory-budget", BUDGET]
    else:
        argv += ["--micro-batch-size", str(MICRO_BATCH), "--accum-steps", str(row.accum)]
    if row.batch_ramp is not None:
        argv += ["--batch-ramp", row.batch_ramp]
    if row.lr_scaling != "none":  # the default: also run it without the flag
        argv += ["--lr-scaling", row.lr_scaling]
    if row.warmup is not None:
        argv += ["--warmup", str(row.warmup)]
    argv += ["--spike-guard"] * row.spike_guard + ["--gns"] * row.gns
    argv += ["--activation-checkpointing"] * row.checkpointing
    if row.resume:
        argv += ["--save-every", str(RESUME_AT), "--keep-checkpoints", "20"]
    return argv


@dataclass(frozen=True)
class Finished:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str

    def describe(self) -> str:
        return (
            f"command: {' '.join(self.argv)}\nrc {self.returncode}\n"
            f"--- stdout ---\n{self.stdout[-4000:]}\n--- stderr ---\n{self.stderr[-6000:]}"
        )


def launch(argv: list[str], world: int, cwd: Path) -> Finished:
    """Run ``gradstep`` as a user does: ``python -m gradstep`` on one process, ``torchrun
    --nproc_per_node=2 -m gradstep`` for DDP/FSDP2."""
    if world == 1:
        cmd = [sys.executable, "-m", "gradstep", *argv]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}"]
        cmd += [f"--master_port={free_port()}", "-m", "gradstep", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    env["PYTHONUNBUFFERED"] = "1"
    # A session of its own: on a hang, the launcher and every rank it started are killed.
    proc = subprocess.Popen(
        cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n(still running after {RUN_TIMEOUT_S}s: a hang; killed)"
    return Finished(cmd, proc.returncode, out, err)


def read_run(out: Path) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """``metrics.jsonl`` records, ``config.json`` and ``summary.json`` of a run folder."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    config = json.loads((out / "config.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    return records, config, summary


def checkpoint(out: Path, step: int) -> Path:
    """The run's checkpoint folder of ``step`` (named ``step-NNNNNN``, docs/guide/cli.md)."""
    named = ((p, re.fullmatch(r"step-(\d+)", p.name)) for p in (out / "checkpoints").iterdir())
    found = [p for p, m in named if m and int(m[1]) == step]
    assert len(found) == 1, f"no single checkpoint of step {step} in {out}: {found}"
    return found[0]


# ---------------------------------------------------------------- the invariants


def assert_clean(run: Finished) -> None:
    """rc 0 and no traceback (Python's, or a C++ abort) in anything the run printed."""
    assert run.returncode == 0, run.describe()
    for marker in ("Traceback (most recent call last)", "terminate called", "Signal 6"):
        assert marker not in run.stderr + run.stdout, run.describe()


def lr_bound(row: Row, micro_batches: int) -> float:
    """The most a step may use (docs/guide/cli.md): ``--lr``, rescaled with a ramp to the
    step's batch relative to ``--accum-steps``. Without a ramp the batch in use is the full
    one, so every rule's factor is 1."""
    if row.batch_ramp is None or row.lr_scaling == "none":
        return LR
    ratio = micro_batches / row.accum
    return LR * (ratio if row.lr_scaling == "linear" else math.sqrt(ratio))


def assert_lr_bounded(row: Row, records: Iterable[dict[str, Any]]) -> None:
    for r in records:
        bound = lr_bound(row, r["micro_batches"])
        assert r["lr"] is not None and 0 <= r["lr"] <= bound * (1 + 1e-12), (
            f"step {r['step']}: lr {r['lr']} > {bound} (--lr {LR}, --lr-scaling "
            f"{row.lr_scaling}, {r['micro_batches']} of {row.accum} micro-batches)"
        )


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def assert_finite(records: Sequence[dict[str, Any]], summary: dict[str, Any]) -> None:
    """Every taken step has a finite loss, grad norm, post-clip norm and LR; a skipped one
    says why; ``step`` counts the taken steps; the summary's skip count agrees."""
    taken = 0
    for r in records:
        if r["skipped"]:
            assert isinstance(r["skip_reason"], str) and r["skip_reason"], r
        else:
            taken += 1
            for key in ("loss", "grad_norm", "post_clip_norm", "lr"):
                assert _finite(r[key]), f"step {r['step']}: {key} = {r[key]}"
        assert r["step"] == taken, (r["step"], taken)
        if "val_loss" in r:
            assert _finite(r["val_loss"]), r
    assert summary["skipped_steps"] == sum(r["skipped"] for r in records)
    for key in ("initial_val_loss", "final_val_loss", "final_train_loss"):
        assert _finite(summary[key]), (key, summary[key])


def assert_layout(row: Row, records: Sequence[dict[str, Any]], config: dict[str, Any]) -> None:
    """Micro-batches per step (per rank) as the docs define them: ``--accum-steps``; the
    plan's split of the global batch; or the ramp's schedule, within the run's budget of
    ``max_steps × accum_steps`` micro-batches (docs/guide/cli.md)."""
    per_step = [r["micro_batches"] for r in records]
    if row.micro_batch == "auto":
        assert config["global_batch"] == row.global_batch
        rows = row.global_batch // row.world
        assert per_step == [math.ceil(rows / min(config["micro_batch_size"], rows))] * len(records)
        return
    if row.batch_ramp is None:
        assert per_step == [row.accum] * len(records)
        return
    assert all(1 <= m <= row.accum for m in per_step), per_step
    if any(r["skipped"] for r in records):
        return  # what a skipped window counts against the budget is not documented
    budget = MAX_STEPS * row.accum
    assert sum(per_step) == budget, (per_step, budget)
    left = budget
    for t, m in enumerate(per_step):
        assert m == min(_ramp_size(row, t, per_step), left), (t, per_step)
        left -= m


def _ramp_size(row: Row, t: int, per_step: list[int]) -> int:
    """Micro-batches per rank of step ``t`` (0-based) before the budget's cut."""
    assert row.batch_ramp is not None
    if row.batch_ramp == "gns":
        # 2 micro-batches on one process, 1 per rank on several; it doubles only after 10
        # measured steps (GNS_PATIENCE), so not within a few steps.
        return 2 if row.world == 1 else 1
    start, steps = (int(x) for x in row.batch_ramp.split(":"))
    return min(start + (row.accum - start) * t // steps, row.accum)


def stream(data: Path, row: Row, config: dict[str, Any]) -> TrainBatches:
    """The training stream in global order: one process's stream (rank 0 of 1). Rank r of
    W takes items r, r + W, ... of it, so one window's W ranks take consecutive items."""
    rows_per_item = 1 if row.micro_batch == "auto" else MICRO_BATCH
    return TrainBatches(load_corpus(str(data)).train, SEQ_LEN, rows_per_item, seed=config["seed"])


def assert_items(
    data: Path, row: Row, records: Sequence[dict[str, Any]], config: dict[str, Any]
) -> None:
    """``items`` of every step = the target tokens of the stream items its window took:
    ``micro_batches`` per rank (the fixed layout, a ramp) or the global batch's rows."""
    items = stream(data, row, config)
    for r in records:
        take = row.global_batch if row.micro_batch == "auto" else r["micro_batches"] * row.world
        expected = sum(int((next(items)["labels"] != IGNORE_INDEX).sum()) for _ in range(take))
        assert r["items"] == expected, f"step {r['step']}: items {r['items']} != {expected}"


def assert_resumed_equal(
    whole: Sequence[dict[str, Any]], resumed: Sequence[dict[str, Any]]
) -> None:
    """The resumed run's records are the uninterrupted run's after step RESUME_AT, bitwise
    (docs/library/checkpoint.md: the resumed run's metrics.jsonl lines equal the uninterrupted
    run's), apart from the fields that measure the machine."""
    cut = next(i for i, r in enumerate(whole) if r["step"] == RESUME_AT and not r["skipped"])
    expected = [{k: v for k, v in r.items() if k not in VOLATILE} for r in whole[cut + 1 :]]
    got = [{k: v for k, v in r.items() if k not in VOLATILE} for r in resumed]
    assert len(got) == len(expected), (len(got), len(expected))
    for e, g in zip(expected, got, strict=True):
        assert g == e, f"resumed step differs:\n  resumed {g}\n  whole   {e}"
