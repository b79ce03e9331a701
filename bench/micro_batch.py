"""What one more micro-batch costs in ``Stepper.step`` over a hand-written loop.

The marginal cost, not the fixed one: for two window lengths (1 and ``--k``) the per-step
difference t(Stepper) - t(hand loop) is measured (median over interleaved pairs, CPU
time), and the per-micro-batch overhead is (d(k) - d(1)) / (k - 1): what the step's fixed
work (norm, clip, optimizer) costs cancels. Each pair runs twice, once with each side
first, and the two are averaged: the side that runs first in a pair is measurably slower
on this machine (about 1-2 us per micro-batch), whichever it is.

Model: the demo GPT at width 64 (2 layers), micro-batches of 2 sequences of <= 8 tokens,
AdamW, ClipNorm(1.0), fp32. Two hand loops:

- ``hand``: bench/step_overhead.py's loop (token counts up front, the loss divided by the
  window's count before each backward, ``clip_grad_norm_``);
- ``hand, same loss_fn``: the loop with the Stepper's own ``loss_fn`` (``token_loss``,
  counting each micro-batch's tokens after its forward), loss sums backpropagated and the
  gradient divided once at the end: the Stepper's math with none of its machinery. The
  difference to it is the library's own per-micro-batch cost.

The Stepper runs ``token_loss`` (counting after each forward, the default), and also
``step(window, loss_fn, count=fn)`` with ``token_loss(..., count=False)``: the tokens
counted up front, where the hand loop counts them.

    .venv/bin/python bench/micro_batch.py            # ~3 min on 2 cores
    .venv/bin/python bench/micro_batch.py --pairs 10 --k 32

Writes ``bench/out/micro_batch.md`` and ``.json``. Not a test: nothing is asserted.
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch

import gradstep
from _common import (
    BaseConfig,
    count_items,
    interleaved_times,
    lm_loss,
    lm_window,
    machine_info,
    markdown_table,
    random_rows,
    write_outputs,
)
from gradstep_cli.models.gpt import GPT, GPTConfig
from step_overhead import hand_step


@dataclass(frozen=True)
class Config(BaseConfig):
    k: int = 64
    pairs: int = 30
    warmup: int = 3
    seed: int = 0

    POSITIVE = ("k", "pairs")

    def check(self) -> None:
        if self.k < 2:
            raise ValueError("--k must be >= 2")


def hand_same_loss(model, opt, window, max_norm):  # type: ignore[no-untyped-def]
    """The Stepper's math by hand: token_loss per micro-batch, sums backpropagated, one
    division by the window's token count, clip_grad_norm_, AdamW."""
    opt.zero_grad(set_to_none=True)
    totals, counts = [], []
    for mb in window:
        loss = lm_loss(model, mb)
        totals.append(loss.total.detach())
        counts.append(loss.count)
        loss.total.backward()
    items = sum(int(c) for c in counts)
    for p in model.parameters():
        p.grad.div_(items)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()
    return float(torch.stack(totals).sum()) / items, float(norm)


def lm_loss_counted(model: torch.nn.Module, mb: dict) -> gradstep.LossSum:
    """``lm_loss`` leaving the count to ``step(..., count=count_items_of)``."""
    return gradstep.token_loss(model(mb["input_ids"]), mb["labels"], count=False)


def count_items_of(mb: dict) -> int:
    return count_items([mb])


def _side(kind: str, model: torch.nn.Module) -> Any:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if kind in ("stepper", "stepper, counted up front"):
        stepper = gradstep.Stepper(model, opt, clip=gradstep.ClipNorm(1.0))
        if kind == "stepper":
            return lambda w: stepper.step(w, lm_loss)
        return lambda w: stepper.step(w, lm_loss_counted, count=count_items_of)
    loop = hand_step if kind == "hand" else hand_same_loss
    return lambda w: loop(model, opt, w, 1.0)


def _diff_us(base: GPT, stepper: str, hand: str, k: int, cfg: Config) -> float:
    """Median per-step t(Stepper) - t(hand) in us, the order within pairs balanced."""
    pool = [lm_window(random_rows(2 * k, 8, seed=cfg.seed + i), 2) for i in range(2)]
    out = []
    for stepper_first in (True, False):
        s = _side(stepper, copy.deepcopy(base))
        h = _side(hand, copy.deepcopy(base))
        a, b = (s, h) if stepper_first else (h, s)
        t = interleaved_times(
            lambda i, a=a: a(pool[i % 2]), lambda i, b=b: b(pool[i % 2]), cfg.warmup, cfg.pairs
        )
        d = statistics.median(x - y for x, y in zip(t.cpu_a, t.cpu_b, strict=True)) * 1e6
        out.append(d if stepper_first else -d)
    return sum(out) / 2


def run(cfg: Config) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    base = GPT(GPTConfig(n_layer=2, n_head=2, d_model=64, max_seq_len=16))
    rows = []
    cases = (("stepper", "hand"), ("stepper", "hand, same loss_fn"),
             ("stepper, counted up front", "hand"))  # fmt: skip
    for stepper, hand in cases:
        d1, dk = _diff_us(base, stepper, hand, 1, cfg), _diff_us(base, stepper, hand, cfg.k, cfg)
        rows.append({
            "stepper": stepper, "against": hand, "fixed_us": d1,
            f"step_diff_at_k{cfg.k}_us": dk,
            "per_micro_batch_us": (dk - d1) / (cfg.k - 1),
        })  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    cfg, _ = Config.parse(argv, Config.parser(__doc__))
    rows = run(cfg)
    result = {"config": asdict(cfg), "machine": machine_info(), "rows": rows}
    text = "\n".join(
        [
            "# Per-micro-batch overhead of Stepper.step\n",
            json.dumps(result["machine"]) + "\n",
            markdown_table(rows),
        ]
    )
    write_outputs("micro_batch", text + "\n", result)


if __name__ == "__main__":
    sys.exit(main())
