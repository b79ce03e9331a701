"""Which files the demo reads (gradstep_cli.data.files).

- The default corpus takes the standard library's sources in hash order while they fit
  its byte budget: a file too big for what is left is passed over, not the end of the
  selection, so no file left out would still fit (on a stand-in library whose file sizes
  hypothesis draws).
- A ``--data`` glob keeps the regular files it matches: a named pipe, a socket, a folder
  or a dangling symbolic link among the matches is passed over (and named), never opened.
"""

from __future__ import annotations

import os
import socket
import sysconfig
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from gradstep_cli.data import files as data_files


@given(
    sizes=st.lists(st.integers(1, 3000), min_size=2, max_size=14),
    budget=st.integers(1, 12_000),
)
@example(sizes=[2500, 2500, 2500, 2500, 40, 40, 40, 40, 40, 40], budget=5300)
def test_the_default_corpus_takes_every_file_that_still_fits(
    tmp_path_factory: pytest.TempPathFactory, sizes: list[int], budget: int
) -> None:
    root = tmp_path_factory.mktemp("stdlib")
    (root / "pkg").mkdir()
    (root / "test").mkdir()  # a folder the corpus skips
    files = {}
    for i, size in enumerate(sizes):
        rel = f"pkg/m{i}.py" if i % 2 else f"m{i}.py"
        (root / rel).write_bytes(b"#" * size)
        files[rel] = size
    (root / "test" / "small.py").write_bytes(b"#")
    (root / "test_small.py").write_bytes(b"#")
    real = sysconfig.get_paths

    def paths(*args: Any, **kwargs: Any) -> dict[str, str]:
        return {**real(*args, **kwargs), "stdlib": str(root)}

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sysconfig, "get_paths", paths)
        got_root, chosen = data_files.default_corpus_files(max_bytes=budget)
    assert got_root == root
    names = [p.relative_to(root).as_posix() for p in chosen]
    assert names == sorted(names) and set(names) <= set(files)
    total = sum(files[n] for n in names)
    assert total <= budget
    left_out = [n for n in files if n not in names]
    assert all(total + files[n] > budget for n in left_out), (names, left_out, budget)
    # Hash order decides among the files that fit: the first one in it is taken if it fits.
    first = min(files, key=data_files.path_hash)
    assert (first in names) == (files[first] <= budget)


def test_a_glob_keeps_only_the_regular_files_it_matches(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (data / name).write_text('{"text": "x"}\n')
    os.mkfifo(data / "pipe.jsonl")
    (data / "gone.jsonl").symlink_to(tmp_path / "missing.jsonl")
    (data / "dir.jsonl").mkdir()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(data / "s.jsonl"))
    try:
        root, paths = data_files.user_files(str(data / "*.jsonl"))
    finally:
        sock.close()
    assert root == data and paths == [data / "a.jsonl", data / "b.jsonl"]
    # Nothing regular among the matches: each one is named, none is opened.
    with pytest.raises(data_files.DataError) as caught:
        data_files.user_files(str(data / "[gp]*.jsonl"))
    message = str(caught.value)
    assert f"{str(data / 'pipe.jsonl')!r} is a named pipe" in message, message
    gone = f"{str(data / 'gone.jsonl')!r} is a symbolic link to {str(tmp_path / 'missing.jsonl')!r}"
    assert f"{gone}, which does not exist" in message, message
