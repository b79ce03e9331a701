"""Which files ``--data`` names (gradstep_cli.data.files): a file, a folder or a glob; files
that are not text, not regular or not readable are refused or skipped, saying why."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from gradstep_cli.cli import main
from gradstep_cli.data.sources import DataError, load_corpus
from tests.support.batches import text_corpus

GPT = [
    "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16",
    "--micro-batch-size", "2", "--accum-steps", "1", "--eval-batches", "1",
    "--sample-tokens", "0", "--warmup", "1", "--max-steps", "1",
]  # fmt: skip

HF = [
    "--seq-len", "32", "--micro-batch-size", "2", "--accum-steps", "1", "--eval-batches", "1",
    "--sample-tokens", "0", "--warmup", "1", "--max-steps", "1",
]  # fmt: skip


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
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return text_corpus(tmp_path_factory.mktemp("data") / "corpus")


def _unblocked(capsys, tmp_path: Path, *flags: str) -> str:
    """``gpt``'s refusal, from a thread: opening a FIFO would block, and this must not."""
    result: list[str] = []
    run = lambda: result.append(train(capsys, tmp_path, *flags))  # noqa: E731
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the refusal blocked (was the named pipe opened?)"
    return result[0]


def test_user_data_file_folder_and_glob(tmp_path: Path) -> None:
    for i in range(12):
        sub = tmp_path / f"d{i % 3}"
        sub.mkdir(exist_ok=True)
        (sub / f"f{i}.txt").write_text(f"hello {i} " * 50)
    (tmp_path / "d0" / "blob.bin").write_bytes(b"\x00\x01\x02" * 10)  # binary: skipped
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "x.txt").write_text("secret")  # hidden: skipped

    folder = load_corpus(str(tmp_path))
    names = [d.name for d in folder.train + folder.val]
    assert len(names) == 12 and "d0/blob.bin" not in names
    assert folder.val and not {d.name for d in folder.train} & {d.name for d in folder.val}

    globbed = load_corpus(str(tmp_path / "d1" / "*.txt"))
    assert len(globbed.train) + len(globbed.val) == 4 and globbed.val

    single = load_corpus(str(tmp_path / "d2" / "f2.txt"))
    data = (tmp_path / "d2" / "f2.txt").read_bytes()
    assert single.train[0].data + single.val[0].data == data  # tail is validation

    with pytest.raises(DataError, match="no such"):
        load_corpus(str(tmp_path / "missing"))
    with pytest.raises(DataError, match="no files found"):
        load_corpus(str(tmp_path / "*.nothing"))


def test_refused_files_say_why(tmp_path: Path) -> None:
    """Robustness O16: text followed by NUL bytes was refused as "no non-empty UTF-8 text"
    without saying the file is binary. Each refused kind of file is named with its reason."""
    nul_later = tmp_path / "nulllater.txt"
    nul_later.write_bytes(b"print('hello')\n" * 800 + b"\x00" * 50_000)  # NUL after 12 KB
    with pytest.raises(DataError) as exc:
        load_corpus(str(nul_later))
    assert "'nulllater.txt' is binary (NUL bytes)" in str(exc.value), exc.value
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.bin").write_bytes(b"\x00\x01")
    (mixed / "b.bin").write_bytes(b"abc\x00")
    (mixed / "empty.txt").write_bytes(b"")
    (mixed / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError) as exc:
        load_corpus(str(mixed))
    message = str(exc.value)
    assert message.startswith(f"--data {str(mixed)!r}: no non-empty UTF-8 text files found")
    for part in ("2 files are binary (NUL bytes), e.g. 'a.bin'", "'empty.txt' is empty",
                 "'latin1.txt' is not UTF-8 text"):  # fmt: skip
        assert part in message, message
    (mixed / "ok.txt").write_text("text " * 100)  # one usable file: the others are skipped
    corpus = load_corpus(str(mixed))
    assert [d.name for d in corpus.train + corpus.val] == ["ok.txt", "ok.txt#val"]


def test_missing_data_fails_clearly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--data", str(tmp_path / "nope"), "--out", str(tmp_path)]) == 2
    assert "--data" in capsys.readouterr().err


def test_data_folder_with_glob_characters_and_late_nul_bytes(tmp_path, capsys):
    folder = tmp_path / "run[1]"  # row 55: an existing path is not a glob pattern
    folder.mkdir()
    (folder / "a.py").write_text("def f(x):\n    return x\n" * 400)
    binary = folder / "b.txt"  # row 56: NUL bytes after 8 KB mark a binary file
    binary.write_bytes(b"text " * 2000 + b"\x00" * 5000)
    from gradstep_cli.data.sources import load_corpus

    corpus = load_corpus(str(folder))
    assert {d.name.removesuffix("#val") for d in (*corpus.train, *corpus.val)} == {"a.py"}


@pytest.mark.parametrize("flag", ["--data", "--val-data"])
def test_special_files_are_not_regular_files_and_are_never_opened(
    tmp_path, corpus, capsys, flag
) -> None:
    """H2, H3, H4 and a socket: 'no such file or folder' for a file that exists."""
    fifo, sock_path = tmp_path / "fifo.jsonl", tmp_path / "s.sock"
    os.mkfifo(fifo)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(sock_path))
    cases = {fifo: "a named pipe", sock_path: "a socket"}
    cases.update({Path(p): "a character device" for p in ("/dev/zero", "/dev/urandom")
                  if Path(p).exists()})  # fmt: skip
    try:
        for path, kind in cases.items():
            data = [str(path)] if flag == "--data" else [str(corpus), flag, str(path)]
            line = _unblocked(capsys, tmp_path, "--data", *data)
            assert f"{flag} {str(path)!r} is {kind}, not a regular file" in line, line
    finally:
        sock.close()


def test_a_folder_of_a_symlinked_folder_or_a_pipe_says_so(tmp_path, corpus, capsys) -> None:
    """H6: 'no files found (hidden ones are skipped)' for a folder whose only entry is a
    symlinked folder (not followed), or a named pipe."""
    linkdir = tmp_path / "linkdir"
    linkdir.mkdir()
    (linkdir / "t").symlink_to(corpus, target_is_directory=True)
    line = train(capsys, tmp_path, "--data", str(linkdir))
    assert "'t' is a symlinked folder (not followed)" in line, line
    assert f"name it: --data {linkdir / 't'}" in line, line
    pipes = tmp_path / "pipes"
    pipes.mkdir()
    os.mkfifo(pipes / "p.jsonl")
    line = _unblocked(capsys, tmp_path, "--data", str(pipes))
    assert "'p.jsonl' is a named pipe" in line, line
