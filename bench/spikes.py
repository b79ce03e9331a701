"""Loss-spike defence: fixed vs adaptive clipping on the demo model with injected spikes.

Trains a small byte-level GPT (the demo model) at a deliberately high AdamW learning rate;
every ``--every`` steps one micro-batch of the window has its loss multiplied by
``--factor`` (1e3: a corrupted batch, the gradient of one micro-batch blown up 1000x).
Same seed, data order and initialisation for each clip setting:

    none | ClipNorm(1.0) | AutoClip() | ZClip() | SpikeGuard() + ZClip()

plus ClipNorm(1.0) without injected spikes, as the reference of what the spikes cost.

Reported per run: final validation loss, the number of loss spikes (a step whose CLEAN
training loss, i.e. without the injected factor, is > 1.5x the median of the previous 20
steps), whether the run diverged (non-finite loss, or final val loss above the initial
one), clipped and skipped steps. Outputs: a markdown table printed and written to
``bench/out/spikes.md``, the curves in ``bench/out/spikes.json``, a PNG of the loss curves
in ``bench/out/spikes.png``, copied to ``docs/spikes.png``.

    .venv/bin/python bench/spikes.py              # 12 runs, ~2 min on 2 idle CPU cores
    .venv/bin/python bench/spikes.py --steps 100  # quick look

Not a test: nothing is asserted; the numbers are for the README.
"""

from __future__ import annotations

import functools
import json
import math
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

import gradstep
from _common import BaseConfig, lm_loss
from gradstep.policies import AutoClip, SpikeGuard, ZClip
from gradstep_cli.config.settings import TrainConfig
from gradstep_cli.data.sources import Batch, TrainBatches, load_corpus, validation_batches
from gradstep_cli.models.gpt import GPT, GPTConfig
from gradstep_cli.train import WarmupCosine, build_optimizer, evaluate

ROOT = Path(__file__).resolve().parent.parent
SPIKE_RATIO = 1.5  # a loss spike: loss > 1.5x the rolling median
SPIKE_WINDOW = 20  # ... of the previous 20 steps
SMOOTH = 5  # the plotted loss is a trailing mean over 5 steps
WARMUP = 10  # steps of linear learning-rate warm-up

SETTINGS: dict[str, Callable[[], object]] = {
    "none": lambda: None,
    "ClipNorm(1.0)": lambda: gradstep.ClipNorm(1.0),
    "AutoClip()": lambda: AutoClip(),
    "ZClip()": lambda: ZClip(),
    "SpikeGuard() + ZClip()": lambda: [SpikeGuard(), ZClip()],
}
REFERENCE = "ClipNorm(1.0), no injection"  # what the spikes cost


@dataclass(frozen=True)
class BenchConfig(BaseConfig):
    steps: int = 300
    lr: float = 3e-2
    every: int = 50
    factor: float = 1e3
    seeds: tuple[int, ...] = (0, 1)
    n_layer: int = 2
    d_model: int = 64
    n_head: int = 2
    seq_len: int = 64
    micro_batch_size: int = 8
    accum_steps: int = 2
    eval_batches: int = 16
    corpus_bytes: int = 1_000_000

    POSITIVE = ("steps", "every", "n_layer", "d_model", "n_head", "seq_len",
                "micro_batch_size", "accum_steps", "eval_batches", "corpus_bytes")  # fmt: skip

    def check(self) -> None:
        if self.steps < WARMUP:
            raise ValueError(f"--steps must be >= {WARMUP} (the warm-up), got {self.steps}")
        if not self.seeds:
            raise ValueError("--seeds needs at least one seed")


class SpikyLoss:
    """Token loss; the first micro-batch of a poisoned window is scaled by ``factor``.

    Also sums the CLEAN loss (without the factor) of the window, so spikes are counted on
    what the model actually does, not on the injected number.
    """

    def __init__(self) -> None:
        self.pending_factor = 1.0
        self.clean_sum = 0.0
        self.clean_count = 0

    def start_window(self, factor: float) -> None:
        self.pending_factor, self.clean_sum, self.clean_count = factor, 0.0, 0

    def __call__(self, model: nn.Module, mb: Batch) -> gradstep.LossSum:
        total, count = lm_loss(model, mb)
        self.clean_sum += float(total.detach())
        self.clean_count += int(count)
        factor, self.pending_factor = self.pending_factor, 1.0
        return gradstep.LossSum(total * factor if factor != 1.0 else total, count)

    @property
    def clean_loss(self) -> float:
        return self.clean_sum / self.clean_count if self.clean_count else math.nan


@dataclass
class RunResult:
    name: str
    initial_val: float
    final_val: float = math.nan
    diverged: bool = False
    loss_spikes: int = 0
    clipped: int = 0
    skipped: int = 0
    seconds: float = 0.0
    seed: int = 0
    loss: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    skipped_at: list[int] = field(default_factory=list)


def injected_steps(cfg: BenchConfig) -> range:
    """Every ``every`` steps, never the last one (its damage could not show)."""
    return range(cfg.every, cfg.steps, cfg.every)


def count_spikes(losses: list[float]) -> int:
    """Steps whose loss exceeds SPIKE_RATIO x the median of the previous SPIKE_WINDOW steps."""
    spikes = 0
    for t in range(SPIKE_WINDOW, len(losses)):
        med = statistics.median(losses[t - SPIKE_WINDOW : t])
        spikes += int(losses[t] > SPIKE_RATIO * med)
    return spikes


def run_one(name: str, cfg: BenchConfig, seed: int, corpus, val: list[Batch]) -> RunResult:
    """One training run; ``name`` is a key of SETTINGS, or REFERENCE (no injection)."""
    inject = name != REFERENCE
    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=cfg.n_layer, n_head=cfg.n_head, d_model=cfg.d_model,
                          max_seq_len=cfg.seq_len))  # fmt: skip
    # The demo trainer's optimizer and schedule (AdamW, decay on matrices, warmup + cosine).
    train_cfg = TrainConfig(lr=cfg.lr, min_lr=cfg.lr / 10, warmup=WARMUP, max_steps=cfg.steps)
    optimizer = build_optimizer(model, train_cfg)
    schedule = WarmupCosine(train_cfg.warmup, cfg.steps, 0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    clip = SETTINGS[name if inject else "ClipNorm(1.0)"]()
    stepper = gradstep.Stepper(model, optimizer, scheduler, clip=clip)
    batches = TrainBatches(corpus.train, cfg.seq_len, cfg.micro_batch_size, seed)
    loss_fn = SpikyLoss()
    result = RunResult(name, initial_val=evaluate(model, val, torch.device("cpu")), seed=seed)
    started = time.perf_counter()
    for step, window in enumerate(gradstep.windows(batches, cfg.accum_steps), start=1):
        if step > cfg.steps:
            break
        loss_fn.start_window(cfg.factor if inject and step in injected_steps(cfg) else 1.0)
        stats = stepper.step(window, loss_fn)
        result.loss.append(loss_fn.clean_loss)
        result.grad_norm.append(stats.grad_norm)
        if stats.skipped:
            result.skipped_at.append(step)
        if not (math.isfinite(loss_fn.clean_loss) and math.isfinite(stats.grad_norm)):
            result.diverged = True
            break
    result.seconds = time.perf_counter() - started
    result.clipped, result.skipped = stepper.clipped_steps, stepper.skipped_steps
    if not result.diverged:
        result.final_val = evaluate(model, val, torch.device("cpu"))
        result.diverged = not result.final_val < result.initial_val
    result.loss_spikes = count_spikes(result.loss)
    return result


def _per_seed(runs: list[RunResult], fmt: Callable[[RunResult], str]) -> str:
    return " / ".join(fmt(r) for r in runs)


def markdown(results: list[RunResult], cfg: BenchConfig) -> str:
    seeds = sorted({r.seed for r in results})
    lines = [
        f"Demo GPT ({cfg.n_layer} layers, d_model {cfg.d_model}), AdamW lr {cfg.lr:g} "
        f"(warmup {WARMUP}, cosine), {cfg.steps} steps of {cfg.accum_steps} x "
        f"{cfg.micro_batch_size} sequences of <= {cfg.seq_len} bytes; at steps "
        f"{', '.join(map(str, injected_steps(cfg)))} one micro-batch's loss x {cfg.factor:g}. "
        f"Seeds {', '.join(map(str, seeds))}: values are per seed.",
        "",
        "| clip | final val loss | mean | loss spikes | diverged | clipped steps | skipped steps |",
        "|---|---|---:|---|---|---|---|",
    ]
    for name in [*SETTINGS, REFERENCE]:
        runs = [r for r in results if r.name == name]
        if not runs:
            continue
        per = functools.partial(_per_seed, runs)
        mean_val = statistics.fmean(r.final_val for r in runs)
        lines.append(
            f"| {name} | {per(lambda r: f'{r.final_val:.3f}')} | {mean_val:.3f} | "
            f"{per(lambda r: str(r.loss_spikes))} | "
            f"{per(lambda r: 'yes' if r.diverged else 'no')} | "
            f"{per(lambda r: str(r.clipped))} | {per(lambda r: str(r.skipped))} |"
        )
    lines += [
        "",
        f"Initial val loss {results[0].initial_val:.3f}. Loss spike: clean train loss (the "
        f"injected factor left out) > {SPIKE_RATIO}x the median of the previous "
        f"{SPIKE_WINDOW} steps. Diverged: non-finite loss or final val loss >= initial.",
    ]
    return "\n".join(lines) + "\n"


def plot(results: list[RunResult], cfg: BenchConfig, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seed = min(r.seed for r in results)
    shown = [r for r in results if r.seed == seed]
    fig, (ax_loss, ax_norm) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for r in shown:
        steps = range(1, len(r.loss) + 1)
        style = {"ls": "--", "color": "grey"} if r.name == REFERENCE else {}
        # Trailing mean over SMOOTH steps: the raw per-step loss is too noisy to compare.
        smooth = [statistics.fmean(r.loss[max(0, t - SMOOTH) : t]) for t in steps]
        label = f"{r.name} (val {r.final_val:.3f})"
        ax_loss.plot(steps, smooth, label=label, lw=1.2, **style)
        ax_norm.plot(steps, r.grad_norm, lw=1, **style)
    for ax in (ax_loss, ax_norm):
        for s in injected_steps(cfg):
            ax.axvline(s, color="grey", lw=0.6, ls=":")
    ax_loss.set_ylabel(f"train loss (clean, mean of {SMOOTH} steps)")
    ax_loss.set_ylim(bottom=2.0, top=4.5)
    ax_loss.legend(fontsize=8)
    ax_loss.set_title(f"Loss x{cfg.factor:g} on one micro-batch at the dotted steps (seed {seed})")
    ax_norm.set_yscale("log")
    ax_norm.set_ylabel("pre-clip grad norm")
    ax_norm.set_xlabel("optimizer step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = BenchConfig.parser(__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "out"))
    parser.add_argument("--no-docs", action="store_true", help="do not copy the PNG to docs/")
    cfg, args = BenchConfig.parse(argv, parser)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus(None, max_bytes=cfg.corpus_bytes)
    val = validation_batches(corpus.val, cfg.seq_len, cfg.micro_batch_size, cfg.eval_batches)
    results = []
    for seed in cfg.seeds:
        for name in [*SETTINGS, REFERENCE]:
            r = run_one(name, cfg, seed, corpus, val)
            print(
                f"seed {seed} {name:26s} val {r.final_val:.4f}  spikes {r.loss_spikes}  "
                f"diverged {r.diverged}  clipped {r.clipped}  skipped {r.skipped_at}  "
                f"({r.seconds:.0f}s)",
                file=sys.stderr,
            )
            results.append(r)
    table = markdown(results, cfg)
    print(table)
    (out / "spikes.md").write_text(table)
    (out / "spikes.json").write_text(
        json.dumps({"config": asdict(cfg), "runs": [asdict(r) for r in results]}) + "\n"
    )
    plot(results, cfg, out / "spikes.png")
    if not args.no_docs:
        (ROOT / "docs").mkdir(exist_ok=True)
        shutil.copyfile(out / "spikes.png", ROOT / "docs" / "spikes.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
