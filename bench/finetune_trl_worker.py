"""The TRL side of bench/finetune_trl.py: one ``SFTTrainer`` run, in TRL's own venv.

``/work/trlvenv/bin/python bench/finetune_trl_worker.py SPEC.json``

It imports nothing of gradstep (TRL's venv does not have it): the spec says everything,
written by ``finetune_trl.py`` from the same recipe it gives ``gradstep train``:

* the model folder (gradstep's export of the pretrained base), loaded in float32;
* the Parquet files, read with ``datasets.load_dataset("parquet")``; TRL has no field
  mapping for prompt/completion or messages, so the columns are renamed to TRL's names
  (what a TRL user writes by hand) and the rest dropped;
* ``SFTConfig``: epochs, learning rate, ``lr_scheduler_type="linear"`` with a warm-up ratio
  (``warmup_steps`` < 1: transformers 5's spelling of ``warmup_ratio``), batch and
  accumulation, ``max_length``, seed, weight decay, clip; evaluation of the whole validation
  set every ``eval_steps`` with the best checkpoint by ``eval_loss`` kept and loaded at the
  end (``load_best_model_at_end``: gradstep's ``--keep-best val_loss`` + ``export --best``);
  ``report_to`` W&B (offline by the environment). TRL's defaults apply to the loss:
  ``completion_only_loss`` (on for prompt/completion records) and, for conversations,
  ``assistant_only_loss=True`` (TRL's default is every token; gradstep trains the assistant's
  turns). fp32 and no gradient checkpointing on both sides (TRL's defaults are bf16 and
  checkpointing): the same step, so the costs compare. ``"gradient_checkpointing": true``
  in the spec turns TRL's default checkpointing back on, ``"bf16": true`` its default bf16
  autocast (the walk's TRL runs set neither off).

Optional spec keys (``bench/throughput.py``; absent, the run is as above): ``"eval": false``
(no evaluation or checkpoint during training: ``eval_strategy="no"``, only OUT/final),
``"packing"`` / ``"packing_strategy"`` / ``"padding_free"`` (TRL's own, as ``SFTConfig``
takes them), ``"count_tokens": true`` (every training batch's positions, rows and real
tokens, counted outside the timed steps, in the result's ``batches``).

Writes OUT/final (the model, merged for LoRA, and the tokenizer) and OUT/trl_result.json:
per optimizer step the process CPU and wall seconds from ``on_step_begin`` to
``on_step_end`` (the window's forwards and backwards, clip, optimizer and scheduler step,
TRL's per-step metrics; the batches are fetched before ``on_step_begin``, as gradstep's
loop fetches its window before ``Stepper.step``), the log history and the thread count.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch


def _step_timer() -> Any:
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.wall: list[float] = []
            self.cpu: list[float] = []
            self.thread_cpu: list[float] = []
            self.sys: list[float] = []
            self.threads: set[int] = set()
            self._t = (0.0, 0.0, 0.0, 0.0)

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            self._t = (time.perf_counter(), time.process_time(), time.thread_time(),
                       os.times().system)  # fmt: skip

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            self.wall.append(time.perf_counter() - self._t[0])
            self.cpu.append(time.process_time() - self._t[1])
            self.thread_cpu.append(time.thread_time() - self._t[2])
            self.sys.append(os.times().system - self._t[3])
            self.threads.add(torch.get_num_threads())

    return StepTimer()


def _datasets(spec: dict) -> tuple[Any, Any]:
    """The Parquet files as TRL's columns: {prompt, completion} or {messages}."""
    from datasets import load_dataset

    files = {"train": spec["train"], "validation": spec["val"]}
    data = load_dataset("parquet", data_files=files)
    rename = {theirs: ours for ours, theirs in spec["fields"].items()}
    data = data.rename_columns(rename)
    keep = set(rename.values())
    data = data.remove_columns([c for c in data["train"].column_names if c not in keep])
    return data["train"], data["validation"]


def _eval_args(spec: dict) -> dict[str, Any]:
    """SFTConfig's evaluation and checkpoint settings: the best of every ``eval_steps``
    (the default), or none (``"eval": false``)."""
    if not spec.get("eval", True):
        return {"eval_strategy": "no", "save_strategy": "no", "load_best_model_at_end": False}
    return {"eval_strategy": "steps", "eval_steps": spec["eval_steps"],
            "save_strategy": "steps", "save_steps": spec["eval_steps"], "save_total_limit": 1,
            "load_best_model_at_end": True, "metric_for_best_model": "eval_loss",
            "greater_is_better": False}  # fmt: skip


def _packing_args(spec: dict) -> dict[str, Any]:
    """TRL's packing settings the spec names (none: TRL's defaults, padded batches)."""
    keys = ("packing", "packing_strategy", "padding_free")
    return {k: spec[k] for k in keys if k in spec}


class TokenCounter:
    """Wraps the training collator: each batch's positions (``input_ids`` elements), rows,
    sequences, tokens (padded rows' ``attention_mask``; every position of a padding-free
    row, its sequences counted by their ``position_ids`` restarts) and real tokens, where a
    sequence of n tokens counts n - 1 (the positions that predict one of its tokens)."""

    def __init__(self, collate: Any) -> None:
        self.collate = collate
        self.batches: list[dict[str, int]] = []

    def __call__(self, examples: Any) -> Any:
        batch = self.collate(examples)
        ids = batch["input_ids"]
        if "attention_mask" in batch:
            mask = batch["attention_mask"]
            tokens, seqs = int(mask.sum()), int((mask.sum(-1) > 0).sum())
        else:  # padding-free: one row, sequences restarting at position 0
            tokens, seqs = ids.numel(), int((batch["position_ids"] == 0).sum())
        self.batches.append({"positions": ids.numel(), "rows": ids.shape[0], "tokens": tokens,
                             "sequences": seqs, "real": tokens - seqs})  # fmt: skip
        return batch


def _config(spec: dict) -> Any:
    """The spec as TRL's ``SFTConfig``."""
    from trl import SFTConfig

    out = Path(spec["out"])
    return SFTConfig(
        output_dir=str(out / "trainer"), run_name=out.name, seed=spec["seed"],
        num_train_epochs=spec["epochs"], learning_rate=spec["lr"],
        lr_scheduler_type="linear", warmup_steps=spec["warmup_ratio"],
        per_device_train_batch_size=spec["micro_batch"],
        per_device_eval_batch_size=spec["micro_batch"],
        gradient_accumulation_steps=spec["accum"], max_length=spec["max_length"],
        weight_decay=0.0, max_grad_norm=1.0, bf16=spec.get("bf16", False),
        gradient_checkpointing=spec.get("gradient_checkpointing", False),
        assistant_only_loss=spec["format"] == "chat", **_eval_args(spec), **_packing_args(spec),
        logging_steps=spec["logging_steps"], report_to=spec["report_to"],
        use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
        model_init_kwargs={"dtype": torch.float32},
    )  # fmt: skip


def run(spec: dict) -> dict:
    from trl import SFTTrainer

    threads = spec["threads"]
    torch.set_num_threads(threads)
    out = Path(spec["out"])
    train, val = _datasets(spec)
    evaluate = spec.get("eval", True)
    args = _config(spec)
    peft_config = None
    if spec["lora"]:
        from peft import LoraConfig

        peft_config = LoraConfig(r=spec["lora"], lora_alpha=spec["lora_alpha"], lora_dropout=0.0,
                                 target_modules="all-linear", task_type="CAUSAL_LM")  # fmt: skip
    timer = _step_timer()
    start_cpu = time.process_time()
    trainer = SFTTrainer(model=spec["model"], args=args, train_dataset=train,
                         eval_dataset=val if evaluate else None,
                         peft_config=peft_config, callbacks=[timer])  # fmt: skip
    counter = None
    if spec.get("count_tokens"):  # training batches only when nothing evaluates meanwhile
        counter = trainer.data_collator = TokenCounter(trainer.data_collator)
    setup_cpu = time.process_time() - start_cpu
    t0, c0 = time.perf_counter(), time.process_time()
    trainer.train()
    train_wall, train_cpu = time.perf_counter() - t0, time.process_time() - c0
    model = trainer.model
    if spec["lora"]:
        model = model.merge_and_unload()
    final = out / "final"
    model.save_pretrained(final)
    trainer.processing_class.save_pretrained(final)
    state = trainer.state
    return {
        "cpu_s": timer.cpu, "step_s": timer.wall, "thread_cpu_s": timer.thread_cpu,
        "sys_s": timer.sys, "threads": sorted(timer.threads),
        "steps": state.global_step, "max_steps": state.max_steps,
        "best_checkpoint": state.best_model_checkpoint, "best_metric": state.best_metric,
        "train_cpu_s": train_cpu, "train_wall_s": train_wall, "setup_cpu_s": setup_cpu,
        "completion_only_loss": getattr(trainer, "completion_only_loss", None),
        "assistant_only_loss": args.assistant_only_loss,
        "warmup_steps": args.get_warmup_steps(state.max_steps),
        "gradient_checkpointing": args.gradient_checkpointing, "bf16": args.bf16,
        "log_history": state.log_history,
        "train_records": len(train), "val_records": len(val),
        "padding_free": getattr(trainer, "padding_free", None),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        **({"batches": counter.batches} if counter is not None else {}),
    }  # fmt: skip


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    result = run(spec)
    Path(spec["out"], "trl_result.json").write_text(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main(sys.argv[1:]))
