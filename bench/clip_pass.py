"""The clip pass: what the step does to the gradients after backward, and at what bandwidth.

A model large enough for its gradients not to fit in cache (the demo GPT at ~``--size``
parameters, fp32), one micro-batch of ``--tokens`` tokens per step (so that backward is
short and the passes over the gradients matter), AdamW, ClipNorm(1.0). Three steps,
interleaved round by round on copies of one initialisation:

- ``hand``: a hand-written loop, ``clip_grad_norm_(foreach=True)`` after backward (reads
  every gradient for the norm, then reads and writes it for the multiply);
- ``after``: ``Stepper(norm_in_backward=False)``: the norm after backward, then one
  multiply that normalises and clips;
- ``during``: ``Stepper()`` (the default): each gradient's norm taken as it becomes final
  in backward (post-accumulate-grad hooks), so only the multiply remains after backward.

Timed per step: the work after backward and before ``optimizer.step`` (``t_after``; for
the Stepper from the end of its last backward to the optimizer step, by wrapping the two;
for the hand loop ``clip_grad_norm_`` itself), the backward, and the whole step. The
bandwidth of what remains is ``2 x gradient bytes / t_after`` of ``during`` (one read and
one write of every gradient), against the same measure of the ideal pass measured in the
same run: one contiguous buffer of the same byte count scaled in place, best of several.

    .venv/bin/python bench/clip_pass.py                # ~100M parameters, ~2 min
    .venv/bin/python bench/clip_pass.py --size 50m --rounds 6

Writes ``bench/out/clip_pass.md`` and ``.json``. Not a test: nothing is asserted.
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

import gradstep
from _common import BaseConfig, lm_loss, lm_window, machine_info, random_rows, write_outputs
from gradstep.step.precision import Precision
from gradstep_cli.models.gpt import GPT, GPTConfig
from step_overhead import hand_step

SIZES = {
    "50m": GPTConfig(n_layer=8, n_head=8, d_model=704),
    "100m": GPTConfig(n_layer=12, n_head=8, d_model=832),
}


@dataclass(frozen=True)
class Config(BaseConfig):
    size: str = "100m"
    tokens: int = 8
    rounds: int = 8
    warmup: int = 2
    threads: int = 0
    seed: int = 0

    POSITIVE = ("tokens", "rounds")
    HELP = {"size": f"model size, of {', '.join(SIZES)}", "threads": "0: torch's default"}

    def check(self) -> None:
        if self.size not in SIZES:
            raise ValueError(f"--size must be one of {', '.join(SIZES)}, got {self.size!r}")


class _Clock:
    """Wall-clock marks inside a Stepper step: the end of its accumulation (the last
    backward) and the start of the optimizer step."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}
        real_acc, real_step = gradstep.Stepper._accumulate, Precision.step

        def accumulate(stepper, *a, **kw):  # type: ignore[no-untyped-def]
            out = real_acc(stepper, *a, **kw)
            self.marks["backward_end"] = time.perf_counter()
            return out

        def step(precision, optimizer):  # type: ignore[no-untyped-def]
            self.marks["optimizer"] = time.perf_counter()
            return real_step(precision, optimizer)

        gradstep.Stepper._accumulate = accumulate  # type: ignore[method-assign]
        Precision.step = step  # type: ignore[method-assign]


def _hand_timed(model, opt, window) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """``hand_step`` with ``clip_grad_norm_`` timed on its own."""
    real = torch.nn.utils.clip_grad_norm_
    spent = {}

    def clip(params, max_norm, **kw):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = real(params, max_norm, foreach=True)
        spent["after"] = time.perf_counter() - t0
        return out

    torch.nn.utils.clip_grad_norm_ = clip
    try:
        t0 = time.perf_counter()
        hand_step(model, opt, window, 1.0)
        spent["step"] = time.perf_counter() - t0
    finally:
        torch.nn.utils.clip_grad_norm_ = real
    return spent


def scale_bandwidth(nbytes: int, repeats: int = 7) -> float:
    """GB/s (one read + one write counted) of scaling ONE contiguous fp32 buffer of
    ``nbytes`` in place, best of repeats: the ideal of the multiply that remains."""
    buf = torch.ones(nbytes // 4)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.mul_(0.999)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9


def run(cfg: Config) -> dict[str, Any]:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    base = GPT(SIZES[cfg.size])
    n_params = sum(p.numel() for p in base.parameters())
    grad_bytes = 4 * n_params
    windows = [lm_window(random_rows(1, cfg.tokens, seed=i), 1) for i in range(2)]
    clock = _Clock()
    sides: dict[str, Any] = {}
    for name in ("hand", "after", "during"):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        stepper = None
        if name != "hand":
            stepper = gradstep.Stepper(
                model, opt, clip=gradstep.ClipNorm(1.0), norm_in_backward=name == "during"
            )
        sides[name] = (model, opt, stepper)
    times: dict[str, dict[str, list[float]]] = {n: {"after": [], "step": []} for n in sides}
    for r in range(cfg.warmup + cfg.rounds):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        for name in order:
            model, opt, stepper = sides[name]
            window = windows[r % 2]
            if stepper is None:
                spent = _hand_timed(model, opt, window)
            else:
                t0 = time.perf_counter()
                stepper.step(window, lm_loss)
                spent = {
                    "step": time.perf_counter() - t0,
                    "after": clock.marks["optimizer"] - clock.marks["backward_end"],
                }
            if r >= cfg.warmup:
                for key, value in spent.items():
                    times[name][key].append(value)
    bandwidth = scale_bandwidth(grad_bytes)
    med = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}
    during = med["during"]["after"]
    return {
        "parameters": n_params,
        "gradient_mb": grad_bytes / 2**20,
        "median_ms": {n: {k: 1e3 * v for k, v in t.items()} for n, t in med.items()},
        "after_backward_speedup_vs_hand": med["hand"]["after"] / during,
        "after_backward_speedup_vs_after": med["after"]["after"] / during,
        "scale_bandwidth_gb_s": bandwidth,
        "during_remaining_gb_s": 2 * grad_bytes / during / 1e9,
        "during_fraction_of_bandwidth": 2 * grad_bytes / during / 1e9 / bandwidth,
        "step_ratio_during_vs_hand": med["during"]["step"] / med["hand"]["step"],
    }


def main(argv: list[str] | None = None) -> None:
    cfg, _ = Config.parse(argv, Config.parser(__doc__))
    result = {"config": asdict(cfg), "machine": machine_info(), **run(cfg)}
    ms = result["median_ms"]
    lines = [
        f"# Clip pass, {result['parameters'] / 1e6:.0f}M fp32 parameters "
        f"({result['gradient_mb']:.0f} MiB of gradients)\n",
        json.dumps(result["machine"]) + "\n",
        "| step | work after backward (ms) | whole step (ms) |",
        "|---|---:|---:|",
        *(f"| {n} | {t['after']:.1f} | {t['step']:.1f} |" for n, t in ms.items()),
        "",
        f"after-backward work: hand / during = {result['after_backward_speedup_vs_hand']:.2f}x, "
        f"after / during = {result['after_backward_speedup_vs_after']:.2f}x",
        f"what remains (one read + one write): {result['during_remaining_gb_s']:.1f} GB/s = "
        f"{100 * result['during_fraction_of_bandwidth']:.0f}% of this machine's in-place scale "
        f"of one buffer of the same size ({result['scale_bandwidth_gb_s']:.1f} GB/s)",
        f"whole step, during / hand: {result['step_ratio_during_vs_hand']:.3f}",
    ]
    write_outputs("clip_pass", "\n".join(lines) + "\n", result)


if __name__ == "__main__":
    sys.exit(main())
