"""Peak resident memory of one micro-batch forward + backward of the demo GPT, with the loss
from the whole logits and chunked (``GPTConfig(loss_chunk_tokens=N)``).

The model is narrow (``--d-model 64``, 2 layers) so that the logits, ``B x T x vocab``,
dominate; vocabularies 32k and 128k (Llama 2's and Llama 3's sizes). Each configuration
runs in a FRESH process that pins glibc's mmap threshold (freed tensors go back to the OS,
so RSS follows the live tensors), builds the model and batch, takes one warm-up
forward + backward (code pages, oneDNN caches), drops the gradients, and then measures one
forward + backward two ways:

* sampled: a thread reading ``VmRSS`` from ``/proc/self/status`` every ``--interval-ms``
  (torch's kernels release the GIL, so the thread runs during them);
* kernel: ``VmHWM`` (the kernel's own high-water mark), reset just before through
  ``/proc/self/clear_refs``.

Both are reported above the RSS just before the measured step (the model, its batch and
the runtime), beside the size of the float32 logits the unchunked loss holds.

    .venv/bin/python bench/chunked_loss.py            # 32k and 128k, ~1 min on 2 cores
    .venv/bin/python bench/chunked_loss.py --vocab 32000 --chunks 1024
Outputs: a markdown table on stdout, bench/out/chunked_loss.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

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


def child(args: argparse.Namespace) -> dict:
    """One configuration, in this (fresh) process: the JSON row of the table."""
    import torch

    from gradstep.memory import pin_mmap_threshold
    from gradstep_cli.models.gpt import GPT, GPTConfig

    pin_mmap_threshold()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    chunk, vocab = args.chunk or None, args.vocab[0]
    cfg = GPTConfig(
        vocab_size=vocab, n_layer=2, n_head=2, d_model=args.d_model,
        max_seq_len=args.seq_len, loss_chunk_tokens=chunk,
    )  # fmt: skip
    model = GPT(cfg)
    ids = torch.randint(0, vocab, (args.micro_batch, args.seq_len))
    labels = torch.randint(0, vocab, (args.micro_batch, args.seq_len))
    model(ids, labels).total.backward()  # warm-up: what a first step loads once
    model.zero_grad(set_to_none=True)  # the measured step allocates its gradients again
    base = _status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    sampler = Sampler(args.interval_ms)
    sampler.start()
    start = time.perf_counter()
    loss = model(ids, labels)
    loss.total.backward()
    seconds = time.perf_counter() - start
    sampler.stop()
    hwm = _status("VmHWM:")
    return {
        "vocab": vocab,
        "loss": "unchunked" if chunk is None else f"chunked {chunk}",
        "logits MiB": args.micro_batch * args.seq_len * vocab * 4 / MIB,
        "base MiB": base / MIB,
        "sampled peak - base MiB": (sampler.peak - base) / MIB,
        "VmHWM - base MiB": (hwm - base) / MIB,
        "samples": sampler.samples,
        "fwd+bwd s": seconds,
        "loss/token": float(loss.total) / int(loss.count),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 1024, 256],
                        help="loss_chunk_tokens per run; 0 = unchunked")  # fmt: skip
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--interval-ms", type=float, default=2.0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    rows = []
    for vocab in args.vocab:
        for chunk in args.chunks:
            flags = [f"--vocab={vocab}", f"--chunk={chunk}", f"--d-model={args.d_model}",
                     f"--seq-len={args.seq_len}", f"--micro-batch={args.micro_batch}",
                     f"--threads={args.threads}", f"--interval-ms={args.interval_ms}"]  # fmt: skip
            rows.append(_run([sys.executable, __file__, "--child", *flags]))
            print(json.dumps(rows[-1]), file=sys.stderr)
    text = _table(rows, args)
    print(text)
    OUT.mkdir(exist_ok=True)
    (OUT / "chunked_loss.md").write_text(text + "\n")
    (OUT / "chunked_loss.json").write_text(json.dumps(rows, indent=2) + "\n")


def _run(cmd: list[str]) -> dict:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _table(rows: list[dict], args: argparse.Namespace) -> str:
    keys = list(rows[0])
    head = (
        f"Demo GPT, d_model {args.d_model}, 2 layers, micro-batch {args.micro_batch} x "
        f"{args.seq_len} tokens, float32, {args.threads} threads: one forward + backward.\n"
    )

    def cell(v: object) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(r[k]) for k in keys) + " |" for r in rows]
    return head + "\n" + "\n".join(lines)


if __name__ == "__main__":
    main()
