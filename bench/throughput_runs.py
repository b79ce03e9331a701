"""bench/throughput.py's runs: one variant of gradstep (its CLI) or of TRL (its worker), timed
and counted the same way on both sides, and the numbers MFU needs.

* **Steps** are timed as ``finetune_trl`` times them: gradstep's ``Stepper.step`` by its
  ``sitecustomize`` hook (process CPU and wall, the command is the plain CLI), TRL's from
  ``on_step_begin`` to ``on_step_end`` (``finetune_trl_worker``). The first step (set-up,
  ``--compile``'s compilation) is left out of the rates.
* **Tokens** are counted outside the timed steps, from the batches each side trains on: a
  sequence of n tokens is n - 1 real tokens (the positions that predict one of its tokens,
  what gradstep feeds; TRL feeds the last token too, not counted), positions are every
  element of ``input_ids`` (padding included); the padding fraction is the share of
  positions holding no token of a sequence. gradstep: a second wrapper of
  ``Stepper.step`` (per row, the last target's position + 1: every record ends with its
  EOS target; packed rows are padded at their end only); TRL: the worker's collator
  wrapper (``attention_mask``, or the padding-free row's ``position_ids``).
* **Peak RSS**: ``finetune_trl.run_measured``'s independent ``/proc`` sampler, the training
  process's maximum.
* **MFU** (torchtitan's ``get_num_flop_per_token``): ``6 N + 12 l h q t`` FLOPs a token, N
  the parameters without the input embedding (the untied output head counted), l layers,
  h heads, q head size, t the length of the token's own sequence (each record alone, the
  work a sequence needs whatever the batching; torchtitan's t is its fixed row length, and
  it does not halve for causality either), over the fp32 matmul peak measured in the same
  run (:func:`matmul_peak`, same thread count, process CPU time).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import finetune_trl as ft

COUNT_HOOK = r"""
if os.environ.get("FT_STEP_CPU"):
    _counts = []
    _timed_step = gradstep.Stepper.step

    def _row_real(labels):
        import torch

        has = labels != -100
        idx = torch.arange(labels.shape[1]).expand_as(labels)
        return int((torch.where(has, idx, -1).max(dim=1).values + 1).sum())

    def _counted(self, micro_batches, *args, **kwargs):
        micro_batches = list(micro_batches)
        pos = real = rows = 0
        for mb in micro_batches:
            labels = mb["labels"] if "labels" in mb else mb["shift_labels"]
            pos += mb["input_ids"].numel()
            rows += mb["input_ids"].shape[0]
            real += _row_real(labels)
        _counts.append({"positions": pos, "real": real, "rows": rows})
        return _timed_step(self, micro_batches, *args, **kwargs)

    gradstep.Stepper.step = _counted
    import gradstep.packing

    _segments = []
    _use_segments = gradstep.packing.use_segments

    def _segments_or_not(model):  # TP_NO_SEGMENTS: packed rows keep sdpa's 4-D mask
        used = False if os.environ.get("TP_NO_SEGMENTS") else _use_segments(model)
        _segments.append(used)
        return used

    gradstep.packing.use_segments = _segments_or_not

    @atexit.register
    def _write_counts():
        if _counts:
            path = f"{os.environ['FT_STEP_CPU']}-{os.environ.get('RANK', '0')}-{os.getpid()}"
            with open(path + ".tokens", "w") as f:
                json.dump({"steps": _counts, "segments": _segments}, f)
"""
HOOK = ft.STEP_HOOK + COUNT_HOOK
NOTED = ("packing", "compil", "epoch")  # the log's lines a run's record keeps


@dataclass(frozen=True)
class Variant:
    """One run: side, record set, packed or not, loss chunking (None: the CLI's default),
    --compile, seed; ``trl_packing``: TRL's packing strategy (None: padded batches);
    ``masked``: a diagnostic, gradstep's packed rows through sdpa's 4-D block-causal mask
    (segment attention switched off by the hook: what ``--compile`` runs)."""

    side: str
    data: str
    packed: bool = False
    chunk: int | None = None
    compiled: bool = False
    seed: int = 0
    trl_packing: str | None = None
    masked: bool = False  # gradstep packed only: segment attention off (sdpa's 4-D mask)

    @property
    def label(self) -> str:
        if self.side == "TRL":
            return f"TRL packing={self.trl_packing} (padding-free)" if self.packed else "TRL padded"
        words = ["gradstep", "packed" if self.packed else "padded"]
        words += ["4-D mask"] if self.masked else []
        words += ["compiled"] if self.compiled else []
        words += (
            [f"loss-chunk {self.chunk}" if self.chunk else "unchunked"]
            if self.chunk is not None
            else []
        )
        return " ".join(words)

    @property
    def name(self) -> str:
        return f"{self.data}-{self.label.replace(' ', '_').replace('=', '-')}-seed{self.seed}"


def gradstep_cmd(cfg: Any, files: dict, model: Path, v: Variant, run: Path) -> list[str]:
    mbs, accum = layout(cfg, files, v)
    flags = (["--packing"] if v.packed else []) + (["--compile"] if v.compiled else [])
    flags += ["--loss-chunk-tokens", str(v.chunk)] if v.chunk is not None else []
    return [*ft.GRADSTEP, "train", "--model", f"hf:{model}", "--data", files["train"],
            "--val-data", files["val"], "--prompt-field", "question", "--completion-field",
            "answer", "--seq-len", str(cfg.seq_len), *flags, "--micro-batch-size", str(mbs),
            "--accum-steps", str(accum), "--epochs", f"{epochs(cfg, v):g}", "--lr", str(cfg.lr),
            "--lr-schedule", "linear", "--warmup", str(cfg.warmup), "--weight-decay", "0",
            "--clip", "norm:1.0", "--eval-every", "0", "--save-every", "1000000",
            "--sample-tokens", "0", "--report-to", "none", "--seed", str(v.seed),
            "--threads", str(cfg.threads), "--device", "cpu", "--log-every", "5",
            "--out", str(run), "--overwrite"]  # fmt: skip


def epochs(cfg: Any, v: Variant) -> float:
    return cfg.walk_epochs if v.data == "walk" else cfg.epochs


def layout(cfg: Any, files: dict, v: Variant) -> tuple[int, int]:
    """(micro-batch, accumulation): records as the walk's 4 x 4 unpacked; packed, rows of
    --seq-len one at a time, as many a step as hold about the unpacked step's tokens."""
    if not v.packed:
        return cfg.micro_batch, cfg.accum
    records = cfg.micro_batch * cfg.accum * files["train_stats"]["mean"]
    return 1, max(1, round(records / cfg.seq_len))


def run_gradstep(cfg: Any, work: Path, model: Path, files: dict, v: Variant, env: dict) -> dict:
    """``gradstep train`` under the sampler, its steps timed and counted, then ``export``."""
    run, out = work / f"gs-{v.name}", work / f"gs-{v.name}-export"
    shutil.rmtree(run, ignore_errors=True)
    stamp = work / "stepcpu" / v.name
    stamp.parent.mkdir(exist_ok=True)
    for old in stamp.parent.glob(stamp.name + "-*"):
        old.unlink()
    inductor = work / "inductor" / v.name  # a cold compile: no earlier run's cache
    shutil.rmtree(inductor, ignore_errors=True)
    env = {**env, "PYTHONPATH": os.pathsep.join([str(work / "hook"), env.get("PYTHONPATH", "")]),
           "FT_STEP_CPU": str(stamp), "TORCHINDUCTOR_CACHE_DIR": str(inductor),
           **({"TP_NO_SEGMENTS": "1"} if v.masked else {})}  # fmt: skip
    cmd = gradstep_cmd(cfg, files, model, v, run)
    info = ft.run_measured(cmd, work / "logs" / f"gs-{v.name}.log", env, cfg.sample_ms)
    shutil.rmtree(out, ignore_errors=True)
    export = [*ft.GRADSTEP, "export", str(run), "--out", str(out)]
    proc = subprocess.run(export, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{ft._shown(export)} failed:\n{proc.stderr[-3000:]}")
    (timed,) = [json.loads(p.read_text()) for p in stamp.parent.glob(stamp.name + "-*.json")]
    (seen,) = [json.loads(p.read_text()) for p in stamp.parent.glob(stamp.name + "-*.tokens")]
    log = (work / "logs" / f"gs-{v.name}.log").read_text()
    summary = json.loads((run / "summary.json").read_text())
    return {"variant": v, "command": ft._shown(cmd), "export": str(out), **info,
            "cpu_s": timed["cpu_s"], "step_s": timed["step_s"], "counts": seen["steps"],
            "segment_attention": any(seen["segments"]),
            "mbs_accum": layout(cfg, files, v), "own_val_loss": summary.get("final_val_loss"),
            "compile_s": summary.get("compile_seconds"),
            "notes": [ln.strip() for ln in log.splitlines()
                      if any(w in ln.lower() for w in NOTED)][:8]}  # fmt: skip


def run_trl(cfg: Any, work: Path, model: Path, files: dict, v: Variant, env: dict) -> dict:
    """The TRL worker (its venv), no evaluation during training, batches counted."""
    out = work / f"trl-{v.name}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    mbs, accum = layout(cfg, files, v)
    spec = {"model": str(model), "train": files["train"], "val": files["val"], "format": "pc",
            "fields": {"prompt": "question", "completion": "answer"}, "out": str(out),
            "epochs": epochs(cfg, v), "lr": cfg.lr, "warmup_ratio": cfg.warmup, "micro_batch": mbs,
            "accum": accum, "max_length": cfg.seq_len, "seed": v.seed, "lora": 0,
            "lora_alpha": 0, "eval_steps": 0, "logging_steps": 5, "report_to": "none",
            "threads": cfg.threads, "eval": False, "count_tokens": True,
            **({"packing": True, "packing_strategy": v.trl_packing} if v.packed else {}),
            }  # fmt: skip
    (out / "spec.json").write_text(json.dumps(spec, indent=1))
    worker = Path(ft.__file__).with_name("finetune_trl_worker.py")
    cmd = [cfg.trl_python, str(worker), str(out / "spec.json")]
    info = ft.run_measured(cmd, work / "logs" / f"trl-{v.name}.log", env, cfg.sample_ms)
    result = json.loads((out / "trl_result.json").read_text())
    batches = result.pop("batches")
    keys = ("positions", "real", "rows", "tokens")
    counts = [{k: sum(b[k] for b in batches[i : i + accum]) for k in keys}
              for i in range(0, len(batches), accum)]  # fmt: skip
    return {"variant": v, "command": ft._shown(cmd), "spec": spec, "export": str(out / "final"),
            **info, "cpu_s": result["cpu_s"], "step_s": result["step_s"], "counts": counts,
            "mbs_accum": (mbs, accum), "padding_free": result.get("padding_free"),
            "attn_implementation": result.get("attn_implementation"),
            "trl_steps": result["steps"]}  # fmt: skip


def warm_store(cfg: Any, work: Path, model: Path, files: dict, env: dict) -> None:
    """One unmeasured step of gradstep on ``files``: builds the token store every measured
    run then reads (the first run on a data set would otherwise carry its build)."""
    v = Variant("gradstep", "warm")
    cmd = gradstep_cmd(cfg, files, model, v, work / "warm")
    cmd[cmd.index("--epochs") : cmd.index("--epochs") + 2] = ["--max-steps", "1", "--warmup", "0"]
    cmd[cmd.index("--save-every") + 1] = "0"
    subprocess.run(cmd, env=env, check=True, capture_output=True)


# ----------------------------------------------------------------------------- FLOPs

PEAK = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
n = int(sys.argv[2])
a, b = torch.randn(n, n), torch.randn(n, n)
a @ b
best = 0.0
for _ in range(6):
    c = time.process_time()
    for _ in range(3):
        a @ b
    best = max(best, 3 * 2 * n**3 / (time.process_time() - c))
print(json.dumps({"flops": best, "n": n, "threads": torch.get_num_threads()}))
"""


def matmul_peak(threads: int, n: int = 2048) -> dict:
    """The machine's fp32 matmul FLOP/s: the best of 6 timings of 3 ``n x n`` products,
    by process CPU time (as the steps), on ``threads`` threads, in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", PEAK, str(threads), str(n)],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(proc.stdout)


SDPA = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
F = torch.nn.functional
b, h, t, d = (int(x) for x in sys.argv[2:6])
q, k, v = (torch.randn(b, h, t, d, requires_grad=True) for _ in range(3))
mask = torch.ones(t, t, dtype=torch.bool).tril().expand(b, 1, t, t).clone()
out = {}
for name, kw in (("is_causal", {"is_causal": True}), ("4-D bool mask", {"attn_mask": mask})):
    best = 1e9
    for i in range(4):
        c = time.process_time()
        F.scaled_dot_product_attention(q, k, v, **kw).sum().backward()
        best = best if i == 0 else min(best, time.process_time() - c)
    out[name] = best
print(json.dumps(out))
"""


def sdpa_cost(threads: int, shape: dict[str, int], rows: int, seq_len: int) -> dict:
    """CPU seconds of one layer's ``scaled_dot_product_attention`` forward + backward on
    ``rows`` rows of ``seq_len``: causal (what a padded row without a mask runs) and under
    the same causal pattern given as a 4-D boolean mask (what a packed row runs, its
    block-causal mask; TRL's padded rows carry one too)."""
    args = [str(threads), str(rows), str(shape["heads"]), str(seq_len), str(shape["head_dim"])]
    proc = subprocess.run([sys.executable, "-c", SDPA, *args], capture_output=True, text=True,
                          check=True)  # fmt: skip
    return json.loads(proc.stdout)


def model_shape(model: Path) -> dict[str, int]:
    """N (parameters without the input embedding), layers, heads, head size."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model))
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in net.parameters())
    embedding = net.get_input_embeddings().weight.numel()
    head = config.hidden_size // config.num_attention_heads
    return {"params": total, "N": total - embedding, "layers": config.num_hidden_layers,
            "heads": config.num_attention_heads, "head_dim": head}  # fmt: skip


def flops_per_token(shape: dict[str, int], lengths: Sequence[int]) -> float:
    """Mean model FLOPs of a real token over records of ``lengths`` tokens (n - 1 positions
    each): 6 N + 12 l h q t, t the record's positions."""
    positions = [n - 1 for n in lengths]
    attn = 12 * shape["layers"] * shape["heads"] * shape["head_dim"]
    return 6 * shape["N"] + attn * sum(t * t for t in positions) / sum(positions)
