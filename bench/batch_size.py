"""Choosing the batch from the gradients: fixed batches vs batch ramps on the demo, and the
cost of measuring the gradient noise scale.

1. Training, same seed, data order and token budget (``--budget`` full-batch steps of
   ``--accum-steps`` micro-batches), AdamW, every run measuring B_simple (``--gns``):
   - ``small``: a fixed batch of ``--small`` micro-batches (as many more steps);
   - ``large``: the fixed full batch;
   - ``linear``: ``--batch-ramp SMALL:RAMP`` then the full batch, LR scaled by sqrt;
   - ``gns``: ``--batch-ramp gns`` (doubles while B_simple exceeds the batch), sqrt LR.
   Reported per run: optimizer steps and training tokens to the first validation at or
   below the target loss (default: the worst final validation loss of the four, which
   every run reaches), final validation loss, and B_simple over training
   (``bench/out/batch_size.png``, with the batch each run used).
2. Overhead of ``GradientNoiseScale`` on the demo model: step time with the hook / without,
   interleaved pairs on the same windows (``_common.interleaved_times``), fp32.

    .venv/bin/python bench/batch_size.py
    .venv/bin/python bench/batch_size.py --budget 20 --pairs 10   # quick

Writes ``bench/out/batch_size.md``, ``.json`` and ``.png`` (also ``docs/batch-size.png``).
Not a test: nothing is asserted.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from _common import (
    OUT,
    BaseConfig,
    interleaved_times,
    lm_window,
    machine_info,
    markdown_table,
    random_rows,
    ratio_stats,
    write_outputs,
)
from gradstep import GradientNoiseScale, Stepper
from gradstep_cli.models.gpt import GPT, GPTConfig
from gradstep_cli.train import LMLoss

DOCS = Path(__file__).resolve().parent.parent / "docs"


@dataclass(frozen=True)
class Config(BaseConfig):
    budget: int = 80
    accum_steps: int = 16
    small: int = 2
    ramp: int = 30
    micro_batch_size: int = 2
    seq_len: int = 128
    d_model: int = 96
    n_layer: int = 2
    lr: float = 3e-3
    target: float = 0.0
    pairs: int = 30
    seed: int = 0

    POSITIVE = ("budget", "accum_steps", "small", "ramp", "micro_batch_size", "pairs")
    HELP = {
        "budget": "run length in full-batch steps (the token budget of every run)",
        "target": "validation loss to reach (0: the worst final loss of the runs)",
        "ramp": "optimizer steps of the linear ramp from --small to --accum-steps",
    }

    def check(self) -> None:
        if self.small > self.accum_steps:
            raise ValueError("--small must be <= --accum-steps")


def _runs(cfg: Config) -> dict[str, dict[str, Any]]:
    small_steps = cfg.budget * cfg.accum_steps // cfg.small
    return {
        "small": {"accum_steps": cfg.small, "max_steps": small_steps},
        "large": {"accum_steps": cfg.accum_steps, "max_steps": cfg.budget},
        "linear": {"batch_ramp": f"{cfg.small}:{cfg.ramp}", "lr_scaling": "sqrt"},
        "gns": {"batch_ramp": "gns", "lr_scaling": "sqrt"},
    }


def training(cfg: Config) -> dict[str, dict[str, Any]]:
    from gradstep_cli.config.settings import TrainConfig
    from gradstep_cli.train import train

    results = {}
    for name, settings in _runs(cfg).items():
        settings = {"accum_steps": cfg.accum_steps, "max_steps": cfg.budget, **settings}
        steps_estimate = settings["max_steps"] * cfg.accum_steps // settings["accum_steps"]
        with tempfile.TemporaryDirectory() as out:
            tc = TrainConfig(
                n_layer=cfg.n_layer, n_head=4, d_model=cfg.d_model, seq_len=cfg.seq_len,
                micro_batch_size=cfg.micro_batch_size, lr=cfg.lr, min_lr=cfg.lr / 10,
                warmup=max(1, settings["max_steps"] // 10), seed=cfg.seed, gns=True,
                eval_every=max(1, steps_estimate // 25), eval_batches=16, sample_tokens=0,
                log_every=10**6, out=out, threads=0, **settings,
            )  # fmt: skip
            summary = train(tc)
            rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").open()]
        results[name] = {"settings": settings, "summary": summary, "rows": rows}
        print(f"{name}: {summary['steps']} steps, final val {summary['final_val_loss']:.4f}")
    return results


def _reach(rows: list[dict[str, Any]], target: float) -> tuple[int | None, int | None]:
    """(optimizer steps, training tokens) up to the first validation at or below ``target``."""
    tokens = 0
    for window, r in enumerate(rows, start=1):
        tokens += r["items"]
        if r.get("val_loss") is not None and r["val_loss"] <= target:
            return window, tokens
    return None, None


def training_table(results: dict[str, dict[str, Any]], target: float) -> list[dict[str, Any]]:
    table = []
    for name, res in results.items():
        rows, summary = res["rows"], res["summary"]
        steps, tokens = _reach(rows, target)
        noise = [r["gns_b_simple"] for r in rows if r.get("gns_b_simple") is not None]
        table.append({
            "run": name, "optimizer_steps": summary["steps"],
            "train_tokens": summary["train_tokens"],
            "steps_to_target": steps, "tokens_to_target": tokens,
            "final_val_loss": summary["final_val_loss"],
            "first_batch_tokens": rows[0]["items"], "last_batch_tokens": rows[-1]["items"],
            "b_simple_first": noise[0] if noise else None,
            "b_simple_last": noise[-1] if noise else None,
        })  # fmt: skip
    return table


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4.2), layout="constrained")
    ax = fig.add_subplot()
    for i, (name, res) in enumerate(results.items()):
        tokens, seen, batch, noise = 0, [], [], []
        for r in res["rows"]:
            tokens += r["items"]
            seen.append(tokens)
            batch.append(r["items"])
            b = r.get("gns_b_simple")
            noise.append(b if b is not None and b > 0 else math.nan)
        ax.plot(seen, noise, color=f"C{i}", label=f"{name}: B_simple")
        ax.plot(seen, batch, color=f"C{i}", ls=":", label=f"{name}: batch in use")
    ax.set_yscale("log")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("tokens")
    ax.set_title("Gradient noise scale B_simple (EMA) and the batch per step")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small", ncol=2)
    fig.savefig(path, dpi=110)


def overhead(cfg: Config) -> dict[str, Any]:
    """Section 2: the demo GPT (default size), 4 micro-batches of 8 x 128 per step."""
    torch.manual_seed(cfg.seed)
    windows = [lm_window(random_rows(32, 128, seed=i), 8) for i in range(cfg.pairs + 3)]

    def make(hooks: list) -> Any:
        torch.manual_seed(cfg.seed)
        model = GPT(GPTConfig(n_layer=4, n_head=4, d_model=160, max_seq_len=128))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return Stepper(model, opt, hooks=hooks), LMLoss(torch.device("cpu"))

    (with_gns, loss), (plain, _) = make([GradientNoiseScale()]), make([])
    times = interleaved_times(
        lambda i: with_gns.step(windows[i], loss), lambda i: plain.step(windows[i], loss),
        warmup=3, pairs=cfg.pairs,
    )  # fmt: skip
    return {"wall": asdict(ratio_stats(times.wall_a, times.wall_b)),
            "cpu": asdict(ratio_stats(times.cpu_a, times.cpu_b))}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    cfg, _ = Config.parse(argv, Config.parser(__doc__))
    OUT.mkdir(exist_ok=True)
    result: dict[str, Any] = {"config": asdict(cfg), "machine": machine_info()}
    md = [f"# Batch size from the gradients\n\n{json.dumps(result['machine'])}\n"]
    results = training(cfg)
    finals = [r["summary"]["final_val_loss"] for r in results.values()]
    target = cfg.target or max(finals)
    result["target_val_loss"] = target
    result["training"] = training_table(results, target)
    plot(results, OUT / "batch_size.png")
    plot(results, DOCS / "batch-size.png")
    md += [
        f"## 1. demo, d_model {cfg.d_model} x {cfg.n_layer} layers, budget {cfg.budget} full "
        f"steps of {cfg.accum_steps} x {cfg.micro_batch_size} x {cfg.seq_len} bytes; target "
        f"val loss {target:.4f}\n",
        markdown_table(result["training"]),
    ]
    result["overhead"] = overhead(cfg)
    wall, cpu = result["overhead"]["wall"], result["overhead"]["cpu"]
    md += [
        "\n## 2. GradientNoiseScale overhead: step time with / without (interleaved)\n",
        f"wall: median ratio {wall['median_ratio']:.4f} (95% CI {wall['ci95_low']:.4f}-"
        f"{wall['ci95_high']:.4f}), {wall['median_a_ms']:.1f} vs {wall['median_b_ms']:.1f} "
        f"ms; cpu: median ratio {cpu['median_ratio']:.4f}",
    ]
    write_outputs("batch_size", "\n".join(md) + "\n", result)


if __name__ == "__main__":
    sys.exit(main())
