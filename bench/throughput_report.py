"""bench/throughput.py's table and goals, from the runs ``throughput_runs.py`` measured."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict
from typing import Any

import throughput_runs as rn
from _common import markdown_table

MiB = 2**20
EXACT = {
    "TRL": "not exact (leaks): padding-free rows told apart by position_ids only, under "
    "sdpa on CPU sequences attend to each other",
}


def rates(run: dict) -> dict[str, float]:
    """Real tokens a CPU second and a wall second of the steps (the first left out),
    padding fraction over every step."""
    counts = run["counts"]
    timed = counts[1:] if len(counts) > 1 else counts
    cpu = run["cpu_s"][1:] if len(run["cpu_s"]) > 1 else run["cpu_s"]
    wall = run["step_s"][1:] if len(run["step_s"]) > 1 else run["step_s"]
    real = sum(c["real"] for c in timed)
    positions = sum(c["positions"] for c in counts)
    return {"real_cpu": real / sum(cpu), "real_wall": real / sum(wall),
            "padding": 1 - sum(c.get("tokens", c["real"]) for c in counts) / positions,
            "real_total": sum(c["real"] for c in counts), "steps": len(run["cpu_s"]),
            "first_step_cpu_s": run["cpu_s"][0]}  # fmt: skip


def row(run: dict, ev: dict | None, flops: dict[str, float], peak: float) -> dict[str, Any]:
    v: rn.Variant = run["variant"]
    base = {"set": v.data, "variant": v.label, "seed": v.seed}
    if "failed" in run:
        return {**base, "failed": run["failed"].strip().splitlines()[-1][:200]}
    r = rates(run)
    exact = EXACT["TRL"] if v.side == "TRL" and v.packed else "exact"
    return {**base, "micro-batch x accum": "{} x {}".format(*run["mbs_accum"]),
            "steps": r["steps"], "real tokens": r["real_total"], "padding": r["padding"],
            "real tok/s (CPU)": r["real_cpu"], "real tok/s (wall)": r["real_wall"],
            "MFU": flops[v.data] * r["real_cpu"] / peak,
            "peak RSS (MiB)": run["peak_rss"] / MiB,
            "tree peak (MiB)": run["tree_peak_rss_no_wandb"] / MiB,
            "val loss": ev["loss"] if ev else None, "first step CPU s": r["first_step_cpu_s"],
            "attention": exact + (", per sequence" if run.get("segment_attention") else ""),
            "compile s (CLI)": run.get("compile_s")}  # fmt: skip


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.mean(vals) if vals else None


def goals(rows: list[dict], floors: dict[str, float]) -> dict[str, Any]:
    """Issue 31's goals, from the rows (means over seeds where there are several);
    ``floors``: each set's least padding in whole rows (its tokens in as few rows as hold
    them: the last row's free end)."""
    ok = [r for r in rows if "failed" not in r]
    pick = lambda data, label: [r for r in ok if r["set"] == data and r["variant"] == label]  # noqa: E731
    packed = [r for r in ok if r["variant"].startswith("gradstep packed")]
    gs, trl = pick("tail", "gradstep packed"), pick("tail", "TRL padded")
    worst = max((r["padding"] for r in packed), default=None)
    each = {f"{r['set']} {r['variant']} seed {r['seed']}": r["padding"] for r in packed}
    out: dict[str, Any] = {
        "padding <= 2% packed": {"holds": None if worst is None else worst <= 0.02,
                                 "worst": worst, "each": each, "floor of whole rows": floors}
    }  # fmt: skip
    if gs and trl:
        ratio = _mean(gs, "real tok/s (CPU)") / _mean(trl, "real tok/s (CPU)")
        mem = (max(r["peak RSS (MiB)"] for r in gs), min(r["peak RSS (MiB)"] for r in trl))
        loss = {s: [r["val loss"] for r in rs] for s, rs in (("gradstep", gs), ("TRL", trl))}
        noise = max(max(v) - min(v) for v in loss.values())
        diff = statistics.mean(loss["gradstep"]) - statistics.mean(loss["TRL"])
        out["tail: >= 2x TRL padded real tok/s"] = {
            "holds": ratio >= 2,
            "ratio": ratio,
            "seeds": [len(gs), len(trl)],
        }
        out["tail: peak RSS <= TRL padded"] = {
            "holds": mem[0] <= mem[1],
            "gradstep max MiB": mem[0],
            "TRL min MiB": mem[1],
        }
        out["tail: val loss within seed noise"] = {
            "holds": abs(diff) <= noise if len(gs) > 1 and len(trl) > 1 else None,
            "gradstep - TRL": diff, "seed noise (largest max - min of a side)": noise,
            "losses": loss}  # fmt: skip
    for data in ("tail", "walk"):
        for comp in pick(data, "gradstep packed compiled"):
            rate = comp["real tok/s (CPU)"]
            base = {label: [r["real tok/s (CPU)"] for r in pick(data, label)
                            if r["seed"] == comp["seed"]]
                    for label in ("gradstep packed", "gradstep packed 4-D mask")}  # fmt: skip
            out[f"{data}: compile (packed)"] = {
                "speed-up vs packed": rate / base["gradstep packed"][0]
                if base["gradstep packed"] else None,
                "speed-up vs packed 4-D mask (the attention --compile runs)":
                    rate / base["gradstep packed 4-D mask"][0]
                    if base["gradstep packed 4-D mask"] else None,
                "compile s (CLI)": comp["compile s (CLI)"],
                "first step CPU s": comp["first step CPU s"]}  # fmt: skip
    return out


TABLE = ("set", "variant", "seed", "micro-batch x accum", "steps", "padding", "real tok/s (CPU)",
         "real tok/s (wall)", "x TRL padded", "MFU", "peak RSS (MiB)", "tree peak (MiB)",
         "val loss", "first step CPU s", "attention")  # fmt: skip


def _ratios(rows: list[dict]) -> None:
    for r in rows:
        ref = [x for x in rows if x["set"] == r["set"] and x["variant"] == "TRL padded"
               and x["seed"] == r["seed"] and "failed" not in x] or \
              [x for x in rows if x["set"] == r["set"] and x["variant"] == "TRL padded"
               and "failed" not in x]  # fmt: skip
        ok = "failed" not in r and ref
        r["x TRL padded"] = r["real tok/s (CPU)"] / ref[0]["real tok/s (CPU)"] if ok else None


def attention_share(lengths: list[int], seq_len: int) -> dict[str, float]:
    """How much of a packed epoch's attention is needed: each sequence alone takes L^2
    query-key pairs (L its positions); a packed row under a 4-D block-causal mask (TRL's
    padded rows carry one too; gradstep's packed rows under --compile) computes all
    seq_len^2 of the row (the mask only hides them), in as few rows as hold the set."""
    positions = [n - 1 for n in lengths]
    rows = math.ceil(sum(positions) / seq_len)
    return {"needed pairs": sum(t * t for t in positions), "computed pairs": rows * seq_len**2,
            "needed share": sum(t * t for t in positions) / (rows * seq_len**2)}  # fmt: skip


def _floor(positions: list[int], seq_len: int) -> float:
    total = sum(positions)
    return 1 - total / (math.ceil(total / seq_len) * seq_len)


def report(cfg: Any, context: dict, runs: list[dict], evals: dict, lengths: dict) -> dict:
    shape = context["shape"]
    peak = max(p["flops"] for p in context["peaks"])
    flops = {k: rn.flops_per_token(shape, v) for k, v in lengths.items()}
    rows = [row(r, evals.get(r["variant"].name), flops, peak) for r in runs]
    _ratios(rows)
    table = [{**{k: r.get(k) for k in TABLE},
              **({"attention": "FAILED: " + r["failed"]} if "failed" in r else {})}
             for r in rows]  # fmt: skip
    floors = {k: _floor([n - 1 for n in v], cfg.seq_len) for k, v in lengths.items()}
    ok = goals(rows, floors)
    pre = context["pretrain"]
    cmds = {r["variant"].label: r["command"] for r in runs if "command" in r}
    text = "\n\n".join([
        "# Throughput: packing, chunked loss, compile (gradstep vs TRL SFTTrainer)",
        f"command: `{context['command']}`; {json.dumps(context['machine'])}; load average "
        f"(1 min) at start / end {context['loadavg']}; versions {json.dumps(context['versions'])}",
        f"model: {json.dumps(shape)}; FLOPs a real token (6N + 12 l h q t): "
        f"{json.dumps({k: round(v) for k, v in flops.items()})}; fp32 matmul peak "
        f"{peak / 1e9:.1f} GFLOP/s ({cfg.threads} thread(s); start / end "
        f"{[round(p['flops'] / 1e9, 1) for p in context['peaks']]})",
        f"records (token lengths): {json.dumps(context['sets'])}",
        f"pretraining: `{pre['command']}` (val {pre.get('initial_val_loss')} -> "
        f"{pre.get('final_val_loss')})",
        "validation loss of the base before fine-tuning: "
        + ", ".join(f"{k[5:]} {v['loss']:.4f}" for k, v in evals.items() if k.startswith("base:")),
        f"one layer's sdpa forward + backward, {cfg.micro_batch} rows of {cfg.seq_len}, CPU s: "
        f"{json.dumps({k: round(v, 4) for k, v in context['sdpa'].items()})}",
        "attention of a packed epoch, each sequence alone vs whole rows under a 4-D mask: "
        + json.dumps(
            {k: attention_share(v, cfg.seq_len) for k, v in lengths.items()}),
        "## Every run", markdown_table(table),
        "## Goals (issue 31 §5)", "```json\n" + json.dumps(ok, indent=1) + "\n```",
        "## Commands", "\n".join(f"- {k}: `{v}`" for k, v in cmds.items()),
    ])  # fmt: skip
    result = {"config": asdict(cfg), **context, "flops_per_token": flops, "peak_flops": peak,
              "rows": rows, "goals": ok, "evaluations": evals,
              "runs": [{**r, "variant": asdict(r["variant"])} for r in runs]}  # fmt: skip
    return {"text": text, "result": json.loads(json.dumps(result, default=str))}
