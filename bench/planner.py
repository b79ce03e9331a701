"""The memory planner's choice against brute force, on configurations nobody tuned it for.

For each held-out configuration (the demo GPT and Hugging Face Llamas of shapes neither the
memory model nor the speed model was fitted on; packed and unpacked rows; sequence lengths
up to 1024; budgets that leave only some micro-batch sizes room) this runs, each a fresh
process of the real command line:

* ``gradstep plan --json``: the plan's choice (micro-batch size, checkpointing and, since
  ``--loss-chunk-tokens`` is not given, the loss chunked or whole), its predicted peak and
  every candidate's, and how long planning took;
* ``gradstep train --micro-batch-size auto``: what the trainer chooses for the same flags
  (it must be the plan's) and the peak of that process (probe included);
* brute force: every micro-batch size of the plan's candidates x activation checkpointing
  off/on x the loss chunked (``--loss-chunk-tokens 1024``) or whole (``0``), each given by
  hand with the same ``--memory-budget`` for ``--steps`` optimizer steps. A plan "fits"
  when the peak resident memory an independent sampler read (``/proc/PID/status`` every
  few ms) is within the budget. Sizes predicted more than ``SKIP_OVER`` over the budget,
  or larger than one of the same kind that measured over it, are not run.

Speed is trained tokens per second of the run's CPU time (one thread: what the run gets on
a core of its own) over the steps after ``WARM`` warm-up steps: the sampler reads the
run's CPU time (``/proc/PID/stat``) whenever ``metrics.jsonl`` gains a line. Wall time on
the shared 2-core machine moved by 2x between runs of the same plan; CPU time moves less
but still with the load on the other core, so the plans within ``CONTENDERS`` of a
configuration's best are run again, after every configuration's first round and in the
other order (interleaved), and each step keeps its fastest run (load only ever slows a
step down; every plan of a configuration trains the same rows step by step).

The ratio is the chosen plan's tokens/s over the best fitting plan's. Also: one refusal,
checked by running ``train --micro-batch-size auto`` at the budget the refusal quoted.

    .venv/bin/python bench/planner.py             # every configuration (~35 min, 2 cores)
    .venv/bin/python bench/planner.py --quick 1   # two configurations, one round (smoke)
    .venv/bin/python bench/planner.py --only G1,H2
    .venv/bin/python bench/planner.py --choices 1  # plan/train's choices vs the recorded
Outputs: a markdown table on stdout and bench/out/planner.{md,json} (quick runs:
bench/out/planner_quick.*). Exit status 1 when a ratio is under 0.95 or train chose
another plan than plan.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from _common import BaseConfig, machine_info, write_outputs
from gradstep.memory import parse_size
from memory_held_out import _launch, _ranks_peak, watched_steps

MiB = 2**20
ROOT = Path(__file__).resolve().parent.parent
CHUNKS = (1024, 0)
"""``--loss-chunk-tokens`` settings brute force tries (1024 is the default)."""
SKIP_OVER = 0.15
"""Sizes predicted more than this fraction over the budget are not run."""
CONTENDERS = 0.12
"""Plans within this fraction of the best first-round tokens/s are run a second time."""
WARM = 2
"""Steps left out of a run's tokens/s (first kernels, optimizer state)."""


@dataclass(frozen=True)
class Case:
    """One held-out configuration: model, data and batch flags, global batch, budget."""

    name: str
    flags: tuple[str, ...]
    global_batch: int
    budget_mib: int
    what: str = ""


def _gpt(layers: int, width: int, heads: int, seq: int, *extra: str) -> tuple[str, ...]:
    shape = ("--n-layer", layers, "--d-model", width, "--n-head", heads, "--seq-len", seq)
    return (*map(str, shape), *extra)


def _hf(folder: str, seq: int, *extra: str) -> tuple[str, ...]:
    """An HF run on the fine-tuning walk's SFT records (prompt/completion JSONL)."""
    return ("--model", f"hf:{{{folder}}}", "--data", "{train_jsonl}",
            "--val-data", "{val_jsonl}", "--seq-len", str(seq), *extra)  # fmt: skip


PACK, BF16 = ("--packing",), ("--precision", "bf16")
CASES = [
    Case("G1", _gpt(3, 192, 4, 512), 8, 450, "GPT fp32 L3 d192 s512, text"),
    Case("G2", _gpt(4, 128, 4, 1024, *PACK, *BF16), 8, 500, "GPT bf16 L4 d128 s1024, packed"),
    Case("G3", _gpt(2, 256, 4, 256, *PACK), 16, 460, "GPT fp32 L2 d256 s256, packed"),
    Case("H1", _hf("walk", 256), 16, 650, "Llama 2.6M (the walk's) s256, SFT"),
    Case("H2", _hf("walk", 256, *PACK), 8, 540, "Llama 2.6M (the walk's) s256, SFT packed"),
    Case("H3", ("--model", "hf:{wide}", "--seq-len", "1024", *PACK), 8, 720,
         "Llama L2 d256 V8192 s1024, text packed"),
    Case("H4", _hf("walk", 256), 8, 500, "Llama 2.6M (the walk's) s256, SFT, tight"),
]  # fmt: skip
QUICK = ("G1", "H2")
REFUSE_MIB = 380
"""The first configuration's budget for the refusal check (below its smallest plan)."""
RUN_FLAGS = ("--warmup", "1", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0",
             "--device", "cpu", "--log-every", "1", "--overwrite")  # fmt: skip


@dataclass(frozen=True)
class Config(BaseConfig):
    only: str = ""
    quick: int = 0
    choices: int = 0
    steps: int = 6
    sample_ms: float = 3.0
    work: str = "runs/planner_bench"
    POSITIVE = ("steps",)
    HELP = {
        "only": "comma-separated case names (G1, G2, H1, ..., H4)",
        "quick": "1: two configurations, one round (a smoke test)",
        "choices": "1: only plan and train auto each configuration with this code, against "
        "the choices bench/out/planner.json recorded (brute force not rerun; ~3 min)",
        "steps": "optimizer steps per brute-force run (the first WARM are left out)",
    }


# ----------------------------------------------------------------------------- assets


def assets(work: Path) -> dict[str, str]:
    """The fine-tuning walk's Llama folder and SFT records (bench/long_run_memory.py's,
    built once), and a wider Llama (2 layers, width 256, vocabulary 8192, positions up to
    1024) sharing its tokenizer, without weights (random initialisation)."""
    import long_run_memory

    cfg = long_run_memory.Config(work=str(work / "walk"))
    paths = long_run_memory.assets(cfg)
    wide = work / "wide"
    if not (wide / "config.json").exists():
        shutil.copytree(paths["base"], wide, ignore=shutil.ignore_patterns("*.safetensors"))
        config = json.loads((wide / "config.json").read_text())
        config.update(hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=64,
                      vocab_size=8192, max_position_embeddings=1024)  # fmt: skip
        (wide / "config.json").write_text(json.dumps(config, indent=2))
    return {"walk": paths["base"], "wide": str(wide), **paths}


def _flags(case: Case, paths: dict) -> list[str]:
    return [f.format(**paths) for f in case.flags]


# ----------------------------------------------------------------------------- runs


def step_cpu(metrics: list[dict], steps: list[list[float]]) -> dict[int, list[float]]:
    """{step: [trained tokens, CPU seconds]} of the steps after the warm-up: a step's CPU
    time is the run's CPU time when its metrics line appeared minus at the line before."""
    at = {int(n): c for n, c, _ in steps}
    return {
        m["step"]: [m["items"], at[m["step"]] - at[m["step"] - 1]]
        for m in metrics
        if m["step"] > WARM and m["step"] in at and m["step"] - 1 in at
    }


def plan(case: Case, paths: dict, budget: str | None = None) -> dict:
    """``gradstep plan --json`` of ``case`` (its budget, or ``budget``)."""
    cmd = [*_launch(SimpleNamespace(ranks=1), "plan"), *_flags(case, paths),
           "--global-batch", str(case.global_batch), "--memory-budget",
           budget or f"{case.budget_mib}MiB", "--device", "cpu", "--json"]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = proc.stdout.strip().splitlines()
    out = json.loads(lines[-1]) if lines else {}
    out["wall_s"] = time.perf_counter() - start
    if proc.returncode != 0 and "error" not in out:
        out["error"] = (proc.stderr.strip().splitlines() or ["?"])[-1]
    return out


def train(case: Case, paths: dict, work: Path, batch: list[str], steps: int, tag: str,
          budget: str | None = None, sample_ms: float = 3.0) -> dict:  # fmt: skip
    """One ``gradstep train`` under the sampler: its peak, steps' CPU times, plan.json."""
    out = work / "runs" / f"{case.name}-{tag}"
    budget = budget or f"{case.budget_mib}MiB"
    cmd = [*_launch(SimpleNamespace(ranks=1), "train"), *_flags(case, paths), *RUN_FLAGS,
           *batch, "--global-batch", str(case.global_batch), "--memory-budget", budget,
           "--max-steps", str(steps), "--out", str(out)]  # fmt: skip
    if out.exists():
        shutil.rmtree(out)
    start = time.perf_counter()
    proc, seen = watched_steps(cmd, out / "metrics.jsonl", sample_ms)
    row: dict = {"tag": tag, "budget": parse_size(budget), "wall_s": time.perf_counter() - start}
    if proc.returncode != 0:
        row["error"] = (proc.stderr.strip().splitlines() or ["?"])[-1][-300:]
        return row
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    row.update(
        peak=_ranks_peak(seen["procs"], 1)[0],
        steps=step_cpu(metrics, seen["steps"]),
        wall_tokens_per_s=statistics.median(m["tokens_per_s"] for m in metrics if m["step"] > WARM),
        oom_splits=sum(m.get("oom_splits", 0) for m in metrics),
        chosen=_key(json.loads((out / "config.json").read_text())),
    )
    if (out / "plan.json").exists():
        row["plan"] = json.loads((out / "plan.json").read_text())
    return row


def _key(d: dict) -> tuple[int, bool, int]:
    """(micro-batch size, checkpointing, loss chunk) of a plan or a run's config."""
    return (int(d["micro_batch_size"]), bool(d["activation_checkpointing"]),
            int(d.get("loss_chunk_tokens") or 0))  # fmt: skip


def _batch_flags(key: tuple[int, bool, int]) -> list[str]:
    mbs, ckpt, chunk = key
    out = ["--micro-batch-size", str(mbs), "--loss-chunk-tokens", str(chunk)]
    return out + (["--activation-checkpointing"] if ckpt else [])


def _name(key: tuple | None) -> str:
    if key is None:
        return "-"
    mbs, ckpt, chunk = key
    return f"{mbs}{' ckpt' if ckpt else ''}{f' chunk{chunk}' if chunk else ' whole'}"


def _tag(key: tuple[int, bool, int], repeat: int) -> str:
    return _name(key).replace(" ", "-") + f"-r{repeat}"


@dataclass
class Brute:
    """A configuration's brute force: every tried plan and its runs."""

    predicted: dict = field(default_factory=dict)
    runs: dict = field(default_factory=dict)
    skipped: dict = field(default_factory=dict)

    def rates(self, budget: int) -> dict[tuple, float]:
        """Tokens per CPU second of every plan whose every run fit ``budget``: each step's
        fastest run, summed over the steps."""
        out = {}
        for key, rows in self.runs.items():
            if any("error" in r or r["peak"] > budget for r in rows):
                continue
            steps = set.intersection(*(set(r["steps"]) for r in rows))
            if not steps:
                continue
            best = {k: min(r["steps"][k][1] for r in rows) for k in steps}
            items = sum(rows[0]["steps"][k][0] for k in steps)
            out[key] = items / sum(best.values()) if sum(best.values()) > 0 else 0.0
        return out


def predictions(planned: dict) -> dict[tuple, int]:
    """Predicted peak of every (mbs, ckpt, chunk) among the plan's candidates."""
    return {
        (c["micro_batch_size"], c["activation_checkpointing"], int(c["loss_chunk_tokens"] or 0)):
        c["predicted_peak_bytes"]
        for c in planned.get("candidates", [])
    }  # fmt: skip


def first_round(case: Case, paths: dict, work: Path, cfg: Config, brute: Brute) -> None:
    """Every plan once, smaller sizes first; prune what cannot fit."""
    budget = case.budget_mib * MiB
    over: set[tuple[bool, int]] = set()
    for key in sorted(brute.predicted, key=lambda k: (k[1], k[2], k[0])):
        mbs, ckpt, chunk = key
        if brute.predicted[key] > budget * (1 + SKIP_OVER):
            brute.skipped[key] = "predicted over"
            continue
        if (ckpt, chunk) in over:
            brute.skipped[key] = "a smaller size measured over"
            continue
        row = train(case, paths, work, _batch_flags(key), cfg.steps, _tag(key, 1), None,
                    cfg.sample_ms)  # fmt: skip
        brute.runs[key] = [row]
        print(f"  {case.name} {_name(key)}: {_line(row, budget)}", file=sys.stderr)
        if "error" not in row and row["peak"] > budget:
            over.add((ckpt, chunk))


def _line(row: dict, budget: int) -> str:
    if "error" in row:
        return f"FAILED {row['error']}"
    fits = "fits" if row["peak"] <= budget else "OVER"
    cpu = sum(c for _, c in row["steps"].values())
    items = sum(i for i, _ in row["steps"].values())
    return f"{row['peak'] / MiB:.1f} MiB ({fits}), {items / max(cpu, 1e-9):.0f} tok/CPU-s"


def again(cases: list, paths: dict, work: Path, cfg: Config, state: dict, within: float,
          repeat: int) -> None:  # fmt: skip
    """The plans within ``within`` of each configuration's best (and its chosen plan) once
    more, configurations and plans in the reverse order."""
    for case in reversed(cases):
        st = state[case.name]
        rates = st["brute"].rates(case.budget_mib * MiB)
        if not rates:
            continue
        best = max(rates.values())
        keys = {k for k, v in rates.items() if v >= best * (1 - within)}
        keys |= {st["chosen"]} & set(rates)
        for key in sorted(keys, reverse=True):
            row = train(case, paths, work, _batch_flags(key), cfg.steps, _tag(key, repeat),
                        None, cfg.sample_ms)  # fmt: skip
            st["brute"].runs[key].append(row)
            print(f"  {case.name} {_name(key)} (run {repeat}): "
                  f"{_line(row, case.budget_mib * MiB)}", file=sys.stderr)  # fmt: skip


def planned(case: Case, paths: dict, work: Path, cfg: Config) -> dict:
    """The plan, then ``train --micro-batch-size auto`` with the same flags."""
    made = plan(case, paths)
    auto = train(case, paths, work, ["--micro-batch-size", "auto"], cfg.steps, "auto", None,
                 cfg.sample_ms)  # fmt: skip
    chosen = _key(made) if "error" not in made else None
    print(f"{case.name}: plan {_name(chosen)} in {made['wall_s']:.1f}s; train auto "
          f"{_name(auto.get('chosen')) if 'error' not in auto else auto['error']}",
          file=sys.stderr)  # fmt: skip
    return {"plan": made, "auto": auto, "chosen": chosen, "brute": Brute(predictions(made))}


def row_of(case: Case, st: dict) -> dict:
    """The table's row of one configuration."""
    budget = case.budget_mib * MiB
    rates = st["brute"].rates(budget)
    best = max(rates, key=rates.get) if rates else None
    made, auto, chosen = st["plan"], st["auto"], st["chosen"]
    row = {
        "config": f"{case.name} {case.what}",
        "budget_mib": case.budget_mib,
        "global_batch": case.global_batch,
        "chosen": _name(chosen) if chosen else made.get("error", "?"),
        "auto_same": auto.get("chosen") == chosen,
        "predicted_mib": made.get("process_peak_bytes", 0) / MiB,
        "measured_mib": auto.get("peak", 0) / MiB,
        "chosen_tokens_s": rates.get(chosen),
        "best": _name(best),
        "best_tokens_s": rates.get(best),
        "best_predicted_mib": st["brute"].predicted.get(best, 0) / MiB,
        "plan_s": made["wall_s"],
        "fitting_plans": len(rates),
        "tried": len(st["brute"].runs),
        "runs": sum(len(v) for v in st["brute"].runs.values()),
    }
    ok = row["chosen_tokens_s"] and row["best_tokens_s"]
    row["ratio"] = row["chosen_tokens_s"] / row["best_tokens_s"] if ok else None
    return row


def refusal(case: Case, paths: dict, work: Path, cfg: Config, low_mib: int) -> dict:
    """``case`` at ``low_mib`` is refused with a minimum; that minimum must run (``train
    --micro-batch-size auto`` at it, under the sampler, within it)."""
    refused = plan(case, paths, f"{low_mib}MiB")
    out: dict = {"config": case.name, "budget_mib": low_mib, "message": refused.get("error", "")}
    text = out["message"]
    marker = next(
        (m for m in ("a budget of at least ", "give --memory-budget ") if m in text), None
    )
    if marker is None:
        out["error"] = "not refused with a budget"
        return out
    out["quoted"] = quoted = text.split(marker, 1)[1].split()[0]
    run = train(case, paths, work, ["--micro-batch-size", "auto"], 3, "refusal", quoted,
                cfg.sample_ms)  # fmt: skip
    out["run"] = {k: v for k, v in run.items() if k not in ("steps", "plan")}
    return out


# ----------------------------------------------------------------------------- report


COLUMNS = ("config", "budget", "chosen (train auto the same?)", "predicted MiB",
           "measured MiB", "chosen tok/s", "best plan (its predicted MiB)", "best tok/s",
           "ratio", "plan s")  # fmt: skip


def table(rows: list[dict]) -> str:
    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|---|---:|---|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        same = "yes" if r["auto_same"] else "**no**"
        lines.append(
            f"| {r['config']} | {r['budget_mib']} MiB | {r['chosen']} ({same}) | "
            f"{r['predicted_mib']:.1f} | {r['measured_mib']:.1f} | "
            f"{num(r['chosen_tokens_s'], '.0f')} | {r['best']} ({r['best_predicted_mib']:.1f}) | "
            f"{num(r['best_tokens_s'], '.0f')} | {num(r['ratio'], '.3f')} | {r['plan_s']:.1f} |"
        )
    return "\n".join(lines)


def margin_text(rows: list[dict]) -> str:
    """Where the best plan brute force found is one the planner may not choose: predicted
    within the 10% margin it keeps free (it fits the budget, not the plan's promise)."""
    out = []
    for r in rows:
        usable = r["budget_mib"] * 0.9
        if r["ratio"] is not None and r["ratio"] < 0.95 and r["best_predicted_mib"] > usable:
            out.append(
                f"{r['config'].split()[0]}: the best plan, {r['best']}, is predicted at "
                f"{r['best_predicted_mib']:.1f} MiB, over the {usable:.1f} MiB the 10% margin "
                "leaves usable: the planner may not choose it.\n"
            )
    return "".join(out) + ("\n" if out else "")


def refusal_text(ref: dict) -> str:
    head = f"refusal check ({ref['config']} at --memory-budget {ref['budget_mib']}MiB)"
    if "error" in ref:
        return f"{head}: {ref['error']}: {ref['message']}"
    run = ref["run"]
    if "error" in run:
        return f"{head}: refused quoting {ref['quoted']}, which FAILED: {run['error']}"
    return (
        f"{head}: refused quoting {ref['quoted']}; `train --micro-batch-size auto "
        f"--memory-budget {ref['quoted']}` chose {_name(run['chosen'])} and peaked at "
        f"{run['peak'] / MiB:.1f} MiB ({'within' if run['peak'] <= run['budget'] else 'OVER'} "
        "the quoted budget)"
    )


def same_choices(cases: list[Case], paths: dict, work: Path, cfg: Config) -> int:
    """``--choices 1``: after a change to the planner, whether ``plan`` and ``train
    --micro-batch-size auto`` still choose what the recorded table measured (its brute force
    needs no rerun then: every plan there was given by hand). 1 when any choice moved."""
    recorded = json.loads((ROOT / "bench" / "out" / "planner.json").read_text())["rows"]
    moved = 0
    for case in cases:
        st = planned(case, paths, work, cfg)
        then = next(r["chosen"] for r in recorded if r["config"].split()[0] == case.name)
        now, auto = _name(st["chosen"]), _name(st["auto"].get("chosen"))
        moved += now != then or auto != then
        print(f"| {case.name} | {then} | {now} | {auto} |")
    print(f"{moved} of {len(cases)} choices moved")
    return 1 if moved else 0


def main() -> int:
    cfg, _ = Config.parse(None, Config.parser("the planner's choice vs brute force"))
    wanted = set(QUICK) if cfg.quick else {w for w in cfg.only.split(",") if w}
    cases = [c for c in CASES if not wanted or c.name in wanted]
    work = ROOT / cfg.work
    started = time.perf_counter()
    paths = assets(work)
    if cfg.choices:
        return same_choices(cases, paths, work, cfg)
    state: dict = {}
    for case in cases:
        state[case.name] = planned(case, paths, work, cfg)
        first_round(case, paths, work, cfg, state[case.name]["brute"])
    if not cfg.quick:
        again(cases, paths, work, cfg, state, CONTENDERS, 2)
    ref = refusal(cases[0], paths, work, cfg, REFUSE_MIB)
    rows = [row_of(c, state[c.name]) for c in cases]
    minutes = (time.perf_counter() - started) / 60
    text = (
        f"{table(rows)}\n\n{margin_text(rows)}{refusal_text(ref)}\n\n"
        f"{len(rows)} configurations in {minutes:.1f} min; machine: {json.dumps(machine_info())}\n"
    )
    result = {
        "machine": machine_info(), "config": cfg.__dict__, "rows": rows, "refusal": ref,
        "minutes": minutes, "cases": {c.name: _dump(state[c.name]) for c in cases},
    }  # fmt: skip
    write_outputs("planner_quick" if cfg.quick else "planner", text, result)
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    good = len(ratios) == len(rows) and min(ratios) >= 0.95 and all(r["auto_same"] for r in rows)
    return 0 if good else 1


def _dump(st: dict) -> dict:
    brute = st["brute"]
    return {
        "chosen": st["chosen"],
        "plan": {k: v for k, v in st["plan"].items() if k != "candidates"},
        "auto": {k: v for k, v in st["auto"].items() if k != "plan"},
        "runs": {_name(k): v for k, v in brute.runs.items()},
        "predicted": {_name(k): v for k, v in brute.predicted.items()},
        "skipped": {_name(k): v for k, v in brute.skipped.items()},
    }


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sys.exit(main())
