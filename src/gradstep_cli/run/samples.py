"""Generation samples during training: ``--sample-prompts FILE`` every ``--sample-every N``
steps (and at the end), greedy, at most ``--sample-tokens`` tokens each, stopping at EOS (and
the chat template's end-of-turn token).

The prompts are read and encoded once, before the first step: a text file holds one prompt
per line; a JSONL file one per line as a JSON string, ``{"prompt": str}`` (or ``{"text"}``),
or ``{"messages": [...]}``, rendered with the tokenizer's chat template and its generation
prompt (``add_generation_prompt=True``), as a chat model is asked at inference. Every rank
generates (FSDP2's forward needs them all); rank 0 appends one JSON object per sample to
``OUT/samples.jsonl`` (``step``, ``index``, ``prompt``, ``completion``, ``tokens``,
``stop``) and prints a line. Greedy decoding makes the samples of two steps comparable: only
the weights changed.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from gradstep import parallel
from gradstep_cli.config.checks import ConfigError
from gradstep_cli.export.write import END_OF_TURN
from gradstep_cli.models.hf import LogitsOnly

__all__ = [
    "SAMPLES_FILE",
    "Prompt",
    "cut_samples",
    "decode",
    "generate",
    "prompt_entries",
    "read_prompts",
    "sample",
]

SAMPLES_FILE = "samples.jsonl"
SHOWN = 160  # characters of a completion in the printed line


@dataclass(frozen=True)
class Prompt:
    """One prompt: as given (text, or messages), and its token ids."""

    source: Any
    ids: list[int]


def _entries(path: Path) -> list[tuple[str, Any]]:
    """(where, text or messages) of every prompt in the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--sample-prompts {str(path)!r}: cannot read it ({exc})") from None
    lines = [(f"{path} line {n}", line) for n, line in enumerate(text.splitlines(), 1)]
    lines = [(where, line) for where, line in lines if line.strip()]
    if path.suffix != ".jsonl":
        return lines
    return [(where, _json_prompt(where, line)) for where, line in lines]


def _json_prompt(where: str, line: str) -> Any:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--sample-prompts {where}: invalid JSON ({exc.msg})") from None
    if isinstance(value, dict):
        value = next((value[k] for k in ("prompt", "text", "messages") if k in value), None)
    ok = isinstance(value, str) and value.strip()
    chat = isinstance(value, list) and value and all(isinstance(m, dict) for m in value)
    if not (ok or chat):
        raise ConfigError(
            f'--sample-prompts {where}: a prompt is a JSON string, {{"prompt": str}} or '
            '{"messages": [{"role": ..., "content": ...}, ...]}'
        )
    return value


def prompt_entries(path: str) -> list[tuple[str, Any]]:
    """(where, text or messages) of each prompt of ``path``; ConfigError when it has none or
    one cannot be read."""
    entries = _entries(Path(path))
    if not entries:
        raise ConfigError(f"--sample-prompts {path!r} holds no prompt")
    return entries


def read_prompts(path: str, tokenizer: Any) -> list[Prompt]:
    """The prompts of ``path``, encoded with ``tokenizer`` (None: UTF-8 bytes)."""
    entries = prompt_entries(path)
    return [Prompt(value, _encode(where, value, tokenizer)) for where, value in entries]


def _encode(where: str, value: Any, tokenizer: Any) -> list[int]:
    if isinstance(value, str):
        return list(value.encode("utf-8")) if tokenizer is None else tokenizer(value)["input_ids"]
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"--sample-prompts {where}: chat messages need a tokenizer with a chat template "
            "(--model hf:DIR whose tokenizer has one); give text prompts instead"
        )
    try:
        out = tokenizer.apply_chat_template(
            value, add_generation_prompt=True, tokenize=True, return_dict=True
        )
    except Exception as exc:  # the template refused the messages (jinja2 errors)
        raise ConfigError(
            f"--sample-prompts {where}: the chat template refused it ({exc})"
        ) from None
    return list(out["input_ids"])


def stop_ids(tokenizer: Any) -> set[int]:
    """EOS, and the chat template's end-of-turn tokens (a chat model ends its turn so)."""
    if tokenizer is None:
        return set()
    stops = {tokenizer.eos_token_id} - {None}
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    vocab = tokenizer.get_vocab()
    return stops | {vocab[t] for t in END_OF_TURN if t in vocab and t in template}


@torch.no_grad()
def generate(
    model: nn.Module, prompt: list[int], limit: int, stops: set[int], max_len: int
) -> tuple[list[int], str]:
    """Greedy ids after ``prompt`` (at most ``limit``, the context cut to its last
    ``max_len``), and why it stopped: ``eos`` (a stop id, not returned) or ``length``."""
    device = next(model.parameters()).device
    ids = torch.tensor(prompt, dtype=torch.long, device=device)[None]
    new: list[int] = []
    was_training = model.training
    model.eval()
    try:
        for _ in range(limit):
            token = int(model(ids[:, -max_len:])[0, -1].float().argmax())
            if token in stops:
                return new, "eos"
            new.append(token)
            ids = torch.cat((ids, torch.tensor([[token]], device=device)), dim=1)
    finally:
        model.train(was_training)
    return new, "length"


def decode(ids: list[int], tokenizer: Any) -> str:
    """Token ids as text: the tokenizer's, else UTF-8 bytes (an id past 255, of a larger
    vocabulary, is no byte)."""
    if tokenizer is None:
        return b"".join(bytes([i]) if i < 256 else b"\xff" for i in ids).decode(
            "utf-8", errors="replace"
        )
    return tokenizer.decode(ids)


def sample(run: Any, step: int, prompts: Sequence[Prompt]) -> list[dict[str, Any]]:
    """Every prompt's sample at ``step``; written and printed on rank 0."""
    cfg, tokenizer = run.cfg, run.tokenizer
    model = parallel.unwrap(run.model)
    sampler = LogitsOnly(model) if cfg.is_hf else model
    stops, rows = stop_ids(tokenizer), []
    for index, prompt in enumerate(prompts):
        new, stop = generate(sampler, prompt.ids, cfg.sample_tokens, stops, cfg.seq_len)
        completion = decode(new, tokenizer)
        rows.append(
            {"step": step, "index": index, "prompt": prompt.source, "completion": completion,
             "tokens": len(new), "stop": stop}
        )  # fmt: skip
    if run.is_main:
        with open(run.out / SAMPLES_FILE, "a", encoding="utf-8") as file:
            file.writelines(json.dumps(row) + "\n" for row in rows)
        for row in rows:
            shown = row["completion"][:SHOWN] + ("..." if len(row["completion"]) > SHOWN else "")
            line = f"step {step}: sample {row['index'] + 1}: {shown!r} ({row['tokens']} tokens)"
            tqdm.write(line, file=sys.stderr)
    return rows


def cut_samples(path: Path, steps: int) -> None:
    """Keep the samples of the first ``steps`` steps (a resume runs the later ones again)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            keep = line.endswith("\n") and json.loads(line)["step"] <= steps
        except (ValueError, KeyError, TypeError):
            keep = False
        if keep:
            kept.append(line)
    path.write_text("".join(kept), encoding="utf-8")
