"""gradstep vs transformers.Trainer(gradient_accumulation_steps=k), side by side.

Both sides get the same tiny model (random init, same seed), the same micro-batches in the
same order (sequential sampler, same collator: right padding, unshifted labels), the same
AdamW and linear warm-up schedule (built once here and handed to the Trainer), and the
same clip (max_grad_norm vs ClipNorm). Reported per model: relative differences of the
logged loss, the pre-clip grad norm and the parameters after N steps (relative to how far
the parameters moved), and the training wall-time ratio gradstep / Trainer.

MoE (Mixtral, router loss on): the Trainer adds coef * aux_loss to every micro-batch's loss
unscaled while it normalises the CE by the window's token count, so the aux term weighs k
times its mean. gradstep runs twice: with the coefficient (aux = mean over micro-batches)
and with k x the coefficient: the Trainer agrees with the second.

Run: python bench/hf.py [--steps 6 --k 4 --rows 2]; writes bench/out/hf.md and hf.json.
"""

from __future__ import annotations

import copy
import json
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import gradstep
from _common import BaseConfig, machine_info
from gradstep.hf import causal_lm_loss, count_tokens

OUT = Path(__file__).resolve().parent / "out"


@dataclass(frozen=True)
class Config(BaseConfig):
    steps: int = 6
    k: int = 4
    rows: int = 2
    max_len: int = 48
    lr: float = 3e-3
    warmup: int = 2
    clip: float = 1.0
    coef: float = 0.02
    seed: int = 0
    POSITIVE = ("steps", "k", "rows", "max_len")


def _model(kind: str, cfg: Config, coef: float | None = None) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    shape = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=False,
    )  # fmt: skip
    torch.manual_seed(cfg.seed)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**shape))
    moe = MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2,
                        output_router_logits=True, router_aux_loss_coef=coef)  # fmt: skip
    return MixtralForCausalLM(moe)


def _samples(cfg: Config) -> list[dict[str, list[int]]]:
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    n = cfg.steps * cfg.k * cfg.rows
    lengths = torch.randint(2, cfg.max_len + 1, (n,), generator=gen).tolist()
    return [{"input_ids": torch.randint(0, 64, (m,), generator=gen).tolist()} for m in lengths]


def collate(rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, : len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _optim(model: torch.nn.Module, cfg: Config) -> tuple[Any, Any]:
    from transformers import get_scheduler

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    return opt, get_scheduler("linear", opt, cfg.warmup, cfg.steps)


def run_trainer(model: torch.nn.Module, samples: list, cfg: Config) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=cfg.rows,
            gradient_accumulation_steps=cfg.k, max_steps=cfg.steps, max_grad_norm=cfg.clip,
            logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
            train_sampling_strategy="sequential", dataloader_num_workers=0, disable_tqdm=True,
            remove_unused_columns=False, seed=cfg.seed,
        )  # fmt: skip
        trainer = Trainer(
            model=model, args=args, train_dataset=samples, data_collator=collate,
            optimizers=_optim(model, cfg),
        )  # fmt: skip
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
    logs = [h for h in trainer.state.log_history if "grad_norm" in h]
    return {"loss": [h["loss"] for h in logs], "norm": [h["grad_norm"] for h in logs],
            "wall": wall, "params": _params(model)}  # fmt: skip


def run_gradstep(
    model: torch.nn.Module, samples: list, cfg: Config, aux_coef: float | None = None
) -> dict[str, Any]:
    opt, sched = _optim(model, cfg)
    stepper = gradstep.Stepper(model, opt, sched, clip=gradstep.ClipNorm(cfg.clip))
    batches = [collate(samples[i : i + cfg.rows]) for i in range(0, len(samples), cfg.rows)]
    loss_fn = lambda m, b: causal_lm_loss(m, b, aux_coef=aux_coef)  # noqa: E731
    model.train()
    losses, norms, aux = [], [], []
    t0 = time.perf_counter()
    for window in gradstep.windows(batches, cfg.k):
        stats = stepper.step(window, loss_fn, count=count_tokens)
        losses.append(stats.loss + sum(stats.aux.values()))  # the Trainer logs CE + aux
        norms.append(stats.grad_norm)
        aux.append(stats.aux.get("router"))
    wall = time.perf_counter() - t0
    return {"loss": losses, "norm": norms, "aux": aux, "wall": wall, "params": _params(model)}


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _param_rel(a: dict, b: dict, start: dict) -> float:
    diff = sum(float((a[k] - b[k]).square().sum()) for k in b)
    moved = sum(float((b[k] - start[k]).square().sum()) for k in b)
    return (diff / moved) ** 0.5


def compare(kind: str, cfg: Config) -> list[dict[str, Any]]:
    samples = _samples(cfg)
    coef = cfg.coef if kind == "mixtral" else None
    base = _model(kind, cfg, coef)
    start = _params(base)
    hf = run_trainer(copy.deepcopy(base), samples, cfg)
    rows = []
    variants = [("gradstep", None)] + ([("gradstep, aux x k", cfg.k * cfg.coef)] if coef else [])
    for name, aux_coef in variants:
        gs = run_gradstep(copy.deepcopy(base), samples, cfg, aux_coef)
        rows.append({
            "model": kind, "gradstep": name,
            "loss_max_rel_diff": _max_rel(gs["loss"], hf["loss"]),
            "grad_norm_max_rel_diff": _max_rel(gs["norm"], hf["norm"]),
            "params_rel_diff": _param_rel(gs["params"], hf["params"], start),
            "time_ratio": gs["wall"] / hf["wall"],
            "router_aux_mean": None if gs["aux"][0] is None else sum(gs["aux"]) / len(gs["aux"]),
        })  # fmt: skip
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    keys = list(rows[0])
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    return "\n".join(lines + ["| " + " | ".join(fmt(r[k]) for k in keys) + " |" for r in rows])


def main(argv: list[str] | None = None) -> None:
    cfg, _ = Config.parse(argv, Config.parser(__doc__))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    rows = compare("llama", cfg) + compare("mixtral", cfg)
    result = {"config": asdict(cfg), "machine": machine_info(), "rows": rows}
    md = f"# gradstep vs transformers.Trainer\n\n{json.dumps(result['machine'])}\n\n{_table(rows)}"
    print(md, flush=True)
    OUT.mkdir(exist_ok=True)
    (OUT / "hf.md").write_text(md + "\n")
    (OUT / "hf.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
