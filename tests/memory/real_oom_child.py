"""A real out-of-memory, in a process of its own: ``python real_oom_child.py fp32 bf16``.

Imports, builds the demo GPT, warms up (optimizer state, thread pools), takes the reference
step on a copy without any limit, then caps its address space (``RLIMIT_AS``) a little
above what it uses and takes the same step with ``Stepper(on_oom="split")``: the window
must be split (the allocators fail for real: torch's CPU allocator, oneDNN creating a
kernel) and the update must equal the reference's. Headroom is chosen adaptively: from a
fraction of what the step needed unlimited, larger after "nothing fits", smaller after "no
split was needed". Prints one JSON line: each precision's outcome.
"""

from __future__ import annotations

import copy
import json
import resource
import sys

import torch

import gradstep
from gradstep.errors import MicroBatchTooLarge
from gradstep.memory import pin_mmap_threshold
from gradstep_demo.model import GPT, GPTConfig

ROWS, SEQ = 32, 256
FRACTIONS = (0.25, 0.5, 0.12, 0.7, 0.06)  # of what the unlimited step needed above VmSize


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


if __name__ == "__main__":
    torch.set_num_threads(1)
    pin_mmap_threshold()  # freed tensors leave the process: VmSize follows the live bytes
    print(json.dumps({precision: main(precision) for precision in sys.argv[1:]}))
