"""Peak resident memory of one micro-batch forward + backward with the loss from the whole
logits and chunked, and what the chunked loss buys under a memory budget (issue 31 §2).

1. The demo GPT (``GPTConfig(loss_chunk_tokens=N)``) and a tiny-width Hugging Face Llama
   (``chunked_loss_hf``: HF's own ``model(labels=...).loss``, ``causal_lm_loss(model, batch)``
   and ``causal_lm_loss(..., chunk_tokens=N)``). Both are narrow (``--d-model 64``, 2
   layers) so that the logits, ``B x T x vocab``, dominate; vocabularies 32k and 128k
   (Llama 2's and Llama 3's sizes). Each configuration runs in a FRESH process that pins
   glibc's mmap threshold (freed tensors go back to the OS, so RSS follows the live
   tensors), builds the model and batch, takes one warm-up forward + backward (code pages,
   oneDNN caches), drops the gradients, and then measures one forward + backward two ways:

   * sampled: a thread reading ``VmRSS`` from ``/proc/self/status`` every ``--interval-ms``
     (torch's kernels release the GIL, so the thread runs during them);
   * kernel: ``VmHWM`` (the kernel's own high-water mark), reset just before through
     ``/proc/self/clear_refs``.

   Both are reported above the RSS just before the measured step (the model, its batch and
   the runtime), beside the size of the float32 logits the unchunked loss holds.
2. ``--cli`` (``chunked_loss_cli``): the real ``gradstep train --micro-batch-size auto``
   under one ``--memory-budget`` per vocabulary, with ``--loss-chunk-tokens 0``, ``1024``
   and the flag left out (the planner's choice): the micro-batch and loss each run's plan
   chose, the run's peak RSS (an independent sampler of the process tree) and its tokens/s.

    .venv/bin/python bench/chunked_loss.py            # both parts, ~12 min on 2 loaded cores
    .venv/bin/python bench/chunked_loss.py --models --reuse   # part 2 again, part 1 kept
    .venv/bin/python bench/chunked_loss.py --no-cli   # part 1 only, ~4 min
    .venv/bin/python bench/chunked_loss.py --vocab 32000 --chunks 1024 --models gpt
Outputs: markdown tables on stdout, bench/out/chunked_loss.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import chunked_loss_cli

MIB = 2**20
OUT = Path(__file__).resolve().parent / "out"


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field))
    return int(line.split()[1]) * 1024


class Sampler(threading.Thread):
    """The largest ``VmRSS`` seen every ``interval_ms`` until :meth:`stop`."""

    def __init__(self, interval_ms: float) -> None:
        super().__init__(daemon=True)
        self.interval, self.peak, self.samples = interval_ms / 1000, 0, 0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, _status("VmRSS:"))
            self.samples += 1
            time.sleep(self.interval)

    def stop(self) -> None:
        self._done.set()
        self.join()


def _gpt(args: argparse.Namespace) -> tuple[Any, Callable[[], float]]:
    """The demo GPT and one forward + backward of its own (chunked) loss."""
    import torch

    from gradstep_cli.models.gpt import GPT, GPTConfig

    vocab = args.vocab[0]
    cfg = GPTConfig(
        vocab_size=vocab, n_layer=2, n_head=2, d_model=args.d_model,
        max_seq_len=args.seq_len, loss_chunk_tokens=args.chunk or None,
    )  # fmt: skip
    model = GPT(cfg)
    ids = torch.randint(0, vocab, (args.micro_batch, args.seq_len))
    labels = torch.randint(0, vocab, (args.micro_batch, args.seq_len))

    def step() -> float:
        loss = model(ids, labels)
        loss.total.backward()
        return float(loss.total) / int(loss.count)

    return model, step


def child(args: argparse.Namespace) -> dict:
    """One configuration, in this (fresh) process: the JSON row of the table."""
    import torch

    from gradstep.memory import pin_mmap_threshold

    pin_mmap_threshold()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.model == "gpt":
        model, step = _gpt(args)
        name = "unchunked" if not args.chunk else f"chunked {args.chunk}"
    else:
        import chunked_loss_hf

        model, step = chunked_loss_hf.build(args)
        name = chunked_loss_hf.label(args.loss, args.chunk)
    step()  # warm-up: what a first step loads once
    model.zero_grad(set_to_none=True)  # the measured step allocates its gradients again
    base = _status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    sampler = Sampler(args.interval_ms)
    sampler.start()
    start = time.perf_counter()
    per_token = step()
    seconds = time.perf_counter() - start
    sampler.stop()
    hwm = _status("VmHWM:")
    return {
        "vocab": args.vocab[0],
        "loss": name,
        "logits MiB": args.micro_batch * args.seq_len * args.vocab[0] * 4 / MIB,
        "base MiB": base / MIB,
        "sampled peak - base MiB": (sampler.peak - base) / MIB,
        "VmHWM - base MiB": (hwm - base) / MIB,
        "samples": sampler.samples,
        "fwd+bwd s": seconds,
        "loss/token": per_token,
    }


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--vocab", type=int, nargs="+", default=[32000, 128256])
    add("--chunks", type=int, nargs="+", default=[0, 1024, 256],
        help="loss_chunk_tokens / chunk_tokens per run; 0 = the whole logits")  # fmt: skip
    add("--models", nargs="*", choices=["gpt", "hf"], default=["gpt", "hf"],
        help="part 1's models: the demo GPT, the tiny Llama (also HF's own loss)")  # fmt: skip
    add("--d-model", type=int, default=64)
    add("--seq-len", type=int, default=512)
    add("--micro-batch", type=int, default=4)
    add("--threads", type=int, default=2)
    add("--interval-ms", type=float, default=2.0)
    add("--cli", action=argparse.BooleanOptionalAction, default=True,
        help="part 2: gradstep train --micro-batch-size auto, whole vs chunked loss")  # fmt: skip
    add("--cli-budget", type=chunked_loss_cli.budgets, nargs="+",
        default=[(32000, "800MiB"), (128256, "2GiB")], metavar="VOCAB=SIZE",
        help="part 2's --memory-budget per vocabulary")  # fmt: skip
    add("--cli-losses", type=chunked_loss_cli.loss_setting, nargs="+",
        default=[0, 1024, None], metavar="N|default",
        help="part 2's runs: --loss-chunk-tokens N, or default (the flag left out)")  # fmt: skip
    add("--cli-seq-len", type=int, default=256)
    add("--cli-global-batch", type=int, default=16)
    add("--cli-steps", type=int, default=4)
    add("--cli-tries", type=int, default=3, help="part 2: tries per run")
    add("--cli-retry-s", type=float, default=180.0, help="part 2: pause before a retry")
    add("--work", type=Path, default=None,
        help="part 2's model and run folders (default: a temp dir)")  # fmt: skip
    add("--reuse", action="store_true",
        help="keep bench/out/chunked_loss.json's rows of the models not in --models")  # fmt: skip
    add("--child", action="store_true", help=argparse.SUPPRESS)
    add("--model", default="gpt", help=argparse.SUPPRESS)
    add("--loss", default="gradstep", help=argparse.SUPPRESS)
    add("--chunk", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args()


def part1(args: argparse.Namespace, model: str) -> list[dict]:
    """Every (vocabulary, loss) of ``model``, each in a fresh process."""
    losses = [("gradstep", c) for c in args.chunks]
    if model == "hf":
        losses.insert(0, ("hf", 0))
    rows = []
    for vocab in args.vocab:
        for loss, chunk in losses:
            flags = [f"--vocab={vocab}", f"--chunk={chunk}", f"--model={model}",
                     f"--loss={loss}", f"--d-model={args.d_model}",
                     f"--seq-len={args.seq_len}", f"--micro-batch={args.micro_batch}",
                     f"--threads={args.threads}", f"--interval-ms={args.interval_ms}"]  # fmt: skip
            rows.append(_run([sys.executable, __file__, "--child", *flags]))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    args = parse()
    if args.child:
        print(json.dumps(child(args)))
        return
    result: dict = {"settings": {k: str(v) for k, v in vars(args).items()}}
    if args.reuse and (OUT / "chunked_loss.json").exists():
        old = json.loads((OUT / "chunked_loss.json").read_text())
        result.update({k: old[k] for k in ("gpt", "hf") if k in old and k not in args.models})
        result["reused_settings"] = old.get("reused_settings", old["settings"])
    for model in args.models:
        result[model] = part1(args, model)
    if args.cli:  # last: the planner may be changing under it
        result["cli_notes"] = []
        with tempfile.TemporaryDirectory(prefix="chunked_loss-") as tmp:
            work = args.work or Path(tmp)
            work.mkdir(parents=True, exist_ok=True)
            result["cli"] = chunked_loss_cli.run_all(args, work, result["cli_notes"])
    text = report(result, args)
    print(text)
    OUT.mkdir(exist_ok=True)
    (OUT / "chunked_loss.md").write_text(text + "\n")
    (OUT / "chunked_loss.json").write_text(json.dumps(result, indent=2) + "\n")


def _run(cmd: list[str]) -> dict:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(result: dict, args: argparse.Namespace) -> str:
    """The markdown: one table per part-1 model, then part 2's."""
    shape = (
        f"d_model {args.d_model}, 2 layers, micro-batch {args.micro_batch} x {args.seq_len} "
        f"tokens, float32, {args.threads} threads: one forward + backward."
    )
    heads = {
        "gpt": f"Demo GPT, {shape}",
        "hf": f"Hugging Face Llama (LlamaConfig, random init, sdpa), {shape}",
        "cli": (
            f"gradstep train --micro-batch-size auto --global-batch {args.cli_global_batch} "
            f"--seq-len {args.cli_seq_len} --max-steps {args.cli_steps}, the same Llama "
            f"(bytes of the default corpus), {args.threads} threads: whole vs chunked loss."
        ),
    }
    parts = [heads[k] + "\n\n" + _table(result[k]) for k in ("gpt", "hf", "cli") if k in result]
    if result.get("cli"):
        parts.append("Commands:\n\n" + "\n".join(f"    {r['command']}" for r in result["cli"]))
    return "\n\n".join(parts)


HIDDEN = ("command", "processes", "trained tok/s (summary)", "steps 1..K-1 cpu_s, wall_s")


def _table(rows: list[dict]) -> str:
    keys = [k for k in rows[0] if k not in HIDDEN]

    def cell(v: object) -> str:
        return f"{v:.4g}" if isinstance(v, float) else "-" if v is None else str(v)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
