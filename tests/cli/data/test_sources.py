"""A run's data (gradstep_cli.data.sources): the default corpus, text and records split into
training and validation, and the refusals of data that cannot train."""

from __future__ import annotations

import json
import math
import pathlib
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from gradstep_cli.cli import main
from gradstep_cli.config.settings import TrainConfig
from gradstep_cli.data.sources import (
    _held_out,
    _path_hash,
    _unit,
    collate,
    default_corpus_files,
    load_corpus,
    load_source,
)

SMALL = [
    "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16",
    "--micro-batch-size", "2", "--accum-steps", "2", "--eval-batches", "1",
    "--sample-tokens", "0", "--warmup", "1", "--eval-every", "0", "--max-steps", "2",
]  # fmt: skip


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


GOOD = [{"prompt": f"q{i}: ", "completion": f"answer {i}"} for i in range(6)]


def jsonl(path: Path, lines: list[Any]) -> Path:
    """Write ``lines`` (records as JSON, str / bytes as they are), one per line."""
    raw = [
        line
        if isinstance(line, bytes)
        else (line if isinstance(line, str) else json.dumps(line)).encode()
        for line in lines
    ]
    path.write_bytes(b"\n".join(raw) + b"\n")
    return path


def source(data: Path, tokenizer: Any = None, **cfg: Any) -> Any:
    return load_source(TrainConfig(data=str(data), **{"seq_len": 32, **cfg}), tokenizer)


GPT = [
    "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16",
    "--micro-batch-size", "2", "--accum-steps", "1", "--eval-batches", "1",
    "--sample-tokens", "0", "--warmup", "1", "--max-steps", "1",
]  # fmt: skip

HF = [
    "--seq-len", "32", "--micro-batch-size", "2", "--accum-steps", "1", "--eval-batches", "1",
    "--sample-tokens", "0", "--warmup", "1", "--max-steps", "1",
]  # fmt: skip

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def pairs(n: int) -> list[dict[str, str]]:
    return [{"prompt": f"q{i}: ", "completion": f"a{i} b"} for i in range(n)]  # fits --seq-len 16


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run the CLI, expect exit status 2 and one error line; return that line."""
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if " error: " in line]
    assert len(lines) == 1, err
    return lines[0]


def train(capsys: Any, tmp_path: Path, *flags: str, model: Path | None = None) -> str:
    """``refused`` for a tiny run into ``tmp_path/run``: the demo GPT, or ``hf:model``."""
    size = GPT if model is None else ["--model", f"hf:{model}", *HF]
    return refused(capsys, "train", *size, "--out", str(tmp_path / "run"), *flags)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("transformers")
    from tests.support import hf_assets

    root = tmp_path_factory.mktemp("hf")
    return {
        "llama": hf_assets.model_dir(root / "llama", "llama", seed=0),
        "notok": hf_assets.model_dir(root / "notok", "llama", seed=0, tokenizer=False),
    }


def test_default_corpus_is_deterministic_and_split_by_file() -> None:
    first, second = load_corpus(), load_corpus()
    assert [d.name for d in first.train] == [d.name for d in second.train]
    assert [d.name for d in first.val] == [d.name for d in second.val]
    train_names, val_names = {d.name for d in first.train}, {d.name for d in first.val}
    assert train_names and val_names and not train_names & val_names
    total = sum(len(d.data) for d in first.train + first.val)
    assert 1_000_000 < total <= 3_000_000
    _, files = default_corpus_files()
    assert all("/test/" not in f.as_posix() and "site-packages" not in str(f) for f in files)


def test_the_default_corpus_validates_on_a_bounded_part_user_data_on_all(
    tmp_path, capsys, monkeypatch
) -> None:
    """The default corpus's held-out files are scored up to DEFAULT_VAL_BYTES (so `make
    train`'s evaluations stay quick), said in a note; its training side is what the split
    made it; user data's held-out part is scored whole however large."""
    from gradstep_cli.data.files import DEFAULT_VAL_BYTES

    monkeypatch.setenv("GRADSTEP_CACHE", str(tmp_path / "cache"))
    whole = load_corpus()  # the split's rule, unbounded
    held_bytes = sum(len(d.data) for d in whole.val)
    assert held_bytes > 4 * DEFAULT_VAL_BYTES  # the bound matters
    src = load_source(TrainConfig(seq_len=64))
    err = capsys.readouterr().err
    assert 0 < len(src.val.data) <= DEFAULT_VAL_BYTES
    assert src.train.files == len(whole.train)
    assert len(src.train.data) == sum(len(d.data) for d in whole.train)
    said = re.search(r"validates on (\d+) of the (\d+) files it holds out", err)
    assert said and int(said[1]) == src.val.files and int(said[2]) == len(whole.val), err
    again = load_source(TrainConfig(seq_len=64))
    assert again.prepared.reused and said[0] in capsys.readouterr().err  # said on every run
    user = tmp_path / "user"
    user.mkdir()
    for i in range(20):  # files of ~40 KB: each held out is more than the default's bound
        (user / f"f{i}.py").write_text(f"# file {i}\n" + f"x_{i} = {i}  # some code\n" * 1500)
    mine, held = source(user), load_corpus(str(user)).val
    assert mine.val.files == len(held) and len(mine.val.data) == sum(len(d.data) for d in held)
    assert len(mine.val.data) > DEFAULT_VAL_BYTES
    assert "validates on" not in capsys.readouterr().err


def test_collate_pads_and_shifts() -> None:
    batch = collate([b"abcde", b"xy", b"pqrs"])
    assert batch["input_ids"].tolist() == [
        [97, 98, 99, 100],
        [120, 0, 0, 0],
        [112, 113, 114, 0],
    ]
    assert batch["labels"].tolist() == [
        [98, 99, 100, 101],
        [121, -100, -100, -100],
        [113, 114, 115, -100],
    ]


def test_data_that_cannot_train(tmp_path, capsys, monkeypatch):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("hi")
    base = ["train", *SMALL, "--out", str(tmp_path / "run")]
    code, err = run(capsys, *base, "--data", str(tiny))  # row 51
    assert code == 2 and "micro-batches" in err and "use more data" in err
    assert "val_loss" not in err  # refused before any evaluation ran
    folder = tmp_path / "noperm"
    folder.mkdir()
    (folder / "a.txt").write_text("some text " * 100)
    real = pathlib.Path.read_bytes

    def unreadable(self: Path) -> bytes:
        if self.name == "a.txt":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(pathlib.Path, "read_bytes", unreadable)  # row 54 (root reads mode 000)
    code, err = run(capsys, *base, "--data", str(folder))
    assert code == 2 and "cannot read" in err and "a.txt" in err


def test_held_out_records_are_a_stable_fraction(tmp_path: Path) -> None:
    records = [{"prompt": f"p{i}", "completion": f"c{i % 50}"} for i in range(400)]
    data = jsonl(tmp_path / "d.jsonl", records)
    for fraction in (0.1, 0.25, 0.5):
        a, b = source(data, val_fraction=fraction), source(data, val_fraction=fraction)
        assert a.describe() == b.describe()
        n = a.counts()
        val, train = n["val_records"]["prompt/completion"], n["train_records"]["prompt/completion"]
        assert train + val == 400 and abs(val / 400 - fraction) < 0.06


def test_duplicate_records_land_on_one_side(tmp_path: Path) -> None:
    """The record is the split's key, not its line: no copy of a validation record trains."""
    records = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(60)]
    data = jsonl(tmp_path / "d.jsonl", [r for r in records for _ in range(3)])
    n = source(data, val_fraction=0.3).counts()
    val, train = n["val_records"]["prompt/completion"], n["train_records"]["prompt/completion"]
    assert val % 3 == 0 and train % 3 == 0 and val and train


def test_val_data_holds_nothing_out(tmp_path: Path) -> None:
    data = jsonl(tmp_path / "d.jsonl", GOOD)
    n = source(data, val_data=str(jsonl(tmp_path / "v.jsonl", GOOD[:2]))).counts()
    assert n["train_records"] == {"prompt/completion": 6}
    assert n["val_records"] == {"prompt/completion": 2}


@given(st.text(min_size=1, max_size=40))
def test_a_tenth_held_out_is_the_files_it_always_was(name: str) -> None:
    """--val-fraction 0.1 keeps the old rule (path hash mod 10 == 0): the default corpus's
    split, and so every earlier run's data, is unchanged."""
    assert (_unit(name) < 0.1) == (_path_hash(name) % 10 == 0)
    assert 0.0 <= _unit(name) < 1.0


@given(
    n=st.integers(1, 400),
    copies=st.integers(1, 3),
    fraction=st.floats(1e-4, 0.9999),
    prefix=st.text(max_size=6),
)
@example(n=300, copies=1, fraction=0.999, prefix="x")  # V5: every record hashes below
@example(n=5, copies=2, fraction=1e-4, prefix="")  # none does
@example(n=5, copies=3, fraction=0.9999, prefix="")  # every key does, each with copies
def test_the_split_holds_out_the_hashed_share_clamped_never_the_inverse(
    n: int, copies: int, fraction: float, prefix: str
) -> None:
    """V5, the rule of docs/guide/cli.md ("The validation split"): a distinct key is held out when
    its hash unit is below the fraction, the count clamped to [1, keys - 1]; fewer than two
    keys cannot be split. Copies land together, and the split is deterministic."""
    keys = [f"{prefix}record {i}" for i in range(n) for _ in range(copies)]
    hashed = sum(_unit(f"{prefix}record {i}") < fraction for i in range(n))
    if n < 2:
        with pytest.raises(ValueError, match="two distinct keys"):
            _held_out(keys, fraction)
        return
    held = _held_out(keys, fraction)
    assert held == _held_out(keys, fraction) and len(held) == len(keys)
    side = {}
    for key, is_val in zip(keys, held, strict=True):
        assert side.setdefault(key, is_val) == is_val  # copies on one side
    val = sum(side.values())
    assert val == min(max(hashed, 1), n - 1)  # so 1 <= val <= n - 1
    if n >= 100:  # the hash is uniform: the share asked for, never its complement
        assert abs(val / n - fraction) <= 5 * math.sqrt(fraction * (1 - fraction) / n) + 2 / n


def test_too_little_left_to_train_says_what_val_fraction_held_out(tmp_path, capsys) -> None:
    """V5: 0.999 of 300 records held out 1 (0.99: 297). Now it holds out about 299, and the
    1 left cannot fill a micro-batch of 2: the refusal says why. D10: a micro-batch larger
    than the data said 'fewer than world_size=1'."""
    data = jsonl(tmp_path / "pc.jsonl", pairs(300))
    line = train(capsys, tmp_path, "--data", str(data), "--val-fraction", "0.999")
    held = re.search(r"--val-fraction 0\.999 held (\d+) of the 300 records out", line)
    assert held and int(held.group(1)) >= 290, line
    assert "--val-data" in line and "--micro-batch-size" in line, line
    val = jsonl(tmp_path / "val.jsonl", pairs(8))
    one = ["--data", str(jsonl(tmp_path / "one.jsonl", pairs(1))), "--val-data", str(val)]
    line = train(capsys, tmp_path, "--micro-batch-size", "4", *one)
    assert "training data yields 1 sequence per epoch, 0 micro-batches of 4" in line, line
    assert "use more data or a smaller --micro-batch-size" in line and "world_size" not in line


@pytest.mark.parametrize(
    ("lines", "flags", "holds"),
    [
        ([pairs(1)[0]], [], "holds 1 record:"),
        ([pairs(1)[0]], ["--micro-batch-size", "1"], "holds 1 record:"),
        ([pairs(1)[0], '{"prompt": "a"'], ["--skip-bad-records"],
         "holds 1 record (1 more skipped as bad):"),
        ([pairs(1)[0]] * 3, [], "holds 3 records, all copies of one:"),
    ],
    ids=["D9", "D18", "D2", "copies"],
)  # fmt: skip
def test_a_file_too_small_to_split_says_where_the_record_would_go(
    tmp_path, capsys, lines, flags, holds
) -> None:
    """D2, D9, D18: 'no sequence to use (no record is left)': the one record had gone to
    validation, which the message did not say."""
    data = jsonl(tmp_path / "one.jsonl", lines)
    line = train(capsys, tmp_path, *flags, "--data", str(data))
    assert f"--data {str(data)!r} {holds} too few to split" in line, line
    assert "--val-fraction 0.1" in line and "--val-data PATH" in line, line
    assert "no record is left" not in line


def test_chat_files_too_small_to_split_name_validation(tmp_path, capsys, hf_dirs) -> None:
    """D6 (one conversation) and D5 (one without an assistant turn, one good): whichever
    side the good one goes to, the message says --val-fraction / --val-data."""
    order = [{"messages": [*CHAT["messages"][::-1]]}]  # the assistant first
    data = jsonl(tmp_path / "order.jsonl", order)
    line = train(capsys, tmp_path, "--data", str(data), model=hf_dirs["llama"])
    assert "holds 1 record: too few to split" in line and "--val-data PATH" in line, line
    silent = {"messages": [{"role": "user", "content": "nobody answers"}]}
    data = jsonl(tmp_path / "noasst.jsonl", [silent, CHAT])
    line = train(capsys, tmp_path, "--data", str(data), model=hf_dirs["llama"])
    assert "1 record with no token to train on" in line, line
    assert "--val-fraction 0.1" in line and "--val-data PATH" in line, line


def test_an_hf_model_without_a_tokenizer_is_told_to_pass_one(tmp_path, capsys, hf_dirs) -> None:
    """T3: chat data for an hf: model without tokenizer files was told 'the demo GPT reads
    bytes'."""
    data = jsonl(tmp_path / "chat.jsonl", [CHAT] * 4)
    line = train(capsys, tmp_path, "--data", str(data), model=hf_dirs["notok"])
    assert f"model 'hf:{hf_dirs['notok']}' has no tokenizer" in line, line
    assert "pass --tokenizer PATH" in line and "demo GPT" not in line, line


def test_val_data_that_repeats_the_training_data_gets_a_note(tmp_path, capsys) -> None:
    """V7: --val-data equal to --data ran without a word; part of it too."""
    data = jsonl(tmp_path / "pc.jsonl", pairs(20))
    load_source(TrainConfig(data=str(data), val_data=str(data), seq_len=32))
    err = capsys.readouterr().err
    assert "note: every --val-data record is also in --data" in err, err
    val = jsonl(tmp_path / "val.jsonl", pairs(25)[15:])
    load_source(TrainConfig(data=str(data), val_data=str(val), seq_len=32))
    assert "note: 5 of the 10 --val-data records are also in --data" in capsys.readouterr().err
    for name in ("a", "b"):
        (tmp_path / f"{name}.txt").write_text(f"text {name}\n" * 50)
    load_source(TrainConfig(data=f"{tmp_path}/*.txt", val_data=str(tmp_path / "a.txt")))
    assert "note: every --val-data file is also in --data" in capsys.readouterr().err
