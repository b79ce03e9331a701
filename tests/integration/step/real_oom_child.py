"""A real out-of-memory, in a process of its own: ``python real_oom_child.py fp32 bf16``.

Imports, builds the demo GPT, warms up (optimizer state, thread pools), takes the reference
step on a copy without any limit, compiles the kernels of every micro-batch size a split
can reach, then caps its address space (``RLIMIT_AS``) a little above what it uses and
takes the same step with ``Stepper(on_oom="split")``: the window must be split (torch's CPU
allocator fails for real) and the update must equal the reference's. Headroom is chosen
adaptively: from a fraction of what the step needed unlimited, larger after "nothing
fits", smaller after "no split was needed". Prints one JSON line: each precision's outcome.

Each precision runs in a process of its own: the step's need is read from ``VmPeak``, the
process's peak since it started, which an earlier precision's larger step would hide.

Why the kernels are compiled before the cap: oneDNN (torch 2.13's v3.12, bf16 matmuls)
JIT-compiles a kernel for every new input shape, and when the memory for that code cannot
be mapped, Xbyak's error stays in a thread-local flag that nothing clears (fixed upstream
in uxlfoundation/oneDNN#5907): from then on every new kernel on that thread fails with
``could not create a primitive``, with or without a limit, and only shapes compiled earlier
still run. No split can recover from that, in gradstep or anywhere in that thread. Under
the cap the kernels of the halved shapes are therefore already cached, and what runs out is
what a split can shrink: the activations.
"""

from __future__ import annotations

import copy
import json
import os
import resource
import subprocess
import sys

import torch

import gradstep
from gradstep.errors import MicroBatchTooLarge
from gradstep.memory import pin_mmap_threshold
from gradstep_cli.models.gpt import GPT, GPTConfig

ROWS, SEQ = 32, 256
FRACTIONS = (0.25, 0.5, 0.12, 0.7, 0.06)  # of what the unlimited step needed above VmSize
SPLIT_ROWS = (16, 8, 4, 2, 1)  # the micro-batch sizes the ROWS-row window halves into


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _loss(model: torch.nn.Module, batch: dict) -> gradstep.LossSum:
    return gradstep.token_loss(model(batch["input_ids"]), batch["labels"])


def _window(rows: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (rows, SEQ + 1), generator=gen)
    return [{"input_ids": ids[:, :-1], "labels": ids[:, 1:]}]


def _stepper(model: torch.nn.Module, precision: str, on_oom: str) -> gradstep.Stepper:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return gradstep.Stepper(model, opt, clip=None, precision=precision, on_oom=on_oom)


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def main(precision: str) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, d_model=128, n_head=4, max_seq_len=SEQ))
    stepper = _stepper(model, precision, "split")
    stepper.step(_window(2, seed=1), _loss)  # momentum buffers, thread pools, first kernels
    ref_model = copy.deepcopy(model)
    ref = _stepper(ref_model, precision, "raise")
    # A copy: load_state_dict keeps the same buffer tensors, which both steps would update.
    ref.optimizer.load_state_dict(copy.deepcopy(stepper.optimizer.state_dict()))
    before = _params(model)
    size = _status("VmSize:")
    ref.step(_window(ROWS, seed=2), _loss)
    need = max(_status("VmPeak:") - size, 64 * 2**20)
    want = [(a - b).double() for a, b in zip(_params(ref_model), before, strict=True)]
    del ref, ref_model
    # The kernels of every size the split can reach, compiled before the cap (see above):
    # one throwaway step whose micro-batches have each of those sizes, forward and backward.
    warm_model = copy.deepcopy(model)
    _stepper(warm_model, precision, "raise").step(
        [_window(rows, seed=3)[0] for rows in SPLIT_ROWS], _loss
    )
    del warm_model
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    tried = []
    for fraction in FRACTIONS:
        headroom = int(need * fraction)
        resource.setrlimit(resource.RLIMIT_AS, (_status("VmSize:") + headroom, hard))
        try:
            stats = stepper.step(_window(ROWS, seed=2), _loss)
        except MicroBatchTooLarge:
            tried.append((fraction, "too large"))
            continue  # nothing changed: try with more room
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        if stats.oom_splits == 0 and stepper.oom_halvings == 0:
            tried.append((fraction, "fit"))
            return {"tried": tried, "splits": 0}  # cannot happen below the unlimited need
        got = [(a - b).double() for a, b in zip(_params(model), before, strict=True)]
        num = sum(float((g - w).square().sum()) for g, w in zip(got, want, strict=True))
        den = sum(float(w.square().sum()) for w in want)
        tried.append((fraction, "split"))
        return {
            "tried": tried,
            "splits": stepper.oom_halvings,
            "micro_batches": stats.micro_batches,
            "rel_err": (num / den) ** 0.5,
            "need_mib": need / 2**20,
        }
    return {"tried": tried, "splits": None}


def _in_own_process(precision: str) -> dict:
    """``main(precision)`` in a fresh interpreter; a death by a signal is passed on as ours
    (the test retries those: the cap, not gradstep)."""
    proc = subprocess.run(
        [sys.executable, __file__, precision], capture_output=True, text=True, check=False
    )
    sys.stderr.write(proc.stderr)
    if proc.returncode < 0:
        sys.stderr.flush()
        os.kill(os.getpid(), -proc.returncode)
    if proc.returncode != 0:
        sys.exit(proc.returncode)
    return json.loads(proc.stdout.strip().splitlines()[-1])[precision]


if __name__ == "__main__":
    precisions = sys.argv[1:]
    if len(precisions) > 1:
        print(json.dumps({precision: _in_own_process(precision) for precision in precisions}))
        sys.exit(0)
    torch.set_num_threads(1)
    pin_mmap_threshold()  # freed tensors leave the process: VmSize follows the live bytes
    print(json.dumps({precision: main(precision) for precision in precisions}))
