"""bench/throughput.py's inputs: the base model and the two record sets, built here.

* The base: ``finetune_data.base_folder`` (the fine-tuning walk's Llama shape, BPE with a
  pad token of its own) at ``max_position_embeddings = --seq-len``, pretrained from random
  weights by ``gradstep train --init random`` (``finetune_trl.pretrain``) and exported: the
  model both sides fine-tune.
* ``walk``: the fine-tuning walk's SFT records, as ``finetune_trl`` builds them (a
  function's ``def`` line + docstring -> its body; prompt ending on the docstring's quotes;
  prompt + completion tokenize the same jointly and apart), those of at most
  ``--walk-max-tokens`` tokens (the walk's 192) spread over the training files.
* ``tail``: a long-tailed length distribution at ``--seq-len``: each record's token length
  drawn from a log-normal (``--tail-median``, ``--tail-sigma``), clipped to
  ``[TAIL_MIN, seq_len]``; its text is that many tokens of consecutive lines of a corpus
  file (training files for training, held-out files for validation), the first fifth of
  its lines the prompt and the rest the completion (split at a line end, so both
  tokenizations agree; checked).

Both sets are written the same way for both sides: Parquet ``{question, answer, source}``
(``finetune_trl``'s field names, which are not TRL's).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import finetune_data as fd
import finetune_trl as ft
from gradstep_cli.data.sources import load_corpus

TAIL_MIN = 24
PROMPT_SHARE = 0.2


def shape_of(cfg: Any) -> dict[str, int]:
    return dict(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.seq_len,
    )  # fmt: skip


def walk_records(tok: Any, pairs: Sequence[fd.Pair], max_tokens: int, n: int) -> list[fd.Pair]:
    """``n`` of the walk's pairs (``finetune_trl``'s rule) of at most ``max_tokens`` tokens."""
    ok = [p for p in map(ft.moved, pairs)
          if len(fd.encode_pair(tok, p)[0]) <= max_tokens and fd.joint_agrees(tok, p)]  # fmt: skip
    if len(ok) < n:
        raise ValueError(f"only {len(ok)} walk records fit {max_tokens} tokens, {n} asked")
    return fd.spread(ok, n)


def _tail_pair(tok: Any, name: str, lines: list[str], start: int, target: int) -> fd.Pair | None:
    """Consecutive lines from ``start`` of at least ``target`` tokens as a prompt (the first
    fifth of the characters, whole lines) and a completion (None: the file ends first)."""
    end = start + 2
    while True:
        n = len(tok("".join(lines[start:end]), add_special_tokens=False)["input_ids"])
        if n >= target:
            break
        if end >= len(lines):
            return None
        end += max(1, (target - n) // 12)  # about 12 tokens a line
    chars = [len(line) for line in lines[start:end]]
    cut = 1
    while cut < len(chars) - 1 and sum(chars[:cut]) < PROMPT_SHARE * sum(chars):
        cut += 1
    prompt, completion = "".join(lines[start : start + cut]), "".join(lines[start + cut : end])
    if not prompt.strip() or not completion.strip():
        return None
    return ft.moved(fd.Pair(f"{name}:{start + 1}", prompt, completion.rstrip()))


def tail_records(tok: Any, docs: Sequence[Any], n: int, cfg: Any, seed: int) -> list[fd.Pair]:
    """``n`` records of log-normal token lengths (see the module), drawn from ``docs``."""
    rng = random.Random(seed)
    files = [(d.name, d.data.decode("utf-8").splitlines(keepends=True)) for d in docs]
    files = [(name, lines) for name, lines in files if len(lines) > 20]
    out: list[fd.Pair] = []
    while len(out) < n:
        drawn = rng.lognormvariate(math.log(cfg.tail_median), cfg.tail_sigma)
        target = int(min(cfg.seq_len, max(TAIL_MIN, drawn)))
        name, lines = rng.choice(files)
        pair = _tail_pair(tok, name, lines, rng.randrange(len(lines) - 2), target)
        while pair is not None and len(fd.encode_pair(tok, pair)[0]) > target:
            body = pair.completion.rsplit("\n", 1)[0].rstrip()  # one line less
            pair = fd.Pair(pair.where, pair.prompt, body) if body.strip() else None
        if pair is not None and fd.joint_agrees(tok, pair):
            out.append(pair)
    return out


def lengths(tok: Any, pairs: Sequence[fd.Pair]) -> list[int]:
    return [len(fd.encode_pair(tok, p)[0]) for p in pairs]


def length_stats(ns: Sequence[int], seq_len: int) -> dict[str, float]:
    s = sorted(ns)
    q = lambda f: s[min(len(s) - 1, int(f * len(s)))]  # noqa: E731
    half = sum(n > seq_len / 2 for n in s) / len(s)
    return {"records": len(s), "mean": statistics.mean(s), "median": q(0.5), "p90": q(0.9),
            "p99": q(0.99), "max": s[-1], "share over seq/2": half, "tokens": sum(s)}  # fmt: skip


def write_parquet(pairs: Sequence[fd.Pair], path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": [p.prompt for p in pairs],
                             "answer": [p.completion for p in pairs],
                             "source": [p.where for p in pairs]}), path)  # fmt: skip
    return path


def prepare(cfg: Any, work: Path) -> dict[str, Any]:
    """The base folder (not yet pretrained) and both record sets' Parquet files, with their
    encoded validation records and length statistics."""
    import shutil

    from transformers import AutoTokenizer

    corpus = load_corpus()
    texts = [d.data.decode("utf-8") for d in corpus.train]
    shutil.rmtree(work / "base", ignore_errors=True)
    base = fd.base_folder(work / "base", texts, shape_of(cfg), pad=True)
    tok = AutoTokenizer.from_pretrained(str(base))
    train, val, _ = fd.corpus_pairs()
    sets = {
        "walk": (walk_records(tok, train, cfg.walk_max_tokens, cfg.walk_train),
                 walk_records(tok, val, cfg.walk_max_tokens, cfg.walk_val)),
        "tail": (tail_records(tok, corpus.train, cfg.tail_train, cfg, seed=1),
                 tail_records(tok, corpus.val, cfg.tail_val, cfg, seed=2)),
    }  # fmt: skip
    out: dict[str, Any] = {"base": str(base), "sets": {}}
    for name, (tr, va) in sets.items():
        out["sets"][name] = {
            "train": str(write_parquet(tr, work / f"{name}_train.parquet")),
            "val": str(write_parquet(va, work / f"{name}_val.parquet")),
            "train_lengths": lengths(tok, tr),
            "train_stats": length_stats(lengths(tok, tr), cfg.seq_len),
            "val_stats": length_stats(lengths(tok, va), cfg.seq_len),
            "val_encoded": [fd.encode_pair(tok, p) for p in va],
        }
    return out
