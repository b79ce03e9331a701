"""Fine-tuning a Hugging Face model from the CLI: gradstep vs transformers.Trainer (issue 21 §7).

1. **Pretrain** a small Llama from scratch with ``gradstep train --model hf:BASE --init
   random`` on the default corpus (stdlib ``.py``), BASE being a config and a BPE tokenizer
   trained here on the corpus' training files; ``gradstep export`` it to a folder.
2. **Supervised fine-tuning** of that folder on prompt/completion pairs from the same
   corpus (a function's signature + docstring -> the rest of its body; pairs of the files
   the pretraining held out validate), twice on the same data, seeds and step budget:
   * ``gradstep train --model hf:PRETRAINED --data train.jsonl --val-data val.jsonl``, then
     ``gradstep export``;
   * ``transformers.Trainer`` on the very micro-batches gradstep trained on, in the same
     order (rebuilt from the run's own data stream), **left-padded** as many Trainer users
     pad a decoder (``tokenizer.padding_side = "left"``, ``pad_token = eos_token``,
     ``DataCollatorForSeq2Seq``), labels TRL-style: the prompt masked, the completion and
     EOS trained; the same AdamW (groups, betas), LR schedule (gradstep's warm-up + cosine
     as a ``LambdaLR``), clip 1.0, micro-batch and accumulation. Variant ``pad-id`` adds
     the ``DataCollatorForLanguageModeling`` rule ``labels[labels == pad_token_id] = -100``,
     which with ``pad_token = eos_token`` also drops every EOS target.
3. **One evaluation** of every exported model (:func:`finetune_data.completion_loss`):
   completion-token cross-entropy, token-weighted, on the held-out pairs, float64, each
   pair alone and unpadded.

Each run is a process of its own (``finetune_workers.py``). Its peak memory is the maximum
resident set size an independent sampler sees (``memory_held_out.watched``). Step times
are gradstep's ``Stepper.step`` and, for the Trainer, ``on_step_begin`` -> ``on_step_end``,
both by wall clock and by process CPU time (on a shared machine the wall time mostly
measures the load, the CPU time the work); a ratio is that of the totals over the same
windows. ``--timing-repeats`` more pairs of shorter runs, in alternating order, show how
much the ratio varies.

Run: ``python bench/finetune.py`` (about 20 minutes on 2 cores) or ``--quick`` (about 5);
``--lora 0`` leaves out the LoRA runs. Writes bench/out/finetune.md and finetune.json.

``python bench/finetune.py --vs-trl [FLAGS]`` runs the other comparison instead
(``finetune_trl.py``, issue 30): ``gradstep train`` through its CLI against TRL's
``SFTTrainer`` on the same recipe (epochs, linear schedule, Parquet records with field
mapping, prompt/completion and chat, full and LoRA), TRL in a venv of its own.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import finetune_data as fd
from _common import OUT, BaseConfig, machine_info, markdown_table, write_outputs
from memory_held_out import watched

MiB = 2**20
VARIANTS = ("trl", "pad-id")


@dataclass(frozen=True)
class Config(BaseConfig):
    hidden: int = 192
    layers: int = 4
    heads: int = 6
    kv_heads: int = 2
    intermediate: int = 512
    vocab: int = 2048
    seq_len: int = 256
    pretrain_steps: int = 120
    pretrain_micro_batch: int = 8
    pretrain_accum: int = 4
    pretrain_lr: float = 3e-3
    sft_steps: int = 80
    micro_batch: int = 4
    accum: int = 4
    lr: float = 1e-3
    warmup: int = 8
    weight_decay: float = 0.0
    val_pairs: int = 200
    lora: int = 16
    variants: str = "trl,pad-id"
    timing_repeats: int = 2
    timing_steps: int = 30
    threads: int = 1
    seed: int = 0
    sample_ms: float = 20.0
    POSITIVE = ("hidden", "layers", "heads", "vocab", "seq_len", "pretrain_steps", "sft_steps",
                "micro_batch", "accum", "val_pairs", "threads")  # fmt: skip
    HELP = {
        "variants": f"Trainer runs, comma-separated, of: {', '.join(VARIANTS)}",
        "lora": "also fine-tune LoRA adapters of this rank (all-linear) on both sides (0: none)",
        "threads": "torch intra-op threads of every run (gradstep --threads, the Trainer's)",
        "timing_repeats": "more gradstep/Trainer run pairs for the step-time ratio only",
    }

    def check(self) -> None:
        for name in ("sft_steps", "timing_steps"):
            if getattr(self, name) < self.warmup:
                raise ValueError(f"--{name.replace('_', '-')} must be >= --warmup {self.warmup}")
        bad = set(self.trainer_variants()) - set(VARIANTS)
        if bad:
            raise ValueError(f"--variants takes {', '.join(VARIANTS)}, got {', '.join(bad)}")

    def trainer_variants(self) -> list[str]:
        return [v.strip() for v in self.variants.split(",") if v.strip()]


QUICK = dict(pretrain_steps=30, pretrain_accum=2, sft_steps=24, val_pairs=64, variants="trl",
             lora=0, timing_repeats=0)  # fmt: skip
CLI = [sys.executable, "-m", "gradstep"]
WORKERS = str(Path(__file__).with_name("finetune_workers.py"))


def _timed_cli(run: Path) -> list[str]:
    """``gradstep train`` through ``finetune_workers.py gradstep``: the CLI's own entry
    point (``gradstep_cli.cli.main``), with each ``Stepper.step`` also timed in CPU seconds."""
    return [sys.executable, WORKERS, "gradstep", str(_cpu_file(run))]


def _cpu_file(run: Path) -> Path:
    return run.with_name(run.name + "-step-cpu.json")


def _run(cmd: list[str], what: str, sample_ms: float | None = None) -> tuple[str, dict]:
    """Run ``cmd`` (under the RSS sampler when ``sample_ms``); stderr, and the peak."""
    start = time.perf_counter()
    if sample_ms is None:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        seen: dict = {}
    else:
        proc, seen = watched(cmd, sample_ms)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    peak = max((max(v["rss"], v["hwm"]) for v in seen.values()), default=0)
    print(f"{what}: {time.perf_counter() - start:.0f}s", file=sys.stderr, flush=True)
    return proc.stderr, {"peak_rss": peak, "wall_s": time.perf_counter() - start}


# ----------------------------------------------------------------------------- stages


def _common_flags(cfg: Config) -> list[str]:
    return ["--seq-len", str(cfg.seq_len), "--device", "cpu", "--threads", str(cfg.threads),
            "--seed", str(cfg.seed), "--sample-tokens", "0", "--eval-every", "0",
            "--overwrite"]  # fmt: skip


def pretrain(cfg: Config, work: Path, base: Path) -> tuple[Path, dict]:
    """gradstep train --init random on the default corpus, then gradstep export."""
    run = work / "pretrain"
    cmd = [*CLI, "train", "--model", f"hf:{base}", "--init", "random", *_common_flags(cfg),
           "--micro-batch-size", str(cfg.pretrain_micro_batch),
           "--accum-steps", str(cfg.pretrain_accum), "--max-steps", str(cfg.pretrain_steps),
           "--lr", str(cfg.pretrain_lr), "--eval-batches", "20", "--log-every", "10",
           "--save-every", str(cfg.pretrain_steps), "--out", str(run)]  # fmt: skip
    _, info = _run(cmd, "pretraining")
    del info["peak_rss"]  # not sampled
    out = work / "pretrained"
    shutil.rmtree(out, ignore_errors=True)
    _run([*CLI, "export", str(run), "--out", str(out)], "export (pretrained)")
    summary = json.loads((run / "summary.json").read_text())
    return out, {"command": " ".join(cmd[1:]), **info, **_summary(summary)}


def _summary(s: dict) -> dict:
    keep = ("steps", "initial_val_loss", "final_val_loss", "train_tokens", "parameters",
            "trainable_parameters", "wall_time_s", "corpus")  # fmt: skip
    return {k: s[k] for k in keep if k in s}


def _sft_cmd(cfg: Config, model: Path, data: dict, run: Path, lora: int, steps: int) -> list:
    """``gradstep train`` on the pairs; a timing run (not the run evaluated) skips the
    evaluation of every validation pair and the checkpoint."""
    timing = run.name.startswith("timing")
    evals = 1 if timing else math.ceil(len(data["val"]) / cfg.micro_batch)  # every val pair
    lora_flags = ["--lora", str(lora), "--lora-targets", "all-linear"] if lora else []
    return [*_timed_cli(run), "--model", f"hf:{model}", "--data", str(data["train_jsonl"]),
            "--val-data", str(data["val_jsonl"]), *_common_flags(cfg), *lora_flags,
            "--micro-batch-size", str(cfg.micro_batch), "--accum-steps", str(cfg.accum),
            "--max-steps", str(steps), "--lr", str(cfg.lr), "--warmup", str(cfg.warmup),
            "--weight-decay", str(cfg.weight_decay), "--eval-batches", str(evals),
            "--save-every", str(0 if timing else steps), "--log-every", "10",
            "--out", str(run)]  # fmt: skip


def sft_gradstep(cfg: Config, work: Path, model: Path, data: dict, lora: int) -> dict:
    """gradstep train on the pairs (under the sampler), then export (merged for LoRA)."""
    name = f"sft-gradstep{'-lora' if lora else ''}"
    run, out = work / name, work / f"{name}-export"
    cmd = _sft_cmd(cfg, model, data, run, lora, cfg.sft_steps)
    stderr, info = _run(cmd, name, cfg.sample_ms)
    shutil.rmtree(out, ignore_errors=True)
    _run([*CLI, "export", str(run), "--out", str(out), *(["--merge-lora"] if lora else [])],
         f"export ({name})")  # fmt: skip
    summary = json.loads((run / "summary.json").read_text())
    return {
        "name": f"gradstep{' LoRA' if lora else ''}",
        "command": " ".join(["gradstep", "train", *cmd[len(_timed_cli(run)) :]]),
        "run": run,
        "export": out,
        **_metrics(run),
        "data_line": next((ln for ln in stderr.splitlines() if ln.startswith("data:")), ""),
        "own_val_loss": summary["final_val_loss"],
        **info,
        **_summary(summary),
    }


def _metrics(run: Path) -> dict[str, list]:
    steps = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    keys = {"step_s": "step_time_s", "loss": "loss", "grad_norm": "grad_norm", "items": "items"}
    out = {ours: [s[theirs] for s in steps] for ours, theirs in keys.items()}
    return {**out, "cpu_s": json.loads(_cpu_file(run).read_text())}


def sft_trainer(
    cfg: Config, work: Path, gradstep_run: Path, variant: str, lora: int, steps: int = 0
) -> dict:
    """The Trainer worker (``finetune_workers.py trainer``) under the sampler, on what
    ``gradstep_run`` trained on (its first ``steps`` windows, 0: all)."""
    tag = f"{variant}{'-lora' if lora else ''}{f'-timing{steps}' if steps else ''}"
    out = work / f"sft-trainer-{tag}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, WORKERS, "trainer", str(gradstep_run), str(out), variant, str(steps)]
    _, info = _run(cmd, f"Trainer ({tag})", cfg.sample_ms)
    result = json.loads((out / "trainer_result.json").read_text())
    name = f"Trainer, left-padded, {variant}{' LoRA' if lora else ''}"
    return {"name": name, "export": out, **result, **info}


def _median(times: list[float]) -> float:
    """Median step time, the first step (one-time set-up inside it) left out."""
    return statistics.median(times[1:] or times)


def _total(times: list[float]) -> float:
    return sum(times[1:] or times)


def time_ratios(ours: dict, theirs: dict) -> dict[str, float]:
    """gradstep / Trainer step time, by process CPU time and by wall clock: the ratio of
    the totals over the same windows (both sides train the same ones, in the same order),
    the first step (one-time set-up inside it) left out."""
    return {
        "cpu": _total(ours["cpu_s"]) / _total(theirs["cpu_s"]),
        "wall": _total(ours["step_s"]) / _total(theirs["step_s"]),
    }


def timing_pairs(cfg: Config, work: Path, model: Path, data: dict, mains: dict) -> list[dict]:
    """More gradstep / Trainer (trl) run pairs of ``timing_steps`` steps, full fine-tuning
    and LoRA (``mains``: LoRA rank -> the main gradstep run), in alternating order: on a
    shared machine one pair of runs is one sample of the load. Their step-time ratios."""
    ratios = []
    for i, (lora, main) in itertools.product(range(cfg.timing_repeats), mains.items()):
        run = work / f"timing-gradstep{'-lora' if lora else ''}-{i}"
        cmd = _sft_cmd(cfg, model, data, run, lora, cfg.timing_steps)
        gradstep_first = i % 2 == 1  # the main pair ran gradstep first
        if not gradstep_first:
            theirs = sft_trainer(cfg, work, main, "trl", lora, cfg.timing_steps)
        _run(cmd, run.name, cfg.sample_ms)
        if gradstep_first:
            theirs = sft_trainer(cfg, work, main, "trl", lora, cfg.timing_steps)
        ratios.append({"run": "LoRA" if lora else "full", "pair": i + 1,
                       "order": "gradstep first" if gradstep_first else "Trainer first",
                       **time_ratios(_metrics(run), theirs)})  # fmt: skip
    return ratios


# ----------------------------------------------------------------------------- report


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _row(
    run: dict, evaluation: dict, ref: dict | None = None, ref_eval: dict | None = None
) -> dict:
    """One table row: the evaluation, the timing and memory, agreement with gradstep."""
    row = {
        "run": run["name"],
        "val completion loss": evaluation["loss"],
        "val EOS loss": evaluation["eos_loss"],
        "median step wall (ms)": 1e3 * _median(run["step_s"]),
        "median step CPU (ms)": 1e3 * _median(run["cpu_s"]),
        "peak RSS (MiB)": run["peak_rss"] / MiB,
        "steps": len(run["step_s"]),
    }
    if ref is not None and ref_eval is not None:
        row["val loss vs gradstep (rel)"] = _rel(evaluation["loss"], ref_eval["loss"])
        row["step-1 loss vs gradstep"] = _rel(run["loss"][0], ref["loss"][0])
        row["step-1 grad norm vs gradstep"] = _rel(run["grad_norm"][0], ref["grad_norm"][0])
    return row


def _tables(runs: list[list[dict]], evals: dict) -> tuple[list[dict], list[dict]]:
    """(one row per run, one ratio row per Trainer run against its gradstep run)."""
    base_eval = evals["pretrained"]
    rows = [{"run": "pretrained (before SFT)", "val completion loss": base_eval["loss"],
             "val EOS loss": base_eval["eos_loss"]}]  # fmt: skip
    ratios = []
    for ref, *theirs in runs:
        rows.append(_row(ref, evals[ref["name"]]))
        for run in theirs:
            rows.append(_row(run, evals[run["name"]], ref, evals[ref["name"]]))
            times = time_ratios(ref, run)
            ratios.append({
                "gradstep run": ref["name"], "Trainer run": run["name"],
                "step time gradstep/Trainer, CPU": times["cpu"],
                "step time gradstep/Trainer, wall": times["wall"],
                "peak RSS gradstep/Trainer": ref["peak_rss"] / run["peak_rss"],
            })  # fmt: skip
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return [{k: r.get(k) for k in keys} for r in rows], ratios


def report(cfg: Config, context: dict, runs: list[list[dict]], evals: dict) -> dict:
    """The JSON result and its markdown text. ``context``: machine, loads, pretraining,
    pairs and the timing repeats."""
    rows, ratios = _tables(runs, evals)
    own = {r["name"]: (r["own_val_loss"], evals[r["name"]]["loss"]) for r, *_ in runs}
    timing = context["timing"]
    result = {"config": asdict(cfg), **context, "rows": rows, "ratios": ratios,
              "gradstep_own_val_vs_eval": own, "evaluations": evals,
              "runs": [{k: v for k, v in r.items() if k not in ("run", "export")}
                       for g in runs for r in g]}  # fmt: skip
    pre = {k: v for k, v in context["pretrain"].items() if k != "command"}
    text = "\n\n".join([
        "# Fine-tuning: gradstep vs transformers.Trainer",
        f"{json.dumps(context['machine'])}; load average (1 min) at the start "
        f"{context['loadavg_start']:.2f}, at the end {context['machine']['loadavg_1m']:.2f}",
        f"pretraining: `{context['pretrain']['command']}`\n\n{json.dumps(pre)}",
        f"pairs: {json.dumps(context['pairs'])}",
        f"gradstep SFT: `{runs[0][0]['command']}`\n\n{runs[0][0]['data_line']}",
        markdown_table(rows), markdown_table(ratios),
        f"gradstep's own final val_loss vs this evaluation: {json.dumps(own)}",
        f"Step time gradstep/Trainer (trl), more pairs of {cfg.timing_steps}-step runs "
        "(ratios of total step times, CPU and wall)",
        markdown_table(timing) if timing else "(none)",
    ])  # fmt: skip
    return {"text": text, "result": json.loads(json.dumps(result, default=str))}


def _sft_runs(cfg: Config, work: Path, pretrained: Path, data: dict) -> list[list[dict]]:
    """[gradstep run, its Trainer runs] for full fine-tuning, then for LoRA (one variant)."""
    runs = []
    for lora in [0] + ([cfg.lora] if cfg.lora else []):
        ours = sft_gradstep(cfg, work, pretrained, data, lora)
        variants = cfg.trainer_variants()[:1] if lora else cfg.trainer_variants()
        runs.append([ours] + [sft_trainer(cfg, work, ours["run"], v, lora) for v in variants])
    return runs


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--vs-trl"]:
        import finetune_trl

        finetune_trl.main(argv[1:])
        return
    ap = Config.parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="a short run (about 5 minutes)")
    ap.add_argument(
        "--reuse-pretrained", action="store_true", help="keep an earlier run's pretrained model"
    )
    if "--quick" in argv:
        ap.set_defaults(**QUICK)  # flags given still win
    cfg, ns = Config.parse(argv, ap)
    name = "finetune-quick" if ns.quick else "finetune"
    work = OUT / name
    work.mkdir(parents=True, exist_ok=True)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars of every evaluation
    load_start = os.getloadavg()[0]
    data = fd.prepare(cfg, work)
    pretrained, pre_json = work / "pretrained", work / "pretrain.json"
    if not (ns.reuse_pretrained and pre_json.exists()):
        pretrained, pre = pretrain(cfg, work, data["base"])
        pre_json.write_text(json.dumps(pre, default=str))
    runs = _sft_runs(cfg, work, pretrained, data)
    mains = {0: runs[0][0]["run"], **({cfg.lora: runs[1][0]["run"]} if cfg.lora else {})}
    timing = timing_pairs(cfg, work, pretrained, data, mains)
    torch.set_num_threads(cfg.threads)
    start = time.perf_counter()
    evals = {"pretrained": fd.completion_loss(pretrained, data["val"])}
    for run in itertools.chain.from_iterable(runs):
        evals[run["name"]] = fd.completion_loss(run["export"], data["val"])
    print(f"evaluations: {time.perf_counter() - start:.0f}s", file=sys.stderr)
    context = {"machine": machine_info(), "loadavg_start": load_start,
               "date": time.strftime("%Y-%m-%d"), "pretrain": json.loads(pre_json.read_text()),
               "pairs": data["pairs"], "timing": timing}  # fmt: skip
    out = report(cfg, context, runs, evals)
    write_outputs(name, out["text"], out["result"])


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
