"""The two fine-tuning runs of bench/finetune.py, each in a process of its own.

``python bench/finetune_workers.py gradstep RECORD ARGS...``
    ``gradstep train ARGS...`` (the CLI's own entry point, ``gradstep_cli.cli.main``), with
    each ``Stepper.step`` also timed in process CPU seconds, written to RECORD (JSON list).
``python bench/finetune_workers.py trainer RUN_DIR OUT VARIANT STEPS``
    ``transformers.Trainer`` on the very rows the gradstep run RUN_DIR trained on, in its
    order, left-padded as Trainer users pad a decoder; writes the model to OUT and
    ``OUT/trainer_result.json`` (step times wall and CPU, logged losses and grad norms).

Both workers import only what their run needs, so a peak RSS measured around either
process is that trainer's, not this benchmark's.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from finetune_data import IGNORE, Pair, encode_pair

# ----------------------------------------------------------------------------- the gradstep side


def gradstep_worker(record: Path, argv: list[str]) -> int:
    """Run ``gradstep train *argv`` in this process, recording each ``Stepper.step``'s
    process CPU time (the interval of its ``step_time_s``) to ``record``: on a shared
    machine wall time mostly measures the load, CPU time the work."""
    import gradstep
    from gradstep_cli.cli import main as cli_main

    cpu: list[float] = []
    step = gradstep.Stepper.step

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.process_time()
        try:
            return step(self, *args, **kwargs)
        finally:
            cpu.append(time.process_time() - start)

    gradstep.Stepper.step = timed  # type: ignore[method-assign]
    status = cli_main(["train", *argv])
    record.write_text(json.dumps(cpu))
    return status


# ----------------------------------------------------------------------------- the Trainer's data


def gradstep_windows(cfg: Any) -> list[list[dict[str, torch.Tensor]]]:
    """The windows ``gradstep train`` with ``cfg`` trains on, in order: its own data stream
    (``load_source`` -> ``train_batches``), built as its ``_setup`` builds it."""
    from gradstep_cli.data.batching import layout_for, windows_of
    from gradstep_cli.data.sources import load_source
    from gradstep_cli.models.hf import load_tokenizer

    source = load_source(cfg, load_tokenizer(cfg))
    layout = layout_for(cfg, 1)
    stream = source.train_batches(cfg.seq_len, layout.stream_rows, cfg.seed, 0, 1)
    return list(itertools.islice(windows_of(stream, layout), cfg.max_steps))


def unpadded_rows(batch: dict[str, torch.Tensor]) -> list[dict[str, list[int]]]:
    """gradstep's right-padded rows (shifted labels) as HF features: the record's tokens
    and unshifted labels (``labels[t]`` is token ``t`` or -100). A record ends with its
    trained EOS, so the last trained shifted label marks its end."""
    rows = []
    for ids, shifted in zip(batch["input_ids"], batch["labels"], strict=True):
        n = int((shifted != IGNORE).nonzero()[-1]) + 1
        tokens = [*ids[:n].tolist(), int(shifted[n - 1])]
        rows.append({"input_ids": tokens, "labels": [IGNORE, *shifted[:n].tolist()]})
    return rows


def check_same_records(rows: list[dict], pairs_path: Path, tokenizer: Any) -> int:
    """Every row gradstep trained on is a pair of ``pairs_path`` encoded the Trainer user's
    way (:func:`finetune_data.encode_pair`), targets included; returns how many distinct."""
    known = set()
    for line in pairs_path.open():
        obj = json.loads(line)
        ids, target = encode_pair(tokenizer, Pair(obj["id"], obj["prompt"], obj["completion"]))
        known.add((tuple(ids), tuple(t if m else IGNORE for t, m in zip(ids, target, strict=True))))
    seen = {(tuple(r["input_ids"]), tuple(r["labels"])) for r in rows}
    missing = seen - known
    if missing:
        raise AssertionError(f"{len(missing)} of gradstep's rows are no record of {pairs_path}")
    return len(seen)


def collator(tokenizer: Any, variant: str) -> Any:
    """Left padding (pad = EOS), -100 label padding (TRL-style labels: the rows' own);
    ``pad-id``: then also DataCollatorForLanguageModeling's rule
    ``labels[labels == pad_token_id] = -100``, which with pad = EOS drops every EOS target."""
    from transformers import DataCollatorForSeq2Seq

    tokenizer.pad_token = tokenizer.eos_token  # the tokenizer has none: the usual recipe
    tokenizer.padding_side = "left"
    seq2seq = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE)

    def collate(features: list[dict]) -> dict[str, torch.Tensor]:
        batch = seq2seq(features)
        if variant == "pad-id":
            batch["labels"][batch["labels"] == tokenizer.pad_token_id] = IGNORE
        return batch

    return collate


# ----------------------------------------------------------------------------- the Trainer


def _step_timer() -> Any:
    """A TrainerCallback timing each optimizer step, wall and CPU seconds: the window's
    forwards and backwards, clip, optimizer and scheduler step (the Trainer fetches the
    window's batches before ``on_step_begin``, as gradstep's loop does before its step)."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        wall: list[float]
        cpu: list[float]

        def __init__(self) -> None:
            self.wall, self.cpu, self._t = [], [], (0.0, 0.0)

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            self._t = (time.perf_counter(), time.process_time())

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            self.wall.append(time.perf_counter() - self._t[0])
            self.cpu.append(time.process_time() - self._t[1])

    return StepTimer()


def _trainer_model(cfg: Any, path: str) -> Any:
    """The pretrained model as a Trainer user loads it (+ PEFT LoRA as gradstep's --lora:
    same rank, alpha, dropout, targets, and the same seed before PEFT draws A)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if not cfg.lora:
        return model
    from peft import LoraConfig, get_peft_model

    alpha = cfg.lora_alpha if cfg.lora_alpha is not None else 2.0 * cfg.lora
    lora = LoraConfig(r=cfg.lora, lora_alpha=alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=cfg.lora_targets)  # fmt: skip
    return get_peft_model(model, lora)


def _arguments(cfg: Any, out: Path) -> Any:
    """TrainingArguments of gradstep's run: micro-batch, accumulation, steps, clip, seed."""
    from transformers import TrainingArguments

    if not cfg.clip.startswith("norm"):
        raise ValueError(f"the bench compares ClipNorm runs, got --clip {cfg.clip}")
    return TrainingArguments(
        output_dir=str(out / "trainer"), per_device_train_batch_size=cfg.micro_batch_size,
        gradient_accumulation_steps=cfg.accum_steps, max_steps=cfg.max_steps,
        max_grad_norm=float(cfg.clip.partition(":")[2] or 1.0), logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, train_sampling_strategy="sequential",
        dataloader_num_workers=0, disable_tqdm=True, remove_unused_columns=False, seed=cfg.seed,
    )  # fmt: skip


def trainer_worker(run_dir: Path, out: Path, variant: str, steps: int = 0) -> None:
    """transformers.Trainer on what the gradstep run ``run_dir`` trained on, with its
    optimizer, schedule, clip and batch; writes the model to ``out`` (merged for LoRA).
    ``steps`` > 0: a run of that many steps instead, on the first ``steps`` windows, the
    schedule's horizon ``steps`` (as ``gradstep train --max-steps steps`` would)."""
    from torch.optim.lr_scheduler import LambdaLR
    from transformers import AutoTokenizer, Trainer

    from gradstep_cli.config.settings import TrainConfig
    from gradstep_cli.run.schedule import WarmupCosine
    from gradstep_cli.train import build_optimizer

    settings = json.loads((run_dir / "config.json").read_text())
    cfg = TrainConfig(**{**settings, **({"max_steps": steps} if steps else {})})
    torch.set_num_threads(cfg.threads)
    path = cfg.model.removeprefix("hf:")
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = [r for w in gradstep_windows(cfg) for mb in w for r in unpadded_rows(mb)]
    distinct = check_same_records(rows, Path(cfg.data), tokenizer)
    model = _trainer_model(cfg, path)
    optimizer = build_optimizer(model, cfg)  # gradstep's AdamW: groups, betas
    schedule = LambdaLR(optimizer, WarmupCosine(cfg.warmup, cfg.max_steps, cfg.min_lr / cfg.lr))
    timer = _step_timer()
    trainer = Trainer(model=model, args=_arguments(cfg, out), train_dataset=rows,
                      optimizers=(optimizer, schedule), data_collator=collator(tokenizer, variant),
                      callbacks=[timer])  # fmt: skip
    trainer.train()
    logs = [h for h in trainer.state.log_history if "grad_norm" in h]
    (model.merge_and_unload() if cfg.lora else model).save_pretrained(out)
    tokenizer.save_pretrained(out)
    result = {"step_s": timer.wall, "cpu_s": timer.cpu, "loss": [h["loss"] for h in logs],
              "grad_norm": [h["grad_norm"] for h in logs], "rows": len(rows),
              "distinct_records": distinct, "threads": torch.get_num_threads()}  # fmt: skip
    (out / "trainer_result.json").write_text(json.dumps(result))


def main(argv: list[str]) -> int:
    if argv[:1] == ["gradstep"] and len(argv) >= 2:
        return gradstep_worker(Path(argv[1]), argv[2:])
    if argv[:1] == ["trainer"] and len(argv) == 5:
        trainer_worker(Path(argv[1]), Path(argv[2]), argv[3], int(argv[4]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main(sys.argv[1:]))
