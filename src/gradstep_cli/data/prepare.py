"""A run's data, prepared once: read, checked, split and tokenized into a token store
(:mod:`.store`), or the store of an earlier run with the same data, tokenizer and settings
reused; then opened as the run's :class:`~gradstep_cli.data.sides.TextSource`.

The order is the old one, so every refusal comes where it came: ``--data`` checked
(:mod:`.scan`), its chat template, its split (``--val-fraction``) or ``--val-data`` checked
with its note when it repeats ``--data``; then both sides tokenized (:mod:`.build`).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np

from gradstep_cli.config.preflight import note
from gradstep_cli.data.build import Filler, fill_records, fill_texts, utf8_cut
from gradstep_cli.data.chunks import Pieces
from gradstep_cli.data.files import DEFAULT_VAL_BYTES
from gradstep_cli.data.formats import Fields
from gradstep_cli.data.records import BadRecords, Encoder
from gradstep_cli.data.scan import Read, bounded_val, overlap_note, scan, split
from gradstep_cli.data.sides import Prepared, Side, TextSource
from gradstep_cli.data.specs import Spec, resolve
from gradstep_cli.data.store import (
    VERSION,
    Build,
    SideWriter,
    cache_root,
    find,
    store_key,
    tokenizer_stamp,
)
from gradstep_cli.data.tokenized import Sequences

__all__ = ["prepare"]

SIDES = ("train", "val")


def _inputs(cfg: Any, encoder: Encoder, specs: tuple[Spec, Spec | None]) -> dict[str, Any]:
    """Everything that changes the tokens: the store's key hashes it."""
    train, val = specs
    return {
        "version": VERSION,
        "unit": encoder.unit,
        "eos": encoder.eos,
        "tokenizer": tokenizer_stamp(encoder.tokenizer),
        "data": [train.source, train.stamp],
        "val_data": [val.source, val.stamp] if val is not None else None,
        "val_fraction": cfg.val_fraction if val is None else None,
        "skip_bad_records": cfg.skip_bad_records,
        "fields": dataclasses.astuple(Fields.of(cfg))[:5],
        "chat_template_kwargs": encoder.template_kwargs,
    } | ({"default_val_bytes": DEFAULT_VAL_BYTES} if cfg.data is None else {})


def _fillers(
    folder: Path, cfg: Any, encoder: Encoder, val_flag: str, bad: tuple[BadRecords, BadRecords]
) -> list[Filler]:
    """The two sides to fill (one tokenizer queue for both), with their bad records."""
    pieces, skip = Pieces(encoder), cfg.skip_bad_records
    return [
        Filler(SideWriter(folder, side, encoder.dtype), encoder, pieces, flag, skip, side_bad)
        for side, flag, side_bad in zip(SIDES, ("--data", val_flag), bad, strict=True)
    ]


def _split_texts(read: Read, parts: tuple[Any, Any], sides: list[Filler], tokens: bool) -> None:
    """Text held out by file, or a single file's last bytes (at a character boundary when
    it is tokenized)."""
    train, val = parts
    if len(read.docs) == 1 and tokens:
        cut = utf8_cut(read.docs[0], val[0].start)
        train, val = (
            [dataclasses.replace(train[0], end=cut)],
            [dataclasses.replace(val[0], start=cut)],
        )
    fill_texts(train, sides[0], read.flag)
    fill_texts(val, sides[1], read.flag)


def _held_out(
    folder: Path, read: Read, cfg: Any, encoder: Encoder, notes: list[str]
) -> tuple[list[Filler], str]:
    """``--val-fraction`` of ``--data`` held out, both sides filled; and what was held (for
    refusals). The default corpus validates on a bounded part of what it holds out."""
    train_part, val_part, held = split(read, cfg.val_fraction)
    if cfg.data is None:
        val_part, said = bounded_val(val_part, DEFAULT_VAL_BYTES)
        note(said)
        notes.append(said)
    sides = _fillers(folder, cfg, encoder, "--data", (read.bad, BadRecords()))
    sides[1].defer = True
    if read.docs:
        _split_texts(read, (train_part, val_part), sides, encoder.tokenizer is not None)
    else:
        fill_records(read, Fields.of(cfg), sides, val_part)
    return sides, held


def _build(folder: Path, cfg: Any, encoder: Encoder, specs: tuple[Spec, Spec | None]) -> dict:
    """Scan, split and tokenize both sides into ``folder``; the store's meta."""
    fields, skip = Fields.of(cfg), cfg.skip_bad_records
    train, notes = scan(specs[0], "--data", fields, skip, encoder), []
    if specs[1] is None:
        sides, held = _held_out(folder, train, cfg, encoder, notes)
    else:
        val = scan(specs[1], "--val-data", fields, skip, encoder)
        said = overlap_note(train, val)
        if said is not None:
            note(said)
            notes.append(said)
        held, sides = "", _fillers(folder, cfg, encoder, "--val-data", (train.bad, val.bad))
        for read, side in ((train, sides[0]), (val, sides[1])):
            if read.docs:
                fill_texts(read.docs, side, read.flag)
            else:
                fill_records(read, fields, [side], None)
    infos = {name: side.finish() for name, side in zip(SIDES, sides, strict=True)}
    return {
        "version": VERSION,
        "dtype": np.dtype(encoder.dtype).name,
        "unit": encoder.unit,
        "sides": infos,
        "bad": {
            "count": sides[0].bad.count + sides[1].bad.count,
            "examples": [*sides[0].bad.examples, *sides[1].bad.examples],
        },
        "held": held,
        "notes": notes,
        "built": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _open(folder: Path, meta: dict, cfg: Any, source: str, prepared: Prepared) -> TextSource:
    dtype, sides = np.dtype(meta["dtype"]), []
    for name in SIDES:
        info = meta["sides"][name]
        data = Sequences.stored(folder, name, info, dtype)
        sides.append(Side(data, info["files"], info["kinds"], info["no_target"]))
    bad = BadRecords(meta["bad"]["count"], list(meta["bad"]["examples"]))
    return TextSource(
        sides[0], sides[1], source, cfg.val_data, cfg.seq_len, meta["unit"], bad, meta["held"],
        prepared,
    )  # fmt: skip


def prepare(cfg: Any, encoder: Encoder) -> TextSource:
    """The data ``cfg`` names, tokenized by ``encoder`` into a token store (or one built
    before, reused) and opened."""
    started = time.perf_counter()
    specs = (
        resolve(cfg.data, "--data", cfg.data_split),
        resolve(cfg.val_data, "--val-data", cfg.val_data_split) if cfg.val_data else None,
    )
    root, key = cache_root(), store_key(_inputs(cfg, encoder, specs))
    found = find(root, key)
    if found is not None:
        folder, meta = found
        for line in meta["notes"]:
            note(line)
        prepared = Prepared(str(folder), True, 0.0, meta["built"], tuple(meta["notes"]))
        return _open(folder, meta, cfg, specs[0].source, prepared)
    build = Build(root, key)
    try:
        meta = _build(build.folder, cfg, encoder, specs)
        meta["seconds"] = time.perf_counter() - started
        folder = build.publish(meta)
    except BaseException:
        build.discard()
        raise
    if build.moved:
        note(f"note: the token store is in a temporary folder, not kept: {build.moved}")
    prepared = Prepared(str(folder), False, meta["seconds"], meta["built"], tuple(meta["notes"]))
    return _open(folder, meta, cfg, specs[0].source, prepared)
