"""The second pass over a run's data: every document and record tokenized once, into the
token store's sides (:class:`~gradstep_cli.data.store.SideWriter`).

Documents (text files, ``{"text"}`` records) go to the tokenizer in pieces cut at safe
boundaries, several at a time (:mod:`.chunks`); prompt/completion records in batches;
conversations one at a time through the chat template. Nothing is held beyond a batch: the
tokens go to disk as they come.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradstep_cli.data.chunks import Pieces, file_pieces, text_pieces
from gradstep_cli.data.files import read_range
from gradstep_cli.data.formats import Bad, Fields, check
from gradstep_cli.data.records import (
    KINDS,
    SKIP_HINT,
    BadRecords,
    DataError,
    Encoder,
    TemplateError,
)
from gradstep_cli.data.scan import Read, TextDoc
from gradstep_cli.data.store import SideWriter

__all__ = ["Filler", "fill_records", "fill_texts", "utf8_cut"]

PAIRS = 256  # prompt/completion records per tokenizer call


@dataclass
class Filler:
    """One side being filled: its writer, what it kept and left out, its bad records."""

    writer: SideWriter
    encoder: Encoder
    pieces: Pieces
    flag: str
    """The flag its records are named by (``--data`` for a held-out side)."""
    skip: bool
    bad: BadRecords = field(default_factory=BadRecords)
    defer: bool = False
    """Hold a refused record's error until the pass ends (a held-out side: the training
    side's refusal, found later in the files, is said first)."""
    kept: dict[str, int] = field(default_factory=dict)
    files: int = 0
    no_target: int = 0
    deferred: DataError | None = None
    _pairs: list[tuple[str, str]] = field(default_factory=list)

    def text(self, text: str) -> None:
        self.kept["text"] = self.kept.get("text", 0) + 1
        self.pieces.add(text_pieces(text), self.writer.document)

    def pair(self, value: tuple[str, str]) -> None:
        self._pairs.append(value)
        if len(self._pairs) >= PAIRS:
            self.flush()

    def flush(self) -> None:
        """Encode the queued prompt/completion records (before a conversation: file order)."""
        pairs, self._pairs = self._pairs, []
        for encoded in self.encoder.prompt_completions(pairs) if pairs else ():
            self._keep("prompt/completion", encoded)

    def _keep(self, kind: str, encoded: Any) -> None:
        if encoded.targets() == 0:
            self.no_target += 1  # e.g. a conversation with no assistant turn
            return
        self.writer.record(encoded)
        self.kept[kind] = self.kept.get(kind, 0) + 1

    def chat(self, value: tuple[list, list | None], where: str) -> None:
        self.flush()
        messages, tools = value
        flagged = f"{self.flag} {where}"
        try:
            encoded = self.encoder.conversation(messages, flagged, tools)
        except TemplateError:
            raise
        except Exception as exc:  # the template refused this conversation (jinja2 errors)
            reason = self.encoder.refused(exc, flagged)
            if self.skip:
                self.bad.add(f"{where}: {reason}")
                return
            error = DataError(f"{flagged}: {reason}; {SKIP_HINT}")
            if not self.defer:
                raise error from None
            self.deferred = self.deferred or error
            return
        self._keep("messages", encoded)

    def finish(self) -> dict[str, Any]:
        """The side laid out: its meta (counts, digest)."""
        self.flush()
        self.pieces.flush()
        info = self.writer.finish()
        kinds = {kind: self.kept[kind] for kind in KINDS if kind in self.kept}
        return {**info, "files": self.files, "kinds": kinds, "no_target": self.no_target}


def utf8_cut(doc: TextDoc, cut: int) -> int:
    """``cut`` moved back to a character boundary of ``doc``'s file (a split of one file
    by bytes may fall inside a character, which a tokenizer cannot decode)."""
    while cut > 1:
        byte = b"".join(read_range(doc.path, cut, cut + 1))
        if not byte or byte[0] & 0xC0 != 0x80:  # not a continuation byte
            break
        cut -= 1
    return cut


def fill_texts(docs: list[TextDoc], filler: Filler, flag: str) -> None:
    """Text files (or parts of one) as documents of ``filler``'s side."""
    tokens = filler.encoder.tokenizer is not None
    for doc in docs:
        filler.files += 1
        blocks = read_range(doc.path, doc.start, doc.end, flag)
        if not tokens:  # bytes are the tokens: copied as they are
            for block, last in _with_last(blocks):
                filler.writer.document(np.frombuffer(block, dtype=np.uint8), last)
            continue
        filler.pieces.add(file_pieces(blocks), filler.writer.document)


def _with_last(blocks: Any) -> Any:
    previous = None
    for block in blocks:
        if previous is not None:
            yield previous, False
        previous = block
    if previous is not None:
        yield previous, True


def fill_records(read: Read, fields: Fields, sides: list[Filler], held: np.ndarray | None) -> None:
    """Every usable record of ``read`` into ``sides[0]``, or ``sides[held[i]]`` (the
    split: True is validation), in file order; then any deferred refusal is raised."""
    index = 0
    for part in read.spec.parts:
        for item in part.items():
            if item.bad is not None:
                continue
            try:
                kind, value = check(item.value, fields)
            except Bad:
                continue  # counted (or refused) by the first pass
            side = sides[int(held[index])] if held is not None else sides[0]
            index += 1
            if kind == "text":
                side.text(value)
            elif kind == "prompt/completion":
                side.pair(value)
            else:
                side.chat(value, item.where)
    for side in sides:
        side.flush()
        if side.deferred is not None:
            raise side.deferred
