"""A run's data: text files and records, read, split, tokenized once and batched.

``--data`` names text files (a file, a folder searched recursively, or a glob:
:mod:`.files`), record files (JSONL, JSON, Parquet, CSV, Arrow), a ``save_to_disk``
folder or a Hub dataset (:mod:`.specs`, :mod:`.reading`); one argument holds one kind. Text
is UTF-8 bytes for the demo GPT, or the HF model's tokens (documents end with EOS, records
train on their completion or assistant turns only). Validation is ``--val-data``, or
``--val-fraction`` of ``--data`` held out: whole files for text, records for records, at
least one on each side (:mod:`.scan`). :func:`load_source` prepares it all once into a
token store on disk (:mod:`.prepare`, :mod:`.store`) and cuts the run's stream from it.

Design points, each there because the optimizer step depends on it:

* **Variable-length sequences.** Chunks have random lengths and documents end mid-chunk, so
  micro-batches carry different numbers of real tokens. That is exactly the case where
  averaging per-micro-batch mean losses is wrong and the exact token-weighted step matters.
* **Labels are pre-shifted and padded with -100**: ``labels[t]`` is the target of input
  position ``t``; the loss never shifts and never counts padding or a prompt.
* **Deterministic, resumable order.** The order of an epoch is a pure function of
  ``(seed, epoch)``, so the iterator's position is just ``(epoch, index)``; restoring it
  continues with exactly the micro-batch that would have come next.
* **Rank sharding by stride.** Rank ``r`` of ``W`` takes global micro-batches
  ``r, r + W, r + 2W, ...``: the union over ranks of one optimizer step (``accum_steps``
  micro-batches per rank) is the same set a single process sees with ``accum_steps * W``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gradstep_cli.data.files import (
    DEFAULT_CORPUS_BYTES,
    default_corpus_files,
    text_files,
    user_files,
)
from gradstep_cli.data.files import path_hash as _path_hash
from gradstep_cli.data.prepare import prepare
from gradstep_cli.data.records import DataError, Encoder
from gradstep_cli.data.scan import VAL_BUCKETS, _held_out, _unit
from gradstep_cli.data.sides import Side, TextSource
from gradstep_cli.data.tokenized import (
    IGNORE_INDEX,
    PAD_ID,
    Batch,
    Document,
    TrainBatches,
    plural_records,
)
from gradstep_cli.data.validation import validation_batches

__all__ = [
    "IGNORE_INDEX",
    "PAD_ID",
    "Batch",
    "Corpus",
    "DataError",
    "Document",
    "TextSource",
    "TrainBatches",
    "collate",
    "default_corpus_files",
    "load_corpus",
    "load_source",
    "validation_batches",
]

_EXPORTED_FOR_TESTS = (_held_out, _path_hash, _unit)  # the split's rule, tested here


@dataclass(frozen=True)
class Corpus:
    train: list[Document]
    val: list[Document]
    source: str

    def describe(self) -> str:
        n_train = sum(len(d.data) for d in self.train)
        n_val = sum(len(d.data) for d in self.val)
        return (
            f"{self.source}: {len(self.train)} train docs ({n_train:,} bytes), "
            f"{len(self.val)} val docs ({n_val:,} bytes)"
        )


def _split_by_file(
    docs: list[Document], fraction: float = 1 / VAL_BUCKETS
) -> tuple[list[Document], list[Document]]:
    """Put ``fraction`` of the files (by path hash) into validation, never part of a file.

    A single file cannot be split by file, so its last ``fraction`` is validation.
    """
    if len(docs) == 1:
        data = docs[0].data
        cut = max(1, len(data) - max(math.floor(len(data) * fraction), 2))
        return [Document(docs[0].name, data[:cut])], [Document(docs[0].name + "#val", data[cut:])]
    is_val = _held_out([d.name for d in docs], fraction)
    train = [d for d, v in zip(docs, is_val, strict=True) if not v]
    val = [d for d, v in zip(docs, is_val, strict=True) if v]
    return train, val


def load_corpus(data: str | None = None, max_bytes: int = DEFAULT_CORPUS_BYTES) -> Corpus:
    """Load the default stdlib corpus (``data=None``) or the user's text files, split by file,
    in memory (for scripts and examples; a run reads its data through :func:`load_source`).

    ``max_bytes`` caps only the default corpus; user data is loaded in full.
    """
    if data is None:
        root, paths = default_corpus_files(max_bytes)
        source = f"stdlib {root}"
    else:
        root, paths = user_files(data)
        source = data
    train, val = _split_by_file(text_files(root, paths, source))
    return Corpus(train=train, val=val, source=source)


def collate(chunks: Sequence[np.ndarray | bytes]) -> Batch:
    """Right-pad byte chunks into ``input_ids`` (pad 0) and shifted ``labels`` (pad -100)."""
    width = max(len(c) for c in chunks) - 1
    input_ids = torch.full((len(chunks), width), PAD_ID, dtype=torch.long)
    labels = torch.full((len(chunks), width), IGNORE_INDEX, dtype=torch.long)
    for row, chunk in enumerate(chunks):
        ids = torch.as_tensor(np.frombuffer(bytes(chunk), dtype=np.uint8).astype(np.int64))
        input_ids[row, : len(ids) - 1] = ids[:-1]
        labels[row, : len(ids) - 1] = ids[1:]
    return {"input_ids": input_ids, "labels": labels}


def _check_fits(side: Side, what: str, seq_len: int, held: str = "") -> None:
    """A side with no row at ``seq_len`` is an error saying why (not an empty stream).
    ``held``: what the split moved to the other side, said unless the fix is --seq-len."""
    if side.data.has_rows(seq_len):
        return
    _, too_long = side.data.fit(seq_len)
    reasons = []
    if too_long:
        reasons.append(
            f"{plural_records(too_long)} too long: their targets alone need more than --seq-len "
            f"{seq_len} positions (raise --seq-len)"
        )
    if side.no_target:
        reasons.append(f"{plural_records(side.no_target)} with no token to train on")
    empty = not side.data.n_documents and not side.data.n_records
    short = "its text is under 2 tokens: no micro-batches can be made; use more data"
    why = "; ".join(reasons) or ("no record is left" if empty else short)
    raise DataError(f"{what}: no sequence to use ({why}){'' if too_long else held}")


def _bytes_why(cfg: Any) -> str | None:
    """Why the data is bytes, for a refusal of chat records (None: the demo GPT)."""
    if not getattr(cfg, "is_hf", False):
        return None
    return (
        f"model {cfg.model!r} has no tokenizer (no tokenizer files in its folder, no "
        "--tokenizer), so the data is read as bytes: pass --tokenizer PATH (a tokenizer "
        "folder with a chat template), or give text or prompt/completion records"
    )


def load_source(cfg: Any, tokenizer: Any = None) -> TextSource:
    """The data ``cfg`` names (``--data``, ``--val-data`` or ``--val-fraction`` held out),
    read as bytes for the demo GPT (``tokenizer`` None) or tokenized with the HF model's
    tokenizer, through the token store (built once, then reused). Bad input raises
    :class:`DataError` naming the flag, file and line."""
    encoder = Encoder(tokenizer, _bytes_why(cfg), cfg.template_kwargs)
    source = prepare(cfg, encoder)
    _check_fits(source.train, f"--data {source.source!r}", cfg.seq_len, source.held)
    if cfg.val_data is not None:
        _check_fits(source.val, f"--val-data {cfg.val_data!r}", cfg.seq_len)
        return source
    held_out = f"the --val-fraction {cfg.val_fraction} of --data {source.source!r} held out"
    more = "; give validation data with --val-data PATH, or more data"
    _check_fits(source.val, held_out, cfg.seq_len, more)
    return source
