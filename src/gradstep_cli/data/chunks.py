"""Long documents tokenized in bounded pieces, to exactly the ids of the whole.

A document is cut into pieces of about :data:`PIECE_CHARS` characters at *safe boundaries*:
after a newline that a non-space character follows, or else before a single space between
two non-space characters. Every pre-tokenizer of the byte-level BPE families (GPT-2,
Llama 3, Qwen, ...) splits there whatever surrounds it, and no token crosses a
pre-token, so the pieces' ids, joined, are the ids of the whole document. Whether a
tokenizer keeps that promise is not assumed: :class:`Pieces` checks it once on probe texts
(a SentencePiece normalizer that prepends "▁" to every text does not), together with how
its special tokens (BOS, EOS) sit around one text. A tokenizer that fails the check
encodes every document whole, as before: exact, with the old memory cost, and said.

Pieces of several documents go to the tokenizer together, :data:`BATCH_CHARS` at a time
(a fast tokenizer encodes a batch on all its threads): a call's memory is bounded, and
every character is tokenized once.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from gradstep_cli.data.records import Encoder

__all__ = ["BATCH_CHARS", "PIECE_CHARS", "Pieces", "file_pieces", "safe_cut", "text_pieces"]

PIECE_CHARS = 256 * 1024
BATCH_CHARS = 1024 * 1024
# Texts split at every kind of safe boundary, with what usually surrounds one.
_PROBES = (
    ("def f(x):\n    return x\n", "class A:\n    pass\n\n"),
    ("Hello world, it's text.\r\n", "Über naïve café 東京 12345 6789.\n"),
    ("x = [1, 2]  # note\n\n", "y = {'a': 3}\n    z  = 0\n"),
    ("The quick brown", " fox jumps over the lazy dog"),
    ("tab\tseparated 2024", " (parenthesis) and 'quotes'"),
    ("value_12345", " 67890 + 3.14159"),
)

Sink = Callable[[np.ndarray, bool], None]
"""Receives a document's ids in order, and True with its last ids."""


def safe_cut(text: str, hi: int) -> int | None:
    """The largest safe boundary ``i`` in ``(0, hi]`` (``text[:i] + text[i:]`` splits
    there), else the smallest one after ``hi``, else None. The character after a boundary
    must be in ``text``."""
    i = text.rfind("\n", 0, hi)
    while i != -1:
        if i + 1 < len(text) and not text[i + 1].isspace():
            return i + 1
        i = text.rfind("\n", 0, i)
    i = text.rfind(" ", 1, hi + 1)
    while i != -1:
        if not text[i - 1].isspace() and i + 1 < len(text) and not text[i + 1].isspace():
            return i
        i = text.rfind(" ", 1, i)
    return _first_after(text, hi)


def _first_after(text: str, lo: int) -> int | None:
    i = text.find("\n", lo)
    while i != -1 and i + 1 < len(text):
        if not text[i + 1].isspace():
            return i + 1
        i = text.find("\n", i + 1)
    i = text.find(" ", max(lo, 1))
    while i != -1 and i + 1 < len(text):
        if not text[i - 1].isspace() and not text[i + 1].isspace():
            return i
        i = text.find(" ", i + 1)
    return None


def text_pieces(text: str, size: int = PIECE_CHARS) -> Iterator[str]:
    """``text`` in pieces of about ``size`` characters, cut at safe boundaries."""
    while len(text) > size and (cut := safe_cut(text, size)) is not None:
        yield text[:cut]
        text = text[cut:]
    if text:
        yield text


def file_pieces(blocks: Iterable[bytes], size: int = PIECE_CHARS) -> Iterator[str]:
    """A UTF-8 file's blocks as text pieces of about ``size`` characters, cut at safe
    boundaries (a piece grows until it holds one)."""
    decoder, text = codecs.getincrementaldecoder("utf-8")(), ""
    for block in blocks:
        text += decoder.decode(block)
        while len(text) > size and (cut := safe_cut(text, size)) is not None:
            yield text[:cut]
            text = text[cut:]
    text += decoder.decode(b"", final=True)
    if text:
        yield from text_pieces(text, size)


def _specials(encoder: Encoder, text: str) -> tuple[list[int], list[int]] | None:
    """(prefix, suffix): the special tokens the tokenizer adds around ``text``."""
    bare, full = encoder.ids([text], False)[0], encoder.ids([text], True)[0]
    for k in range(len(full) - len(bare) + 1):
        if full[k : k + len(bare)] == bare:
            return full[:k], full[k + len(bare) :]
    return None


class Pieces:
    """How documents are tokenized: in pieces, or whole (:attr:`splits`), in batches."""

    def __init__(self, encoder: Encoder) -> None:
        self.encoder = encoder
        self.prefix: list[int] = []
        self.suffix: list[int] = []
        self.splits = encoder.tokenizer is None or self._probe()
        self._pending: list[tuple[Sink, str, bool, bool]] = []
        self._chars = 0
        self.calls = 0

    def _probe(self) -> bool:
        enc = self.encoder
        around = [_specials(enc, a + b) for a, b in _PROBES]
        if any(s is None or s != around[0] for s in around):
            return False
        self.prefix, self.suffix = around[0]
        for a, b in _PROBES:
            whole, parts = enc.ids([a + b], False)[0], enc.ids([a, b], False)
            if whole != parts[0] + parts[1]:
                return False
        return True

    def add(self, pieces: Iterable[str], sink: Sink) -> None:
        """Queue one document (its text in pieces cut at safe boundaries, read as they are
        needed); ``sink`` gets its ids, in order, once they are encoded."""
        if not self.splits:  # the tokenizer's ids depend on the whole text: one piece
            pieces = ["".join(pieces)]
        pieces = iter(pieces)
        piece, first = next(pieces, None), True
        while piece is not None:
            following = next(pieces, None)
            self._pending.append((sink, piece, first, following is None))
            self._chars += len(piece)
            if self._chars >= BATCH_CHARS:
                self.flush()
            piece, first = following, False

    def flush(self) -> None:
        """Encode every queued piece (one tokenizer call) and hand the ids on."""
        pending, self._pending, self._chars = self._pending, [], 0
        if not pending:
            return
        self.calls += 1
        texts = [piece for _, piece, _, _ in pending]
        if self.encoder.tokenizer is None:
            for (sink, _, _, last), text in zip(pending, texts, strict=True):
                sink(np.frombuffer(text.encode("utf-8"), dtype=np.uint8), last)
            return
        encoded = self.encoder.ids(texts, not self.splits)
        del texts
        for (sink, _, first, last), ids in zip(pending, encoded, strict=True):
            sink(self._framed(ids, first and self.splits, last), last)

    def _framed(self, ids: list[int], first: bool, last: bool) -> np.ndarray:
        """A piece's ids with the special tokens of a whole text: the prefix before the
        first, the suffix and EOS after the last (EOS unless it already ends so)."""
        parts = [self.prefix] if first and self.prefix else []
        parts.append(ids)
        if last and self.splits and self.suffix:
            parts.append(self.suffix)
        out = np.concatenate([np.asarray(p, dtype=np.int32) for p in parts])
        eos = self.encoder.eos
        if last and eos is not None and (not len(out) or out[-1] != eos):
            out = np.append(out, np.int32(eos))
        return out
