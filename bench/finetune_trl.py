"""Fine-tuning vs TRL: the fine-tuning walk's job (shared/reviews/finetune-walk-3.md) run by
``gradstep train`` and by TRL's ``SFTTrainer`` on the same recipe (issue 30's acceptance).

1. **Assets** (``finetune_data.py``, nothing downloaded): a byte-level BPE (with a pad token
   of its own and a ChatML template whose assistant turns sit in ``{% generation %}``) and a
   Llama config; SFT records from the stdlib corpus (a function's ``def`` line + docstring
   -> the rest of its body), the training files' for training, the held-out files' for
   validation, written as **Parquet** with fields that are *not* TRL's names: prompt/
   completion records as ``{question, answer, source}``, chat records as ``{dialog: [system,
   user, assistant], source}``. Every record fits ``--seq-len`` in both forms (neither side
   truncates) and tokenizes the same whether its prompt and completion are encoded apart
   (gradstep) or as one text (TRL): both sides train on the same token sequences.
2. **Pretraining**: ``gradstep train --model hf:BASE --init random`` on the default corpus,
   ``gradstep export``: the base both sides fine-tune.
3. **Fine-tuning** on prompt/completion and on chat records, full and LoRA, by
   * ``gradstep train`` through its CLI (the project's venv): ``--epochs``, ``--lr-schedule
     linear --warmup RATIO`` (a TRL recipe's), the Parquet files through ``datasets`` with
     ``--prompt-field/--completion-field`` or ``--messages-field``, whole-set evaluation
     every ``--eval-every`` steps (``val_loss``, ``val_accuracy``), ``--keep-best val_loss``
     (then ``gradstep export --best``), ``--sample-every N --sample-prompts FILE``,
     ``--report-to wandb`` (``WANDB_MODE=offline``); and once with ``--nproc-per-node 2``;
   * TRL's ``SFTTrainer`` (``finetune_trl_worker.py``, run with TRL's own venv's
     interpreter, ``--trl-python``): the same model folder, records, epochs, learning rate,
     linear schedule and warm-up ratio, micro-batch and accumulation, max length, seed,
     evaluation interval, best checkpoint, W&B offline; completion-only loss (TRL's default
     for prompt/completion) and ``assistant_only_loss`` (gradstep's rule for messages).
   Prompt/completion full fine-tuning runs with every seed of ``--seeds`` on both sides: the
   spread is the seed noise the two sides' losses are compared against.
4. **One evaluation** of every exported model (``finetune_data.scored_loss``): float64, each
   validation record alone and unpadded, the target tokens' mean NLL and token accuracy.

Costs: CPU seconds per optimizer step are process CPU time from the start to the end of each
step (gradstep: ``Stepper.step``, timed by a ``sitecustomize`` hook this script writes, so the
command run is the plain CLI, every rank of a ``--nproc-per-node`` run included; TRL:
``on_step_begin`` -> ``on_step_end``), the first step left out; also the whole command's CPU
time (``wait4``'s rusage: the process and its children) per step. Peak RSS: an independent
sampler reads ``/proc`` every ``--sample-ms`` ms, keeping the training process's maximum (the
largest single process) and the whole tree's (the sum at one sample: launcher, ranks, W&B's
service).

Beside the pairs (``--cases``): ``ddp`` (gradstep with ``--nproc-per-node RANKS``),
``trl-ckpt`` / ``trl-defaults`` (TRL with its default gradient checkpointing, and bf16 too)
and ``unpinned`` (gradstep with glibc's mmap threshold left adaptive: the hook skips
``pin_mmap_threshold``, a diagnostic of where gradstep's system CPU goes).

Run: ``nice -n 10 .venv/bin/python bench/finetune_trl.py`` (about 20 minutes on 2 shared
cores) or ``--quick`` (about 5); ``--reuse-pretrained`` keeps an earlier run's base. Also
``python bench/finetune.py --vs-trl [...]``. Writes bench/out/finetune-trl.md and .json.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import finetune_data as fd
from _common import OUT, BaseConfig, machine_info, markdown_table, write_outputs

MiB = 2**20
CASES = (
    "pc-full",
    "pc-lora",
    "chat-full",
    "chat-lora",
    "ddp",
    "trl-ckpt",
    "trl-defaults",
    "unpinned",
)
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Config(BaseConfig):
    hidden: int = 192
    layers: int = 4
    heads: int = 6
    kv_heads: int = 2
    intermediate: int = 512
    vocab: int = 2048
    seq_len: int = 192
    pretrain_steps: int = 80
    pretrain_micro_batch: int = 8
    pretrain_accum: int = 2
    pretrain_lr: float = 3e-3
    train_records: int = 320
    val_records: int = 64
    epochs: float = 2.0
    micro_batch: int = 4
    accum: int = 4
    lr: float = 5e-4
    lora_lr: float = 2e-3
    warmup: float = 0.1
    lora: int = 16
    eval_every: int = 10
    sample_every: int = 20
    sample_tokens: int = 32
    seeds: str = "0,1,2"
    seeded_cases: str = "pc-full"
    cases: str = ",".join(CASES)
    ranks: int = 2
    report_to: str = "wandb"
    threads: int = 1
    sample_ms: float = 20.0
    trl_python: str = "/work/trlvenv/bin/python"
    POSITIVE = ("hidden", "layers", "heads", "vocab", "seq_len", "pretrain_steps",
                "train_records", "val_records", "micro_batch", "accum", "threads", "ranks",
                "eval_every", "sample_every")  # fmt: skip
    HELP = {
        "cases": f"runs, comma-separated, of: {', '.join(CASES)} (ddp: gradstep only, "
        "prompt/completion full, --nproc-per-node RANKS; trl-ckpt: TRL only, prompt/"
        "completion full with TRL's default gradient checkpointing; trl-defaults: the same "
        "with TRL's default bf16 autocast too; unpinned: gradstep only, "
        "prompt/completion full with glibc's mmap threshold left adaptive)",
        "seeded_cases": "the cases run with every seed of --seeds (the others: the first)",
        "seeds": "seeds of the --seeded-cases pairs",
        "warmup": "warm-up as a share of the run (TRL's warmup_ratio; gradstep --warmup)",
        "trl_python": "the interpreter of a venv with trl, datasets, peft (and wandb)",
        "report_to": "wandb (offline) or none, both sides",
    }

    def check(self) -> None:
        bad = set(self.case_list()) - set(CASES)
        if bad:
            raise ValueError(f"--cases takes {', '.join(CASES)}, got {', '.join(sorted(bad))}")
        if not 0 < self.warmup < 1:
            raise ValueError(f"--warmup is a ratio in (0, 1), got {self.warmup}")
        if self.train_records % (self.micro_batch * self.accum):
            raise ValueError("--train-records must be a multiple of --micro-batch x --accum "
                             "(an epoch of whole steps on both sides)")  # fmt: skip
        if self.accum % self.ranks:
            raise ValueError("--accum must be a multiple of --ranks (the same global batch)")

    def case_list(self) -> list[str]:
        return [c.strip() for c in self.cases.split(",") if c.strip()]

    def seed_list(self) -> list[int]:
        return [int(s) for s in self.seeds.split(",") if s.strip()]

    def steps(self) -> int:
        """Optimizer steps of a run: whole epochs of whole steps (train_records divides)."""
        return round(self.epochs * self.train_records / (self.micro_batch * self.accum))


QUICK = dict(pretrain_steps=30, train_records=160, val_records=32, epochs=1.0, eval_every=5,
             sample_every=5, seeds="0,1", cases="pc-full,chat-lora,ddp")  # fmt: skip


# ----------------------------------------------------------------------------- measuring

SAMPLER = r"""
import json, os, sys, time
root, interval = int(sys.argv[1]), float(sys.argv[2]) / 1000
procs, tree_peak, own_peak = {}, 0, 0
tick = os.sysconf("SC_CLK_TCK")

def age(pid):
    with open("/proc/uptime") as f:
        up = float(f.read().split()[0])
    with open(f"/proc/{pid}/stat") as f:
        start = int(f.read().rsplit(")", 1)[1].split()[19])
    return up - start / tick

def tree(pid):
    out = [pid]
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                for child in f.read().split():
                    out += tree(int(child))
    except OSError:
        pass
    return out

while os.path.exists(f"/proc/{root}"):
    total = own = 0
    for pid in tree(root):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f)
            rss = int(fields["VmRSS"].split()[0]) * 1024
            hwm = int(fields["VmHWM"].split()[0]) * 1024
            name = fields["Name"].strip()
        except (OSError, KeyError, ValueError):
            continue
        try:  # a child between fork and exec shares its parent's pages: not in the sums
            young = age(pid) < 0.5
        except (OSError, IndexError, ValueError):
            young = True
        total += 0 if young else rss
        own += 0 if young or name.startswith("wandb") else rss
        old = procs.get(pid, {"rss": 0, "hwm": 0})
        procs[pid] = {"rss": max(old["rss"], rss), "hwm": max(old["hwm"], hwm), "name": name}
    tree_peak, own_peak = max(tree_peak, total), max(own_peak, own)
    time.sleep(interval)
print(json.dumps({"procs": procs, "tree_peak": tree_peak, "own_peak": own_peak}))
"""
"""The independent sampler: a separate interpreter without torch reading ``/proc`` of the
command and all its descendants; each process's maximum RSS (and high-water mark), the
largest sum of the tree's RSS at one sample, and that sum without W&B's service processes
(``wandb-core``, ``wandb-symon``: one per run on both sides, 40-450 MiB as it goes). A sum
leaves out processes younger than 0.5 s: a child between ``fork`` and ``exec`` (W&B's
service, ``git``) shows its parent's resident pages, which it shares."""

STEP_HOOK = r'''
"""Written by bench/finetune_trl.py: with FT_STEP_CPU set, time each gradstep.Stepper.step
(process CPU, the calling thread's CPU, system CPU and wall seconds) and write them at exit
to FT_STEP_CPU-RANK-PID.json. With FT_NO_MMAP_PIN also, the run leaves glibc's mmap
threshold adaptive (gradstep pins it on CPU, gradstep_cli.run.launch.launched)."""
import os

if os.environ.get("FT_STEP_CPU"):
    import atexit
    import json
    import time

    import gradstep

    _cpu, _wall, _thread, _sys = [], [], [], []
    _step = gradstep.Stepper.step

    def _timed(self, *args, **kwargs):
        c, w, t, k = time.process_time(), time.perf_counter(), time.thread_time(), os.times()
        try:
            return _step(self, *args, **kwargs)
        finally:
            _cpu.append(time.process_time() - c)
            _wall.append(time.perf_counter() - w)
            _thread.append(time.thread_time() - t)
            _sys.append(os.times().system - k.system)

    gradstep.Stepper.step = _timed

    if os.environ.get("FT_NO_MMAP_PIN"):  # the diagnostic run: glibc's adaptive threshold
        import gradstep.memory
        import gradstep.memory.process
        import gradstep_cli.run.launch

        def _unpinned(*args, **kwargs):
            return False

        gradstep.memory.pin_mmap_threshold = _unpinned
        gradstep.memory.process.pin_mmap_threshold = _unpinned
        gradstep_cli.run.launch.pin_mmap_threshold = _unpinned

    @atexit.register
    def _write():
        if _cpu:
            rank = os.environ.get("RANK", "0")
            path = f"{os.environ['FT_STEP_CPU']}-{rank}-{os.getpid()}.json"
            with open(path, "w") as f:
                json.dump({"rank": int(rank), "cpu_s": _cpu, "step_s": _wall,
                           "thread_cpu_s": _thread, "sys_s": _sys}, f)
'''


def run_measured(cmd: list[str], log: Path, env: dict[str, str], sample_ms: float) -> dict:
    """Run ``cmd`` (output to ``log``) under the sampler; its CPU time (``wait4``: the
    process and the children it waited for), wall time and peaks. Raises on failure."""
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    sampler = subprocess.Popen([sys.executable, "-c", SAMPLER, str(proc.pid), str(sample_ms)],
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    seen = json.loads(sampler.communicate()[0] or '{"procs": {}, "tree_peak": 0, "own_peak": 0}')
    if proc.returncode != 0:
        tail = log.read_text()[-4000:]
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(cmd)}\n{tail}")
    peaks = [max(p["rss"], p["hwm"]) for p in seen["procs"].values()]
    print(f"  {log.stem}: {wall:.0f}s wall, {usage.ru_utime + usage.ru_stime:.0f}s CPU",
          file=sys.stderr, flush=True)  # fmt: skip
    return {
        "wall_s": wall,
        "cpu_total_s": usage.ru_utime + usage.ru_stime,
        "peak_rss": max(peaks, default=0),
        "tree_peak_rss": seen["tree_peak"],
        "tree_peak_rss_no_wandb": seen["own_peak"],
        "processes": sorted({p["name"] for p in seen["procs"].values()}),
    }


def base_env(cfg: Config, work: Path) -> dict[str, str]:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(cfg.threads),
           "OMP_WAIT_POLICY": "PASSIVE", "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "WANDB_DIR": str(work / "wandb"), "WANDB_PROJECT": "finetune-trl",
           "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(work / "hf-datasets-cache")}  # fmt: skip
    (work / "wandb").mkdir(parents=True, exist_ok=True)
    return env


# ----------------------------------------------------------------------------- data


def moved(pair: fd.Pair) -> fd.Pair:
    """The pair with the prompt ending on its docstring's closing quotes and the newline
    moved to the completion: punctuation then whitespace is always a pre-token boundary, so
    prompt + completion tokenize the same as one text (TRL) and apart (gradstep)."""
    prompt = pair.prompt.rstrip()
    return fd.Pair(pair.where, prompt, pair.prompt[len(prompt) :] + pair.completion)


def prepare(cfg: Config, work: Path) -> dict[str, Any]:
    """The base folder and the record files (Parquet, non-TRL field names), sample prompts."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    train, val, texts = fd.corpus_pairs()
    shape = dict(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.seq_len,
    )  # fmt: skip
    shutil.rmtree(work / "base", ignore_errors=True)
    base = fd.base_folder(work / "base", texts, shape, pad=True)
    tok = AutoTokenizer.from_pretrained(str(base))

    def usable(pairs: list[fd.Pair]) -> list[fd.Pair]:
        out = []
        for p in map(moved, pairs):
            pc, chat = fd.encode_pair(tok, p)[0], fd.encode_chat(tok, fd.messages_of(p))[0]
            if max(len(pc), len(chat)) <= cfg.seq_len and fd.joint_agrees(tok, p):
                out.append(p)
        return out

    train_ok, val_ok = usable(train), usable(val)
    if len(train_ok) < cfg.train_records or len(val_ok) < cfg.val_records:
        raise ValueError(f"only {len(train_ok)} training / {len(val_ok)} validation records "
                         f"fit --seq-len {cfg.seq_len}")  # fmt: skip
    sets = {"train": fd.spread(train_ok, cfg.train_records),
            "val": fd.spread(val_ok, cfg.val_records)}  # fmt: skip
    files: dict[str, Path] = {}
    for split, pairs in sets.items():
        pc = pa.table({"question": [p.prompt for p in pairs],
                       "answer": [p.completion for p in pairs],
                       "source": [p.where for p in pairs]})  # fmt: skip
        chat = pa.table({"dialog": [fd.messages_of(p) for p in pairs],
                         "source": [p.where for p in pairs]})  # fmt: skip
        files[f"pc-{split}"] = work / f"pc_{split}.parquet"
        files[f"chat-{split}"] = work / f"chat_{split}.parquet"
        pq.write_table(pc, files[f"pc-{split}"])
        pq.write_table(chat, files[f"chat-{split}"])
    asked = sets["val"][:2]
    files["pc-prompts"] = work / "pc_prompts.jsonl"
    files["pc-prompts"].write_text("".join(json.dumps({"prompt": p.prompt}) + "\n" for p in asked))
    files["chat-prompts"] = work / "chat_prompts.jsonl"
    files["chat-prompts"].write_text("".join(
        json.dumps({"messages": fd.messages_of(p)[:2]}) + "\n" for p in asked))  # fmt: skip
    encoded = {
        "pc": [fd.encode_pair(tok, p) for p in sets["val"]],
        "chat": [fd.encode_chat(tok, fd.messages_of(p)) for p in sets["val"]],
    }
    counts = {"train_functions": len(train), "train_usable": len(train_ok),
              "val_functions": len(val), "val_usable": len(val_ok),
              "train_records": len(sets["train"]), "val_records": len(sets["val"]),
              "val_targets_pc": sum(sum(m[1:]) for _, m in encoded["pc"]),
              "val_targets_chat": sum(sum(m[1:]) for _, m in encoded["chat"]),
              "mean_tokens_pc": statistics.mean(len(i) for i, _ in encoded["pc"]),
              "mean_tokens_chat": statistics.mean(len(i) for i, _ in encoded["chat"])}  # fmt: skip
    return {"base": base, "files": files, "val": encoded, "counts": counts}


# ----------------------------------------------------------------------------- runs

GRADSTEP = [sys.executable, "-m", "gradstep"]


def pretrain(cfg: Config, work: Path, base: Path, env: dict[str, str]) -> dict:
    """gradstep train --init random on the default corpus, then gradstep export."""
    run, out = work / "pretrain", work / "pretrained"
    cmd = [*GRADSTEP, "train", "--model", f"hf:{base}", "--init", "random",
           "--seq-len", str(cfg.seq_len), "--micro-batch-size", str(cfg.pretrain_micro_batch),
           "--accum-steps", str(cfg.pretrain_accum), "--max-steps", str(cfg.pretrain_steps),
           "--lr", str(cfg.pretrain_lr), "--eval-every", "0", "--eval-batches", "8",
           "--sample-tokens", "0",
           "--save-every", str(cfg.pretrain_steps), "--device", "cpu",
           "--threads", str(cfg.threads), "--out", str(run), "--overwrite"]  # fmt: skip
    info = run_measured(cmd, work / "logs" / "pretrain.log", env, cfg.sample_ms)
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run([*GRADSTEP, "export", str(run), "--out", str(out)], check=True, env=env,
                   capture_output=True)  # fmt: skip
    summary = json.loads((run / "summary.json").read_text())
    keep = ("steps", "initial_val_loss", "final_val_loss", "parameters", "wall_time_s")
    return {"command": _shown(cmd), **info, **{k: summary.get(k) for k in keep}}


def _shown(cmd: list[str]) -> str:
    """A command as a user types it (gradstep for ``python -m gradstep``; paths relative)."""
    words = ["gradstep", *cmd[3:]] if cmd[:3] == GRADSTEP else cmd
    return " ".join(w.replace(str(ROOT) + "/", "") for w in words)


@dataclass(frozen=True)
class Case:
    """One fine-tuning run: records (pc or chat), LoRA or not, seed, ranks (gradstep only)."""

    data: str
    lora: bool
    seed: int
    ranks: int = 1
    checkpointing: bool = False  # TRL only: its default gradient_checkpointing=True
    bf16: bool = False  # TRL only: its default bf16=True (autocast on CPU)
    unpinned: bool = False  # gradstep only: glibc's mmap threshold left adaptive

    @property
    def name(self) -> str:
        parts = [self.data, "lora" if self.lora else "full", f"seed{self.seed}"]
        parts += [f"nproc{self.ranks}"] if self.ranks > 1 else []
        parts += ["ckpt"] if self.checkpointing and not self.bf16 else []
        parts += ["defaults"] if self.checkpointing and self.bf16 else []
        return "-".join(parts + (["unpinned"] if self.unpinned else []))


def gradstep_cmd(cfg: Config, work: Path, model: Path, case: Case, run: Path) -> list[str]:
    files = work / f"{case.data}_%s.parquet"
    fields = (["--prompt-field", "question", "--completion-field", "answer"]
              if case.data == "pc" else ["--messages-field", "dialog"])  # fmt: skip
    lora = (["--lora", str(cfg.lora), "--lora-alpha", str(2 * cfg.lora),
             "--lora-targets", "all-linear"] if case.lora else [])  # fmt: skip
    if case.ranks > 1:
        batch = ["--nproc-per-node", str(case.ranks), "--strategy", "ddp",
                 "--micro-batch-size", str(cfg.micro_batch),
                 "--global-batch", str(cfg.micro_batch * cfg.accum)]  # fmt: skip
    else:
        batch = ["--micro-batch-size", str(cfg.micro_batch), "--accum-steps", str(cfg.accum)]
    return [*GRADSTEP, "train", "--model", f"hf:{model}",
            "--data", str(files).replace("%s", "train"),
            "--val-data", str(files).replace("%s", "val"), *fields, *lora,
            "--seq-len", str(cfg.seq_len), *batch, "--epochs", f"{cfg.epochs:g}",
            "--lr", str(cfg.lora_lr if case.lora else cfg.lr),
            "--lr-schedule", "linear", "--warmup", str(cfg.warmup), "--weight-decay", "0",
            "--clip", "norm:1.0", "--eval-every", str(cfg.eval_every), "--keep-best", "val_loss",
            "--save-every", str(cfg.eval_every), "--keep-checkpoints", "1",
            "--sample-every", str(cfg.sample_every),
            "--sample-prompts", str(work / f"{case.data}_prompts.jsonl"),
            "--sample-tokens", str(cfg.sample_tokens), "--report-to", cfg.report_to,
            "--seed", str(case.seed), "--threads", str(cfg.threads), "--device", "cpu",
            "--log-every", str(cfg.eval_every), "--out", str(run), "--overwrite"]  # fmt: skip


def run_gradstep(cfg: Config, work: Path, model: Path, case: Case, env: dict[str, str]) -> dict:
    """``gradstep train`` (under the sampler, each rank's steps timed), then ``export --best``."""
    run, out = work / f"gradstep-{case.name}", work / f"gradstep-{case.name}-export"
    shutil.rmtree(run, ignore_errors=True)
    hook = work / "hook"
    stamp = work / "stepcpu" / f"gradstep-{case.name}"
    stamp.parent.mkdir(exist_ok=True)
    for old in stamp.parent.glob(stamp.name + "-*.json"):
        old.unlink()
    env = {**env, "PYTHONPATH": os.pathsep.join([str(hook), env.get("PYTHONPATH", "")]),
           "FT_STEP_CPU": str(stamp),
           **({"FT_NO_MMAP_PIN": "1"} if case.unpinned else {})}  # fmt: skip
    cmd = gradstep_cmd(cfg, work, model, case, run)
    info = run_measured(cmd, work / "logs" / f"gradstep-{case.name}.log", env, cfg.sample_ms)
    shutil.rmtree(out, ignore_errors=True)
    export = [*GRADSTEP, "export", str(run), "--best", "--out", str(out),
              *(["--merge-lora"] if case.lora else [])]  # fmt: skip
    proc = subprocess.run(export, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{_shown(export)} failed:\n{proc.stderr[-3000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(stamp.parent.glob(stamp.name + "-*.json"))]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    evals = [s for s in steps if "val_loss" in s]
    best = min(evals, key=lambda s: s["val_loss"])
    config = json.loads((run / "config.json").read_text())
    samples = run / "samples.jsonl"
    wandb_runs = sorted(p.name for p in (work / "wandb" / "wandb").glob("offline-run-*"))
    log = (work / "logs" / f"gradstep-{case.name}.log").read_text()
    return {
        "side": "gradstep", "case": case.name, "command": _shown(cmd), "export": out,
        "export_command": _shown(export), **info,
        # each step's CPU summed over the ranks (a rank's share of the same step)
        **{key: [sum(r[key][i] for r in ranks) for i in range(len(ranks[0][key]))]
           for key in ("cpu_s", "thread_cpu_s", "sys_s")},
        "step_s": ranks[0]["step_s"], "ranks_timed": len(ranks),
        "steps": len(ranks[0]["cpu_s"]), "evals": [
            {k: s.get(k) for k in ("step", "val_loss", "val_accuracy", "val_items", "val_records")}
            for s in evals],
        "lrs": [st["lr"] for st in steps],
        "best_step": best["step"], "own_val_loss": best["val_loss"],
        "own_val_accuracy": best.get("val_accuracy"),
        "settings": {k: config.get(k) for k in ("max_steps", "epochs", "lr", "lr_schedule",
                     "warmup", "min_lr", "adam_betas", "adam_eps", "weight_decay", "clip")},
        "samples": sum(1 for _ in samples.open()) if samples.exists() else 0,
        "wandb_offline_runs": len(wandb_runs),
        "derived_line": next((ln.strip() for ln in log.splitlines() if "epoch" in ln.lower()), ""),
    }  # fmt: skip


def run_trl(cfg: Config, work: Path, model: Path, case: Case, env: dict[str, str]) -> dict:
    """The TRL worker, with TRL's venv's interpreter, under the sampler."""
    out = work / f"trl-{case.name}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    fields = ({"prompt": "question", "completion": "answer"} if case.data == "pc"
              else {"messages": "dialog"})  # fmt: skip
    spec = {"model": str(model), "train": str(work / f"{case.data}_train.parquet"),
            "val": str(work / f"{case.data}_val.parquet"), "format": case.data,
            "fields": fields, "out": str(out), "epochs": cfg.epochs,
            "lr": cfg.lora_lr if case.lora else cfg.lr, "warmup_ratio": cfg.warmup,
            "micro_batch": cfg.micro_batch, "accum": cfg.accum, "max_length": cfg.seq_len,
            "seed": case.seed, "lora": cfg.lora if case.lora else 0, "lora_alpha": 2 * cfg.lora,
            "eval_steps": cfg.eval_every, "logging_steps": cfg.eval_every,
            "report_to": cfg.report_to, "threads": cfg.threads,
            "gradient_checkpointing": case.checkpointing, "bf16": case.bf16}  # fmt: skip
    (out / "spec.json").write_text(json.dumps(spec, indent=1))
    cmd = [cfg.trl_python, str(Path(__file__).with_name("finetune_trl_worker.py")),
           str(out / "spec.json")]  # fmt: skip
    info = run_measured(cmd, work / "logs" / f"trl-{case.name}.log", env, cfg.sample_ms)
    result = json.loads((out / "trl_result.json").read_text())
    evals = [h for h in result["log_history"] if "eval_loss" in h]
    best = min(evals, key=lambda h: h["eval_loss"])
    return {
        "side": "TRL", "case": case.name, "command": _shown(cmd), "spec": spec,
        "export": out / "final", **info, **{k: v for k, v in result.items() if k != "log_history"},
        "evals": [{"step": h["step"], "eval_loss": h["eval_loss"],
                   "eval_accuracy": h.get("eval_mean_token_accuracy")} for h in evals],
        "own_val_loss": result["best_metric"],
        "own_val_accuracy": best.get("eval_mean_token_accuracy"), "best_step": best["step"],
        "lr_log": [{"step": h["step"], "learning_rate": h["learning_rate"]}
                   for h in result["log_history"] if "learning_rate" in h],
    }  # fmt: skip


# ----------------------------------------------------------------------------- report


def per_step(run: dict, key: str = "cpu_s") -> float:
    """CPU seconds per optimizer step, the first step (one-time set-up in it) left out."""
    cpu = run[key][1:] or run[key]
    return sum(cpu) / len(cpu)


def row(run: dict, ev: dict) -> dict:
    return {
        "side": run["side"], "run": run["case"], "steps": run["steps"],
        "best step": run["best_step"], "val loss (fp64 evaluator)": ev["loss"],
        "val accuracy (evaluator)": ev["accuracy"], "own val loss": run["own_val_loss"],
        "own val accuracy": run["own_val_accuracy"],
        "CPU s/step": per_step(run), "of it: stepping thread": per_step(run, "thread_cpu_s"),
        "of it: system": per_step(run, "sys_s"),
        "whole command CPU s/step": run["cpu_total_s"] / run["steps"],
        "peak RSS, trainer (MiB)": run["peak_rss"] / MiB,
        "peak RSS, tree w/o W&B (MiB)": run["tree_peak_rss_no_wandb"] / MiB,
        "peak RSS, tree (MiB)": run["tree_peak_rss"] / MiB,
    }  # fmt: skip


def lr_gap(side: dict[str, list[dict]]) -> float:
    """Largest |gradstep's lr - TRL's| over the steps TRL logged (TRL logs, at step k, the
    learning rate step k ran with; gradstep's metrics.jsonl has every step's)."""
    gaps = [abs(g["lrs"][h["step"] - 1] - h["learning_rate"])
            for g, t in zip(side["gradstep"], side["TRL"], strict=False)
            for h in t["lr_log"]]  # fmt: skip
    return max(gaps, default=float("nan"))


def compare(runs: list[dict], evals: dict[str, dict]) -> list[dict]:
    """One row per case: gradstep vs TRL (means over the seeds run on both sides)."""
    out = []
    cases = dict.fromkeys(
        r["case"].rsplit("-seed", 1)[0] for r in runs if r["side"] == "TRL" and not _diagnostic(r)
    )
    for case in cases:
        side = {s: [r for r in runs if r["side"] == s and r["case"].startswith(case + "-seed")
                    and not _diagnostic(r)]
                for s in ("gradstep", "TRL")}  # fmt: skip
        loss = {s: [evals[_key(r)]["loss"] for r in rs] for s, rs in side.items()}
        cpu = {s: statistics.mean(per_step(r) for r in rs) for s, rs in side.items()}
        sys_ = {s: statistics.mean(per_step(r, "sys_s") for r in rs) for s, rs in side.items()}
        rss = {s: max(r["peak_rss"] for r in rs) for s, rs in side.items()}
        tree = {s: max(r["tree_peak_rss_no_wandb"] for r in rs) for s, rs in side.items()}
        noise = [x for s in loss for x in loss[s]]
        out.append({
            "case": case, "seeds": len(side["gradstep"]),
            "val loss gradstep": statistics.mean(loss["gradstep"]),
            "val loss TRL": statistics.mean(loss["TRL"]),
            "diff (rel)": statistics.mean(loss["gradstep"]) / statistics.mean(loss["TRL"]) - 1,
            "seed spread gradstep": max(loss["gradstep"]) - min(loss["gradstep"]),
            "seed spread TRL": max(loss["TRL"]) - min(loss["TRL"]),
            "seed spread all": max(noise) - min(noise),
            "CPU s/step gradstep": cpu["gradstep"], "CPU s/step TRL": cpu["TRL"],
            "CPU ratio": cpu["gradstep"] / cpu["TRL"],
            "system CPU s/step gradstep": sys_["gradstep"], "system CPU s/step TRL": sys_["TRL"],
            "user CPU ratio": (cpu["gradstep"] - sys_["gradstep"]) / (cpu["TRL"] - sys_["TRL"]),
            "peak RSS gradstep (MiB)": rss["gradstep"] / MiB,
            "peak RSS TRL (MiB)": rss["TRL"] / MiB,
            "tree RSS w/o W&B gradstep (MiB)": tree["gradstep"] / MiB,
            "tree RSS w/o W&B TRL (MiB)": tree["TRL"] / MiB,
            "lr max abs diff at TRL's logged steps": lr_gap(side),
        })  # fmt: skip
    return out


def _diagnostic(run: dict) -> bool:
    """A run beside the pairs: --nproc-per-node, TRL's defaults, gradstep unpinned."""
    return any(t in run["case"] for t in ("nproc", "ckpt", "defaults", "unpinned"))


def _key(run: dict) -> str:
    return f"{run['side']}:{run['case']}"


def report(cfg: Config, context: dict, runs: list[dict], evals: dict[str, dict]) -> dict:
    rows = [row(r, evals[_key(r)]) for r in runs]
    pairs = compare(runs, evals)
    ok = {"val loss within seed noise": all(
              abs(p["val loss gradstep"] - p["val loss TRL"]) <= max(p["seed spread all"], 1e-9)
              for p in pairs),
          "CPU/step <= TRL": all(p["CPU ratio"] <= 1 for p in pairs),
          "peak RSS <= TRL": all(p["peak RSS gradstep (MiB)"] <= p["peak RSS TRL (MiB)"]
                                 for p in pairs)}  # fmt: skip
    base = context["base_eval"]
    checks = [{"run": r["case"], "settings": r["settings"], "samples": r["samples"],
               "evals": len(r["evals"]), "val_items": r["evals"][-1]["val_items"],
               "val_records": r["evals"][-1]["val_records"], "ranks timed": r["ranks_timed"],
               "wandb offline runs so far": r["wandb_offline_runs"]}
              for r in runs if r["side"] == "gradstep"]  # fmt: skip
    first = next((r for r in runs if r["side"] == "gradstep"), None)
    trl_first = next((r for r in runs if r["side"] == "TRL"), None)
    text = "\n\n".join([
        "# Fine-tuning: gradstep vs TRL SFTTrainer",
        f"{json.dumps(context['machine'])}; load average (1 min) at the start "
        f"{context['loadavg_start']:.2f}; versions {json.dumps(context['versions'])}",
        f"records: {json.dumps(context['counts'])}",
        f"pretraining: `{context['pretrain']['command']}`\n\n"
        f"{json.dumps({k: v for k, v in context['pretrain'].items() if k != 'command'})}",
        f"base (pretrained, before SFT): p/c {base['pc']['loss']:.5f}, "
        f"chat {base['chat']['loss']:.5f}",
        f"gradstep: `{first['command']}`\n\nthen `{first['export_command']}`"
        if first
        else "gradstep: (no run)",
        f"TRL: `{trl_first['command']}` with spec {json.dumps(trl_first['spec'])}"
        if trl_first else "TRL: (no run)",
        "## gradstep vs TRL (mean over seeds; spreads are max - min of the evaluator's loss)",
        markdown_table(pairs) if pairs else "(no pairs)",
        f"acceptance: {json.dumps(ok)}",
        "## every run", markdown_table(rows),
        "## gradstep runs: what the flags did", markdown_table(checks) if checks else "(none)",
    ])  # fmt: skip
    result = {"config": asdict(cfg), **context, "pairs": pairs, "rows": rows, "acceptance": ok,
              "evaluations": evals, "runs": runs}  # fmt: skip
    return {"text": text, "result": json.loads(json.dumps(result, default=str))}


def versions(cfg: Config) -> dict[str, str]:
    import torch
    import transformers

    trl = subprocess.run([cfg.trl_python, "-c", "import trl, transformers, torch, datasets, peft; "
                          "print(trl.__version__, transformers.__version__, torch.__version__, "
                          "datasets.__version__, peft.__version__)"],
                         capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    return {"gradstep side": f"torch {torch.__version__}, transformers {transformers.__version__}",
            "TRL side": f"trl {trl[0]}, transformers {trl[1]}, torch {trl[2]}, datasets {trl[3]}, "
                        f"peft {trl[4]}"}  # fmt: skip


def plan(cfg: Config) -> list[tuple[str, Case]]:
    """(side, case) in run order: each gradstep run beside its TRL twin, alternating who
    goes first (a pair shares the machine's load)."""
    cases = cfg.case_list()
    seeds = cfg.seed_list()
    order: list[tuple[str, Case]] = []
    todo = []
    seeded = {c.strip() for c in cfg.seeded_cases.split(",")}
    for name in ("pc-full", "pc-lora", "chat-full", "chat-lora"):
        if name in cases:
            for seed in seeds if name in seeded else seeds[:1]:
                todo.append(Case(name.split("-")[0], name.endswith("lora"), seed))
    for i, case in enumerate(todo):
        sides = ("gradstep", "TRL") if i % 2 == 0 else ("TRL", "gradstep")
        order += [(side, case) for side in sides]
    if "ddp" in cases:
        order.append(("gradstep", Case("pc", False, seeds[0], cfg.ranks)))
    if "trl-ckpt" in cases:
        order.append(("TRL", Case("pc", False, seeds[0], checkpointing=True)))
    if "trl-defaults" in cases:
        order.append(("TRL", Case("pc", False, seeds[0], checkpointing=True, bf16=True)))
    if "unpinned" in cases:
        order.append(("gradstep", Case("pc", False, seeds[0], unpinned=True)))
    return order


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = Config.parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="a short run (about 5 minutes)")
    ap.add_argument("--tag", default="", help="suffix of the output files (finetune-trl-TAG.md)")
    ap.add_argument("--reuse-pretrained", action="store_true",
                    help="keep an earlier run's pretrained model (and records)")  # fmt: skip
    if "--quick" in argv:
        ap.set_defaults(**QUICK)  # flags given still win
    cfg, ns = Config.parse(argv, ap)
    name = "finetune-trl-quick" if ns.quick else "finetune-trl"
    work = OUT / name
    (work / "logs").mkdir(parents=True, exist_ok=True)
    (work / "hook").mkdir(exist_ok=True)
    (work / "hook" / "sitecustomize.py").write_text(STEP_HOOK)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    env = base_env(cfg, work)
    data_json = work / "data.json"
    if ns.reuse_pretrained and data_json.exists() and (work / "pretrained").exists():
        data = json.loads(data_json.read_text())
        pre = data["pretrain"]
    else:
        data = prepare(cfg, work)
        print(f"records: {json.dumps(data['counts'])}", file=sys.stderr, flush=True)
        pre = pretrain(cfg, work, data["base"], env)
        data["pretrain"] = pre
        data_json.write_text(json.dumps(data, default=str))
    model = work / "pretrained"
    runs = []
    for side, case in plan(cfg):
        go = run_gradstep if side == "gradstep" else run_trl
        runs.append(go(cfg, work, model, case, env))
    import torch

    torch.set_num_threads(cfg.threads)
    evals = {}
    base_eval = {k: fd.scored_loss(model, data["val"][k]) for k in ("pc", "chat")}
    for r in runs:
        evals[_key(r)] = fd.scored_loss(Path(r["export"]), data["val"][r["case"].split("-")[0]])
    context = {"machine": machine_info(), "loadavg_start": load_start,
               "date": time.strftime("%Y-%m-%d"), "versions": versions(cfg),
               "counts": data["counts"], "pretrain": pre, "base_eval": base_eval,
               "bench_wall_s": time.perf_counter() - started}  # fmt: skip
    out = report(cfg, context, runs, evals)
    write_outputs(f"{name}-{ns.tag}" if ns.tag else name, out["text"], out["result"])
    print(f"bench wall time {time.perf_counter() - started:.0f}s", file=sys.stderr)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
