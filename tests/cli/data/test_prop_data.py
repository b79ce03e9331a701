"""What the CLI's data path trains on, stated as properties of the documents and records.

The stream is driven exactly as ``gradstep train`` drives it: files on disk, read by
``load_source`` (bytes for the demo GPT), cut by ``rank_batches`` into each rank's
``TrainBatches``, grouped by ``windows_of`` under the run's ``layout_for`` (fixed
``--accum-steps`` micro-batches, or an exact ``--global-batch`` of single rows merged into
micro-batches), ranks in lockstep, and a resume continuing from rank 0's
``state_dict()`` (what the checkpoint holds), through JSON, possibly on another number of
ranks with the global batch kept. The reference is computed the plain way, from the texts.

Every token of the texts is identifiable: the texts are disjoint slices of one de Bruijn
sequence of order 2 over 117 printable-or-control, non-whitespace ASCII bytes, so each
ordered byte pair occurs at one place only, and a trained (input, target) pair names the
document and the position in it (or shows it crosses two texts, or is padding).

Properties (``k``: rows per stream item, ``--micro-batch-size`` with ``--accum-steps``, 1
with ``--global-batch``):

* text documents: in each complete epoch (all ranks together; across the epoch boundary;
  across a resume) every consecutive pair ``(doc[p], doc[p+1])`` is a target exactly once,
  and no other pair ever is. The stream cuts each epoch's rows into micro-batches of ``k``
  rows, the last one holding the rows left (fewer when they do not divide), so nothing of
  an epoch is dropped. Every row is one contiguous piece of one document of at most
  ``seq_len`` targets.
* prompt/completion records: no prompt token is ever a target; a record is one row whose
  targets are all of its completion's tokens (each predicted from the token before it,
  the first from the prompt's last), so in each complete epoch each record that fits (its
  completion at most ``seq_len`` bytes, docs/guide/cli.md "Too long") is trained exactly once; a
  record whose completion does not fit is never trained.
"""

from __future__ import annotations

import collections
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from gradstep_cli.config.settings import TrainConfig
from gradstep_cli.data.batching import layout_for, rank_batches, windows_of
from gradstep_cli.data.sources import IGNORE_INDEX, TrainBatches, load_source

# Each example takes milliseconds: more of them than the profile's default.
EXAMPLES = 4 * int(os.environ.get("GRADSTEP_HYPOTHESIS_EXAMPLES", "12"))

EPOCHS = 2  # complete epochs checked: the second is reached across the epoch boundary

MAX_ROUNDS = 5000

ONE_BYTE_ROWS = {"seq_len": 1, "mbs": 1, "k": 2, "rows": 0, "seed": 0}


def _de_bruijn(k: int) -> list[int]:
    """A de Bruijn sequence of order 2 over ``range(k)``, linear: every ordered pair of
    symbols is a consecutive pair exactly once (``k * k + 1`` symbols)."""
    a, out = [0] * (2 * k), []

    def db(t: int, p: int) -> None:
        if t > 2:
            if 2 % p == 0:
                out.extend(a[1 : p + 1])
            return
        a[t] = a[t - p]
        db(t + 1, p)
        for j in range(a[t - p] + 1, k):
            a[t] = j
            db(t + 1, t)

    db(1, 1)
    return out + out[:1]


# Non-whitespace ASCII without NUL (str.strip() strips 9-13 and 28-32): valid UTF-8 text,
# and a prompt or completion of it is never blank.
ALPHABET = [b for b in range(1, 128) if not (9 <= b <= 13 or 28 <= b <= 32)]

TEXT = bytes(ALPHABET[i] for i in _de_bruijn(len(ALPHABET)))

PAIR_AT = {(TEXT[i], TEXT[i + 1]): i for i in range(len(TEXT) - 1)}

assert len(PAIR_AT) == len(TEXT) - 1  # every pair once

VAL_TEXT = b"validation text, never trained on.\n" * 40


@dataclass(frozen=True)
class Piece:
    """One text (document, or record's prompt + completion) at ``TEXT[start:start + n]``;
    for a record, its first ``prompt`` bytes are the prompt."""

    start: int
    n: int
    prompt: int = 0


def _layout(pieces: list[int], gap: int = 1) -> list[int]:
    """Start offsets of consecutive slices of ``TEXT`` with lengths ``pieces``."""
    starts, at = [], 0
    for n in pieces:
        starts.append(at)
        at += n + gap
    assert at <= len(TEXT), "test data larger than the de Bruijn text"
    return starts


def _where(pieces: list[Piece], target: int) -> tuple[int, int] | None:
    """(piece, position of the target in it) of TEXT index ``target`` whose input is
    ``target - 1`` in the same piece, else None (a pair across two texts)."""
    for i, piece in enumerate(pieces):
        if piece.start < target < piece.start + piece.n:
            return i, target - piece.start
    return None


class _Tagged(Iterator[Any]):
    """The rank's stream, recording the epoch of each row of the items it yields."""

    def __init__(self, stream: TrainBatches) -> None:
        self.stream, self.tags = stream, []

    def __next__(self) -> Any:
        item = next(self.stream)
        epoch = int(self.stream.state_dict()["epoch"])
        self.tags += [epoch] * len(item["input_ids"])  # an epoch's last item may be short
        return item


def _config(folder: Path, data: Path, world: int, batch: dict[str, int]) -> TrainConfig:
    mbs, k, rows = batch["mbs"], batch["k"], batch["rows"]
    exact = {"global_batch": rows * world} if rows else {"accum_steps": k}
    return TrainConfig(
        data=str(data),
        val_data=str(folder / "val.txt"),
        seq_len=batch["seq_len"],
        micro_batch_size=mbs,
        seed=batch["seed"],
        eval_batches=3,  # one validation batch for each of up to 3 ranks
        **exact,
    )


def _ranks(cfg: TrainConfig, world: int) -> tuple[Any, list[_Tagged], list[Iterator]]:
    source = load_source(cfg)
    layout = layout_for(cfg, world)
    streams = [_Tagged(rank_batches(cfg, source, layout, r, world)[0]) for r in range(world)]
    return layout, streams, [windows_of(s, layout) for s in streams]


def trained_rows(
    folder: Path, data: Path, world: int, batch: dict[str, int], stop: int, world2: int
) -> tuple[list[tuple[int, torch.Tensor, torch.Tensor]], int]:
    """Every row the ranks train on, ``(epoch, input_ids, labels)``, until every rank has
    reached epoch ``EPOCHS``; after ``stop`` steps the run is resumed on ``world2`` ranks
    from rank 0's state (the global batch kept). Also the stream's rows per item."""
    (folder / "val.txt").write_bytes(VAL_TEXT)
    cfg = _config(folder, data, world, batch)
    layout, streams, gens = _ranks(cfg, world)
    out, step = [], 0
    while min((s.tags[-1] if s.tags else -1) for s in streams) < EPOCHS:
        assert step < MAX_ROUNDS, "the stream never reaches the next epoch"
        if step == stop:
            state = json.loads(json.dumps(streams[0].stream.state_dict()))
            resumed = dict(batch)
            if batch["rows"]:
                resumed["rows"] = batch["rows"] * world // world2
            else:
                resumed["k"] = batch["k"] * world // world2
            world, cfg = world2, _config(folder, data, world2, resumed)
            layout, streams, gens = _ranks(cfg, world)
            for s in streams:
                s.stream.load_state_dict(state)
        for rank in range(world):
            pulled = len(streams[rank].tags)
            window = next(gens[rank])
            tags = streams[rank].tags[pulled:]  # the rows this window took, in order
            rows = [row for mb in window for row in zip(mb["input_ids"], mb["labels"], strict=True)]
            assert len(rows) == len(tags), (len(rows), len(tags))
            out += [(tags[i], ids, lab) for i, (ids, lab) in enumerate(rows)]
        step += 1
    return out, layout.stream_rows


def _row_targets(ids: torch.Tensor, labels: torch.Tensor) -> list[int | None]:
    """The TEXT index of each target of one row (None: a pair that is in no text)."""
    keep = labels != IGNORE_INDEX
    pairs = zip(ids[keep].tolist(), labels[keep].tolist(), strict=True)
    return [(PAIR_AT[p] + 1 if p in PAIR_AT else None) for p in pairs]


def _runs(indices: list[int]) -> list[list[int]]:
    """Maximal runs of consecutive integers."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


@st.composite
def batching(draw: st.DrawFn) -> dict[str, Any]:
    """seq_len, rows per micro-batch, and either --accum-steps or --global-batch; the
    ranks, when the run is resumed, and on how many ranks."""
    world = draw(st.integers(1, 3))
    exact = draw(st.booleans())
    batch = {
        "seq_len": draw(st.integers(1, 9)),
        "mbs": draw(st.integers(1, 4)),
        "k": draw(st.integers(1, 3)),
        "rows": draw(st.integers(1, 3)) if exact else 0,
        "seed": draw(st.integers(0, 2**16)),
    }
    total = batch["rows"] * world if exact else batch["k"] * world
    world2 = draw(st.sampled_from([w for w in (1, 2, 3) if total % w == 0]))
    # Resumed after 0..5 steps (often mid-epoch: an epoch here is a few steps).
    return {"world": world, "batch": batch, "stop": draw(st.integers(0, 5)), "world2": world2}


def _split_by_doc(docs: list[Piece], run: list[int]) -> list[list[int]]:
    """A run of consecutive TEXT indices split where it changes document."""
    out: dict[int, list[int]] = {}
    for t in run:
        out.setdefault(_where(docs, t)[0], []).append(t)
    return list(out.values())


@settings(max_examples=EXAMPLES)
@example(  # 2 ranks cross the epoch boundary in different steps, then resume on 1
    lengths=[0],
    run={"world": 2, "batch": ONE_BYTE_ROWS, "stop": 2, "world2": 1},
)
@given(
    lengths=st.lists(st.integers(0, 70), min_size=1, max_size=6),
    run=batching(),
)
def test_every_consecutive_pair_of_a_document_trains_once_per_epoch(
    lengths: list[int], run: dict[str, Any]
) -> None:
    batch, world = run["batch"], run["world"]
    k = 1 if batch["rows"] else batch["mbs"]
    # Enough rows that every rank gets a micro-batch in every epoch (else: a DataError).
    lengths = [*lengths, (batch["seq_len"] + 1) * k * max(world, run["world2"]) * 2]
    starts = _layout(lengths)
    docs = [Piece(s, n) for s, n in zip(starts, lengths, strict=True)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        data = folder / "docs"
        data.mkdir()
        for i, d in enumerate(docs):
            (data / f"d{i:02d}.txt").write_bytes(TEXT[d.start : d.start + d.n])
        rows, per_item = trained_rows(folder, data, world, batch, run["stop"], run["world2"])
    # The plain way: every consecutive pair of every document (TEXT index of the target).
    expected = {d.start + p for d in docs for p in range(1, d.n)}
    per_epoch: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for epoch, ids, labels in rows:
        targets = _row_targets(ids, labels)
        assert None not in targets, ("a pair that is in no document", ids, labels)
        assert all(t in expected for t in targets), ("a pair across two documents", targets)
        assert 1 <= len(targets) <= batch["seq_len"], targets
        assert targets == list(range(targets[0], targets[0] + len(targets))), targets
        assert len({_where(docs, t)[0] for t in targets}) == 1, targets  # one document
        per_epoch[epoch].update(targets)
    for epoch in range(EPOCHS):
        counts = per_epoch[epoch]
        twice = {t: n for t, n in counts.items() if n > 1}
        assert not twice, (epoch, "pairs trained more than once", twice)
        missing = sorted(expected - set(counts))
        runs = [r for run_ in _runs(missing) for r in _split_by_doc(docs, run_)]
        assert not missing, (epoch, per_item, [(_where(docs, r[0]), len(r)) for r in runs])


@settings(max_examples=EXAMPLES)
@given(
    records=st.lists(st.tuples(st.integers(1, 10), st.integers(1, 11)), min_size=1, max_size=14),
    text_records=st.lists(st.integers(2, 30), max_size=2),
    run=batching(),
)
def test_every_completion_token_trains_once_per_epoch_and_no_prompt_token_does(
    records: list[tuple[int, int]], text_records: list[int], run: dict[str, Any]
) -> None:
    batch, world = run["batch"], run["world"]
    seq = batch["seq_len"] = max(batch["seq_len"], 2)
    k = 1 if batch["rows"] else batch["mbs"]
    fits = [c <= seq for _, c in records]  # docs/guide/cli.md: "Too long" (its completion)
    # Every rank needs a micro-batch of k rows in every epoch (else: a DataError).
    assume(sum(fits) >= k * max(world, run["world2"]))
    lengths = [p + c for p, c in records] + text_records
    starts = _layout(lengths)
    recs = [Piece(s, p + c, p) for s, (p, c) in zip(starts[: len(records)], records, strict=True)]
    texts = [Piece(s, n) for s, n in zip(starts[len(records) :], text_records, strict=True)]
    lines = [
        {"prompt": TEXT[r.start : r.start + r.prompt].decode(), "id": i}
        | {"completion": TEXT[r.start + r.prompt : r.start + r.n].decode()}
        for i, r in enumerate(recs)
    ]
    lines += [{"text": TEXT[t.start : t.start + t.n].decode()} for t in texts]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        data = folder / "records.jsonl"
        data.write_text("".join(json.dumps(line) + "\n" for line in lines))
        rows, per_item = trained_rows(folder, data, world, batch, run["stop"], run["world2"])
    # The plain way: a record's targets are its completion's bytes (TEXT indices).
    completion = [set(range(r.start + r.prompt, r.start + r.n)) for r in recs]
    prompt = {t for r in recs for t in range(r.start, r.start + r.prompt)}
    pieces = recs + texts
    per_epoch: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for epoch, ids, labels in rows:
        targets = _row_targets(ids, labels)
        assert None not in targets, ("a pair that is in no record", ids, labels)
        assert not prompt & set(targets), ("a prompt token is a target", targets)
        places = [_where(pieces, t) for t in targets]
        assert None not in places, ("a pair across two records", targets)
        assert len({i for i, _ in places}) == 1, ("a row of two records", targets)
        piece = places[0][0]
        if piece < len(recs):
            assert set(targets) == completion[piece], ("a record's row", piece, targets)
            assert fits[piece], ("a record whose completion does not fit trained", piece)
        per_epoch[epoch][piece] += 1
    for epoch in range(EPOCHS):
        counts = per_epoch[epoch]
        twice = {i: n for i, n in counts.items() if i < len(recs) and n > 1}
        assert not twice, (epoch, "records trained more than once", twice)
        missing = [i for i in range(len(recs)) if fits[i] and not counts[i]]
        assert not missing, (epoch, per_item, missing)
