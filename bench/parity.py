"""Measure how exactly an accumulated Stepper step reproduces one big batch.

On the demo GPT (small config), for windows of k micro-batches of random variable-length
sequences (labels -100 as padding), compare the normalised gradient with the gradient of
one batch holding every item, in fp32 and fp64, and print the worst relative error. For
contrast, the same for the common mean-of-micro-batch-means / k normalisation. Then the
bf16 accumulation error of fp32 buffers vs plain bf16 sums at 64 and 256 micro-batches.

    .venv/bin/python bench/parity.py [--windows 20]
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

import gradstep
from _common import (
    Batch,
    BF16Linear,
    collate,
    concat,
    lm_loss,
    reference_grads,
    reference_step,
    rel_err,
)
from gradstep_cli.models.gpt import GPT, GPTConfig

VOCAB = 256


def random_window(k: int, gen: torch.Generator) -> list[Batch]:
    """k micro-batches of 1-3 rows of 1-47 random tokens each (labels -100 past the end)."""
    mbs = []
    for _ in range(k):
        rows = int(torch.randint(1, 4, (1,), generator=gen))
        lengths = torch.randint(1, 48, (rows,), generator=gen).tolist()
        seqs = [
            (torch.randint(0, VOCAB, (n,), generator=gen),
             torch.randint(0, VOCAB, (n,), generator=gen))
            for n in lengths
        ]  # fmt: skip
        mbs.append(collate(seqs))
    return mbs


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters()]


def window_errors(base: nn.Module, mbs: list[Batch]) -> tuple[float, float]:
    """(Stepper error, mean-of-means error) against the one-batch gradient."""
    ref, _ = reference_grads(base, concat(mbs))
    m = copy.deepcopy(base)
    gradstep.Stepper(m, torch.optim.SGD(m.parameters(), lr=0.0), clip=None).step(mbs, lm_loss)
    mom = copy.deepcopy(base)
    for mb in mbs:
        o = lm_loss(mom, mb)
        (o.total / o.count / len(mbs)).backward()
    return rel_err(grads(m), ref), rel_err(grads(mom), ref)


def adamw_error(base: nn.Module, windows: list[list[Batch]]) -> float:
    """Relative parameter difference after len(windows) AdamW steps, Stepper vs one batch."""
    m, ref = copy.deepcopy(base), copy.deepcopy(base)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    stepper = gradstep.Stepper(m, opt, clip=gradstep.ClipNorm(1.0))
    for mbs in windows:
        stepper.step(mbs, lm_loss)
        reference_step(ref, concat(mbs), ref_opt, max_norm=1.0)
    return rel_err(list(m.parameters()), list(ref.parameters()))


def bf16_errors(k: int, seed: int) -> tuple[float, float]:
    """Gradient error vs fp64 after k micro-batches: fp32 buffers, plain bf16 sums."""
    g = torch.Generator().manual_seed(seed)
    init = BF16Linear(32, 16).to(torch.bfloat16)
    mbs = [
        ((torch.randn(4, 32, generator=g) * 0.5 + 1).bfloat16(),
         torch.randn(4, 16, generator=g) * 0.5 + 2.0)
        for _ in range(k)
    ]  # fmt: skip
    mse = lambda model, mb: gradstep.LossSum(((model(mb[0]) - mb[1]) ** 2).sum(), mb[1].numel())
    ref = copy.deepcopy(init).double()
    x = torch.cat([x for x, _ in mbs]).double()
    y = torch.cat([y for _, y in mbs]).double()
    (((ref(x) - y) ** 2).sum() / y.numel()).backward()
    errors = []
    for accum in (None, torch.bfloat16):
        m = copy.deepcopy(init)
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        gradstep.Stepper(m, opt, clip=None, accum_dtype=accum).step(mbs, mse)
        errors.append(rel_err(grads(m), grads(ref)))
    return errors[0], errors[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=20, help="random windows per k")
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, d_model=64, max_seq_len=64)
    print("| k | Stepper fp32 (max) | Stepper fp64 (max) | mean-of-means fp32 (median / max) "
          "| params after 3 AdamW steps, fp32 |")  # fmt: skip
    print("|---|---|---|---|---|")
    for k in (1, 2, 3, 7):
        gen = torch.Generator().manual_seed(k)
        windows = [random_window(k, gen) for _ in range(args.windows)]
        base = GPT(cfg)
        e32 = [window_errors(base, w) for w in windows]
        e64 = [window_errors(copy.deepcopy(base).double(), w)[0] for w in windows]
        mom = sorted(m for _, m in e32)
        adam = adamw_error(GPT(cfg), windows[:3])
        print(f"| {k} | {max(e for e, _ in e32):.1e} | {max(e64):.1e} | "
              f"{mom[len(mom) // 2]:.1e} / {mom[-1]:.1e} | {adam:.1e} |")  # fmt: skip
    print("\n| micro-batches | fp32 buffers (default) | plain bf16 | ratio |")
    print("|---|---|---|---|")
    for k in (64, 256):
        pairs = [bf16_errors(k, seed) for seed in range(3)]
        worst = min(b / a for a, b in pairs)
        a = max(a for a, _ in pairs)
        b = min(b for _, b in pairs)
        print(f"| {k} | {a:.1e} (worst of 3) | {b:.1e} (best of 3) | >= {worst:.1f}x |")


if __name__ == "__main__":
    main()
