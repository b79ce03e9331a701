"""The fine-tuning benchmark's local assets: tokenizer, base model folder, SFT pairs, evaluation.

Everything is built here from the demo's default corpus (stdlib ``.py`` files), nothing is
downloaded:

* the tokenizer: a byte-level BPE trained on the corpus' *training* files
  (``tests.support.hf_assets.train_tokenizer``, the tests' recipe at a larger vocabulary);
* the base folder: a Llama config and that tokenizer, no weights (``--init random``
  pretrains it from scratch);
* prompt/completion pairs: each function with a docstring, its signature and docstring as
  the prompt, the rest of its body as the completion (``ast``). Pairs of training files
  train; pairs of the files the pretraining held out (the same split: ``load_corpus``)
  validate, so no validation function was seen in pretraining either;
* :func:`completion_loss`: the one evaluation both trainers' models go through.

The two training runs themselves are in ``finetune_workers.py``.
"""

from __future__ import annotations

import ast
import json
import math
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gradstep_cli.data.sources import load_corpus

IGNORE = -100


@dataclass(frozen=True)
class Pair:
    """One supervised example: where it comes from, its prompt and its completion."""

    where: str
    prompt: str
    completion: str


# ----------------------------------------------------------------------------- pairs


def _function_pair(lines: Sequence[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple:
    """(prompt, completion) of ``node``: signature + docstring, then the rest of the body."""
    doc = node.body[0]
    rest = node.body[1:]
    start = node.lineno - 1  # the ``def`` line (decorators stay out of the prompt)
    split, end = doc.end_lineno, node.end_lineno  # type: ignore[attr-defined]
    # Dedent the whole function once, so a method reads like a top-level function.
    text = textwrap.dedent("".join(lines[start:end]))
    cut = sum(len(line) for line in text.splitlines(keepends=True)[: split - start])
    prompt, completion = text[:cut], text[cut:].rstrip()
    return (prompt, completion) if rest and completion.strip() else None


def _docstring_functions(tree: ast.AST) -> Iterable[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and ast.get_docstring(node):
            yield node


def file_pairs(name: str, source: str) -> list[Pair]:
    """Every docstring function of one file as a :class:`Pair` (none if it does not parse)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines(keepends=True)
    pairs = []
    for node in _docstring_functions(tree):
        pair = _function_pair(lines, node)
        if pair is not None:
            pairs.append(Pair(f"{name}:{node.lineno}", *pair))
    return sorted(pairs, key=lambda p: (p.where.split(":")[0], int(p.where.split(":")[1])))


def corpus_pairs() -> tuple[list[Pair], list[Pair], list[str]]:
    """(train pairs, validation pairs, training texts) from the default corpus' split."""
    corpus = load_corpus()
    texts = [d.data.decode("utf-8") for d in corpus.train]
    train = [p for d, t in zip(corpus.train, texts, strict=True) for p in file_pairs(d.name, t)]
    val = [p for d in corpus.val for p in file_pairs(d.name, d.data.decode("utf-8"))]
    return train, val, texts


def encode_pair(tokenizer: Any, pair: Pair) -> tuple[list[int], list[bool]]:
    """Tokens and per-token "is a target" of a pair, as a Trainer user's preprocessing
    builds them (TRL's rule): prompt with the tokenizer's special tokens, completion
    without, EOS appended; the completion and EOS are targets."""
    prompt = tokenizer(pair.prompt, add_special_tokens=True)["input_ids"]
    completion = tokenizer(pair.completion, add_special_tokens=False)["input_ids"]
    ids = [*prompt, *completion, tokenizer.eos_token_id]
    return ids, [False] * len(prompt) + [True] * (len(completion) + 1)


def fitting(pairs: Iterable[Pair], tokenizer: Any, seq_len: int, limit: int) -> list[Pair]:
    """The first ``limit`` pairs whose tokens fit ``seq_len`` positions (no record is cut:
    both trainers then see whole records)."""
    out = []
    for pair in pairs:
        if len(encode_pair(tokenizer, pair)[0]) <= seq_len + 1:
            out.append(pair)
            if len(out) == limit:
                break
    return out


def write_jsonl(pairs: Sequence[Pair], path: Path) -> Path:
    with path.open("w") as f:
        for p in pairs:
            f.write(json.dumps({"prompt": p.prompt, "completion": p.completion, "id": p.where}))
            f.write("\n")
    return path


def spread(pairs: Sequence[Pair], limit: int) -> list[Pair]:
    """At most ``limit`` pairs taken evenly over ``pairs`` (over all files, not the first)."""
    if len(pairs) <= limit:
        return list(pairs)
    step = len(pairs) / limit
    return [pairs[int(i * step)] for i in range(limit)]


SYSTEM = "Write the body of the Python function."


def messages_of(pair: Pair) -> list[dict[str, str]]:
    """The pair as a conversation: a system line, the prompt as the user's turn, the
    completion as the assistant's."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": pair.prompt},
            {"role": "assistant", "content": pair.completion}]  # fmt: skip


def encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[bool]]:
    """Tokens and per-token "is a target" of a conversation: the chat template's own tokens
    and its assistant mask (the ``{% generation %}`` blocks: the assistant's content and
    ``<|im_end|>``), as TRL's ``assistant_only_loss`` and gradstep's messages records take them."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)  # fmt: skip
    return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]


def joint_agrees(tokenizer: Any, pair: Pair) -> bool:
    """Whether tokenizing prompt + completion as one text (TRL) gives the prompt's tokens
    then the completion's, as tokenizing them apart (gradstep, :func:`encode_pair`) does:
    then both train on the same token sequence."""
    ids, _ = encode_pair(tokenizer, pair)
    joint = tokenizer(pair.prompt + pair.completion, add_special_tokens=True)["input_ids"]
    return [*joint, tokenizer.eos_token_id] == ids


# ----------------------------------------------------------------------------- folders


def base_folder(dest: Path, texts: list[str], shape: dict[str, int], *, pad: bool = False) -> Path:
    """config.json of a Llama of ``shape`` + a BPE tokenizer trained on ``texts`` (with its
    ChatML template, whose assistant turns sit in ``{% generation %}``; with ``pad``, a pad
    token of its own, ``<|pad|>``, else none)."""
    import _common  # noqa: F401  (puts the repo root on sys.path: tests.support)

    # isort: split
    from tests.support.hf_assets import EOS, train_tokenizer
    from transformers import AutoTokenizer, LlamaConfig

    tok_dir = train_tokenizer(texts, dest, vocab_size=shape["vocab_size"], pad=pad)
    eos = AutoTokenizer.from_pretrained(str(tok_dir)).convert_tokens_to_ids(EOS)
    config = LlamaConfig(**shape, bos_token_id=eos, eos_token_id=eos, tie_word_embeddings=False)
    config.save_pretrained(dest)
    return dest


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def completion_loss(model_dir: Path, pairs: Sequence[Pair]) -> dict[str, float]:
    """Token-weighted cross-entropy of the completion tokens (+ EOS) of ``pairs`` under the
    model saved in ``model_dir``, in float64, each pair alone and unpadded (so neither
    trainer's padding convention enters). Also the EOS tokens' mean loss alone, and the
    token accuracy (argmax = target) over the same tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return scored_loss(model_dir, [encode_pair(tokenizer, pair) for pair in pairs])


@torch.no_grad()
def scored_loss(model_dir: Path, records: Sequence[tuple[list[int], list[bool]]]) -> dict:
    """The float64 evaluation of :func:`completion_loss` on encoded ``records`` (tokens,
    per-token "is a target"): token-weighted mean NLL of the targets, their token accuracy,
    and the mean NLL of each record's last target (its EOS or end-of-turn)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64).eval()
    total, count, correct, eos_total = 0.0, 0, 0, 0.0
    for ids, target in records:
        x = torch.tensor([ids])
        logits = model(input_ids=x[:, :-1], use_cache=False).logits[0]
        mask = torch.tensor(target[1:])
        nll = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="none")
        total += float(nll[mask].sum())
        count += int(mask.sum())
        correct += int((logits.argmax(-1) == x[0, 1:])[mask].sum())
        eos_total += float(nll[mask][-1])  # the last target: EOS (or the turn's end)
    return {
        "loss": total / count,
        "tokens": count,
        "eos_loss": eos_total / len(records),
        "ppl": math.exp(total / count),
        "accuracy": correct / count,
    }


# ----------------------------------------------------------------------------- the bench's inputs


def prepare(cfg: Any, work: Path) -> dict[str, Any]:
    """The base folder (config of ``cfg``'s shape + tokenizer) and the SFT pairs as JSONL
    files in ``work``: the training pairs that fit ``cfg.seq_len``, and ``cfg.val_pairs``
    validation pairs spread over the held-out files."""
    from transformers import AutoTokenizer

    train, val, texts = corpus_pairs()
    shape = dict(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.seq_len,
    )  # fmt: skip
    base = base_folder(work / "base", texts, shape)
    tok = AutoTokenizer.from_pretrained(str(base))
    train_fit = fitting(train, tok, cfg.seq_len, len(train))
    val_fit = spread(fitting(val, tok, cfg.seq_len, len(val)), cfg.val_pairs)
    return {
        "base": base,
        "train_jsonl": write_jsonl(train_fit, work / "train.jsonl"),
        "val_jsonl": write_jsonl(val_fit, work / "val.jsonl"),
        "val": val_fit,
        "pairs": {"train_functions": len(train), "train_fit": len(train_fit),
                  "val_functions": len(val), "val_used": len(val_fit)},
    }  # fmt: skip
