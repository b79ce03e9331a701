"""The end of a ``gradstep train`` run: ``summary.json`` and the lines printed."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from gradstep import parallel
from gradstep_cli.models.gpt import generate, generate_ids
from gradstep_cli.models.hf import LogitsOnly
from gradstep_cli.run.samples import decode

__all__ = ["SAMPLE_PROMPT", "build", "existing", "final_losses", "show"]

SAMPLE_PROMPT = b"def "


def final_losses(progress: Any, steps: int, val_loss: float) -> dict[str, Any]:
    """The loop's losses and throughput from its totals (``train``'s progress); the final
    train loss is the token-weighted mean of the recent steps' finite losses."""
    finite = [(loss, items) for loss, items in progress.recent if math.isfinite(loss)]
    recent_tokens = sum(items for _, items in finite)
    final_train = sum(lo * it for lo, it in finite) / recent_tokens if recent_tokens else math.nan
    return {
        "steps": steps,
        "initial_val_loss": progress.initial_val_loss,
        "final_val_loss": val_loss,
        "final_train_loss": final_train,
        "train_tokens": progress.tokens,
        "train_tokens_per_s": progress.tokens / max(progress.step_time, 1e-9),
    }


def build(run: Any, losses: dict[str, Any], started: float) -> dict[str, Any]:
    """The run's ``summary.json``: losses, batch, events, wall time and a sample."""
    cfg, stepper = run.cfg, run.stepper
    layout = run.layout
    effective = layout.stream_items_per_window * layout.stream_rows * run.data_ranks
    return {
        **losses,
        "parameters": sum(p.numel() for p in parallel.unwrap(run.model).parameters()),
        "trainable_parameters": sum(
            p.numel() for p in parallel.unwrap(run.model).parameters() if p.requires_grad
        ),
        "strategy": cfg.strategy,
        "world_size": run.world_size,
        "data_parallel_size": run.data_ranks,
        "tp": cfg.tp,
        "hsdp": cfg.hsdp,
        "effective_batch_sequences": effective,
        "packing": cfg.packing,
        "max_tokens_per_step": effective * cfg.seq_len,
        "mean_tokens_per_step": losses["train_tokens"] / max(losses["steps"], 1),
        "clipped_steps": stepper.clipped_steps,
        "skipped_steps": stepper.skipped_steps,
        "skip_reasons": dict(stepper.skip_reasons),
        "wall_time_s": time.perf_counter() - started,
        "corpus": run.source.describe(),
        "sample_prompt": SAMPLE_PROMPT.decode(),
        "sample": _sample(run) if cfg.sample_tokens else "",
    }


def _sample(run: Any) -> str:
    """``--sample-tokens`` tokens after the prompt: encoded and decoded with the run's
    tokenizer when it has one, else bytes (the demo GPT, an HF model without tokenizer)."""
    cfg, tokenizer = run.cfg, getattr(run, "tokenizer", None)
    gen = torch.Generator().manual_seed(cfg.seed)
    # Every rank generates (FSDP2's forward needs them all); the same seed and weights
    # give the same sample, and rank 0 reports it.
    model = parallel.unwrap(run.model)
    if not cfg.is_hf:
        return generate(model, SAMPLE_PROMPT, cfg.sample_tokens, 0.8, 40, gen).decode(
            "utf-8", errors="replace"
        )
    # The context stays within the trained length (models with learned positions index
    # past their table beyond max_position_embeddings >= seq_len).
    sampler, text = LogitsOnly(model), SAMPLE_PROMPT.decode()
    prompt = list(SAMPLE_PROMPT) if tokenizer is None else tokenizer(text)["input_ids"]
    new = generate_ids(sampler, prompt, cfg.sample_tokens, 0.8, 40, gen, max_len=cfg.seq_len)
    return decode(new, tokenizer)  # as --sample-prompts' samples are


def _parameters(summary: dict[str, Any]) -> str:
    """The parameter count, with how many of them train (fewer with --lora's frozen base)."""
    total, trainable = summary["parameters"], summary["trainable_parameters"]
    if trainable == total:
        return f"{total:,} parameters, all trainable"
    return f"{total:,} parameters, {trainable:,} trainable ({100 * trainable / total:.2f}%)"


def _throughput(summary: dict[str, Any]) -> str:
    """Trained (target) tokens per second, and every position processed (prompt, padding)."""
    text = f"{summary['train_tokens_per_s']:,.0f} trained tok/s"
    if summary.get("processed_tokens_per_s") is not None:
        text += f", {summary['processed_tokens_per_s']:,.0f} processed tok/s"
    return text


def _ranks(summary: dict[str, Any]) -> str:
    """The launch: ranks and strategy, and the 2-D mesh when there is one."""
    text = f"{summary['world_size']} rank(s), strategy {summary['strategy']}"
    tp, hsdp = summary.get("tp", 1), summary.get("hsdp", 1)
    if tp > 1:
        return f"{text}: {summary['data_parallel_size']} data-parallel x {tp} tensor-parallel"
    return f"{text}: HSDP, {hsdp} replicas" if hsdp > 1 else text


def show(summary: dict[str, Any]) -> None:
    """The summary as the few lines printed at the end of a run."""
    print(
        f"\n{summary['steps']} steps in {summary['wall_time_s']:.1f}s "
        f"({_throughput(summary)} while stepping), "
        f"{_parameters(summary)}\n"
        f"effective batch: {summary['effective_batch_sequences']} "
        f"{'packed rows' if summary.get('packing') else 'sequences'} "
        f"({_ranks(summary)}), <= "
        f"{summary['max_tokens_per_step']:,} tokens/step "
        f"(mean {summary['mean_tokens_per_step']:,.0f} real tokens)\n"
        f"val loss: {summary['initial_val_loss']:.4f} -> {summary['final_val_loss']:.4f}   "
        f"train loss (last steps): {summary['final_train_loss']:.4f}\n"
        f"clipped steps: {summary['clipped_steps']}   skipped steps: {summary['skipped_steps']}"
    )
    for line in _evaluation_lines(summary):
        print(line)
    if summary.get("compile_seconds") is not None:
        print(
            f"compile: {summary['compile_seconds']:.1f}s (--compile: the first step's time "
            "beyond the median step's)"
        )
    if summary["sample"]:
        print(f"--- sample ---\n{summary['sample_prompt']}{summary['sample']}\n--------------")


def _evaluation_lines(summary: dict[str, Any]) -> list[str]:
    """The last evaluation's accuracy and size, the best checkpoint, an early stop."""
    lines = []
    if summary.get("val_items") is not None:
        lines.append(
            f"val accuracy: {summary['final_val_accuracy']:.4f}   val entropy: "
            f"{summary['final_val_entropy']:.4f}   scored: {summary['val_records']:,} "
            f"records, {summary['val_items']:,} tokens"
        )
    best = summary.get("best")
    if best and best.get("step") is not None:
        lines.append(
            f"best {best['metric']}: {best['value']:.4f} at step {best['step']} "
            f"(checkpoints/{best['checkpoint']}: gradstep export RUN --best)"
        )
    if summary.get("stopped_early"):
        lines.append(f"stopped early at step {summary['steps']} (--early-stopping-patience)")
    return lines


def existing(out: Path) -> dict[str, Any]:
    """A finished run's summary.json (empty when it has none)."""
    try:
        return json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
