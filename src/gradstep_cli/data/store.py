"""The token store: a run's data tokenized once, on disk, read a row at a time.

Layout of one store, a folder ``<cache>/tokens/<key>/`` (per side, ``train`` and ``val``):

* ``SIDE.ids``: every token, flat (``int32``; ``uint8`` bytes for the demo GPT): the
  side's documents, then its records, each in file order;
* ``SIDE.mask``: one byte per token, 1 where it is a target (only when the side has records);
* ``SIDE.offsets.npy``: where each document starts and ends (``int64``, documents + 1);
* ``SIDE.records.npy``: each record's (start, length, first target) (``int64``, records x 3);
* ``meta.json``: the counts, the notes and the digest of each side (the digest
  :class:`~gradstep_cli.data.tokenized.Sequences` would compute in memory: a resume checks
  it), and the key's inputs, in words.

The key hashes everything that changes the tokens: the data (each file's path, size and
change times; a Hub dataset's fingerprint), the tokenizer (its files and its live state:
vocabulary, chat template, special tokens), and the settings (``--val-data``,
``--val-fraction``, ``--skip-bad-records``, field names, ``--chat-template-kwargs``). A
store is written into a temporary folder and renamed into place when complete, so a
killed build leaves nothing that could be reused, and two builders never mix.

Where: ``$GRADSTEP_CACHE/tokens`` (default ``$XDG_CACHE_HOME/gradstep`` or
``~/.cache/gradstep``); ``rm -rf ~/.cache/gradstep/tokens`` clears it.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import weakref
from array import array
from pathlib import Path
from typing import Any

import numpy as np

from gradstep_cli.data.records import Encoded

__all__ = [
    "VERSION",
    "Build",
    "SideWriter",
    "StoreFile",
    "cache_root",
    "find",
    "store_key",
    "tokenizer_stamp",
]

VERSION = 1
"""Bump when the layout or the tokenization of a store changes: older stores are not read."""
BLOCK = 8 * 2**20
_SKIP_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx")
_TOKENIZER_FILE_BYTES = 64 * 2**20  # larger files in a tokenizer's folder are weights


def cache_root() -> Path:
    """``$GRADSTEP_CACHE/tokens``, else ``$XDG_CACHE_HOME/gradstep/tokens``, else
    ``~/.cache/gradstep/tokens``."""
    base = os.environ.get("GRADSTEP_CACHE")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "gradstep")
    return Path(base).expanduser() / "tokens"


def _folder_files(path: Path) -> list[Path]:
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return [
        p
        for p in files
        if not p.name.endswith(_SKIP_SUFFIXES) and p.stat().st_size <= _TOKENIZER_FILE_BYTES
    ]


def tokenizer_stamp(tokenizer: Any) -> str | None:
    """A hash of the tokenizer's files and of its live state (a chat template set in
    memory counts); None for bytes."""
    if tokenizer is None:
        return None
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    where = Path(str(getattr(tokenizer, "name_or_path", "") or ""))
    if str(where) and where.exists():
        for path in _folder_files(where):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    state = {
        "template": getattr(tokenizer, "chat_template", None),
        "special": getattr(tokenizer, "special_tokens_map", None),
        "eos": getattr(tokenizer, "eos_token_id", None),
        "bos": getattr(tokenizer, "bos_token_id", None),
        "vocab": len(tokenizer),
    }
    h.update(json.dumps(state, sort_keys=True, default=str).encode())
    return h.hexdigest()


def store_key(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _valid(folder: Path, meta: dict[str, Any]) -> bool:
    """Every file of the store is there at the size its meta says."""
    for side, info in meta.get("sides", {}).items():
        size = info["tokens"] * np.dtype(meta["dtype"]).itemsize
        files = {f"{side}.ids": size, f"{side}.offsets.npy": None, f"{side}.records.npy": None}
        if info["mask"]:
            files[f"{side}.mask"] = info["tokens"]
        for name, want in files.items():
            path = folder / name
            if not path.is_file() or (want is not None and path.stat().st_size != want):
                return False
    return True


def find(root: Path, key: str) -> tuple[Path, dict[str, Any]] | None:
    """The complete store of ``key`` under ``root`` and its meta, or None; an incomplete
    or damaged one is removed (it will be built again)."""
    folder = root / key
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        meta = None
    if meta is not None and meta.get("version") == VERSION and _valid(folder, meta):
        with contextlib.suppress(OSError):
            os.utime(folder / "meta.json")  # last used: what a cleanup keeps
        return folder, meta
    if folder.exists():
        shutil.rmtree(folder, ignore_errors=True)
    return None


def _writable_root(root: Path) -> tuple[Path, str | None]:
    """``root``, created; else a temporary folder removed at exit, and why."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".probe-"):
            return root, None
    except OSError as exc:
        temp = Path(tempfile.mkdtemp(prefix="gradstep-tokens-"))
        atexit.register(shutil.rmtree, temp, True)
        return temp, f"{root} is not writable ({exc.strerror or exc}): GRADSTEP_CACHE moves it"


class Build:
    """A store being written: into a temporary folder under the cache (a temporary folder
    elsewhere when the cache cannot be written: :attr:`moved` says why), published whole."""

    def __init__(self, root: Path, key: str) -> None:
        root, self.moved = _writable_root(root)
        self.final = root / key
        self.folder = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))

    def publish(self, meta: dict[str, Any]) -> Path:
        """Write ``meta`` and rename the folder into place: the first of two concurrent
        builders of one key wins, the other's copy is dropped (they are equal)."""
        (self.folder / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
        try:
            os.rename(self.folder, self.final)
        except OSError:
            self.discard()
        return self.final

    def discard(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _copy(src: Path, dst: Any) -> None:
    with src.open("rb") as f:
        shutil.copyfileobj(f, dst, BLOCK)


class SideWriter:
    """One side's tokens as they are encoded, laid out as :class:`Sequences` lays them out:
    documents first, then records (each stream staged in its own file)."""

    def __init__(self, folder: Path, side: str, dtype: type) -> None:
        self.folder, self.side, self.dtype = folder, side, np.dtype(dtype)
        self._docs = (folder / f"{side}.ids").open("wb")
        self._rec_ids = (folder / f"{side}.rec-ids").open("wb")
        self._rec_mask = (folder / f"{side}.rec-mask").open("wb")
        self.doc_lengths, self.rec_lengths, self.rec_first = array("q"), array("q"), array("q")
        self._open_doc = 0  # tokens of the document being written

    def document(self, ids: np.ndarray, last: bool) -> None:
        """Part of a document's tokens (``last``: its end)."""
        self._docs.write(np.ascontiguousarray(ids, dtype=self.dtype).tobytes())
        self._open_doc += len(ids)
        if last:
            self.doc_lengths.append(self._open_doc)
            self._open_doc = 0

    def record(self, encoded: Encoded) -> None:
        self._rec_ids.write(np.ascontiguousarray(encoded.ids, dtype=self.dtype).tobytes())
        self._rec_mask.write(np.ascontiguousarray(encoded.trainable, dtype=np.uint8).tobytes())
        self.rec_lengths.append(len(encoded.ids))
        self.rec_first.append(encoded.first_target())

    def finish(self) -> dict[str, Any]:
        """Lay the side out and return its meta (counts and digest)."""
        for f in (self._docs, self._rec_ids, self._rec_mask):
            f.close()
        folder, side = self.folder, self.side
        doc_lengths = np.frombuffer(self.doc_lengths, dtype=np.int64)
        offsets = np.concatenate(([0], np.cumsum(doc_lengths))).astype(np.int64)
        rec_lengths = np.frombuffer(self.rec_lengths, dtype=np.int64)
        starts = offsets[-1] + np.concatenate(([0], np.cumsum(rec_lengths)))[:-1]
        first = np.frombuffer(self.rec_first, dtype=np.int64)
        records = np.stack([starts, rec_lengths, first], axis=1).reshape(-1, 3).astype(np.int64)
        with (folder / f"{side}.ids").open("ab") as ids:
            _copy(folder / f"{side}.rec-ids", ids)
        has_mask = len(records) > 0
        if has_mask:
            with (folder / f"{side}.mask").open("wb") as mask:
                ones, left = np.ones(BLOCK, dtype=np.uint8).tobytes(), int(offsets[-1])
                while left:
                    mask.write(ones[: min(left, BLOCK)])
                    left -= min(left, BLOCK)
                _copy(folder / f"{side}.rec-mask", mask)
        (folder / f"{side}.rec-ids").unlink()
        (folder / f"{side}.rec-mask").unlink()
        np.save(folder / f"{side}.offsets.npy", offsets)
        np.save(folder / f"{side}.records.npy", records)
        tokens = (folder / f"{side}.ids").stat().st_size // self.dtype.itemsize
        digest = _digest(folder, side, offsets, records, has_mask)
        return {"tokens": tokens, "documents": len(doc_lengths), "records": len(records),
                "mask": has_mask, "digest": digest}  # fmt: skip


def _digest(folder: Path, side: str, offsets: np.ndarray, records: np.ndarray, mask: bool) -> str:
    """``Sequences.digest`` of the side, read back in blocks: ids, offsets, records, mask."""
    h = hashlib.blake2b(digest_size=12)

    def stream(path: Path) -> None:
        with path.open("rb") as f:
            while block := f.read(BLOCK):
                h.update(block)

    stream(folder / f"{side}.ids")
    h.update(offsets.tobytes())
    h.update(records.tobytes())
    if mask:
        stream(folder / f"{side}.mask")
    return h.hexdigest()


class StoreFile:
    """Tokens (or a mask) of a store's file, read by position: nothing stays mapped, so the
    process holds only the rows it reads."""

    def __init__(self, path: Path, dtype: Any) -> None:
        self.path, self.dtype = path, np.dtype(dtype)
        self._fd: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "dtype": self.dtype, "_fd": None}

    def read(self, start: int, count: int) -> np.ndarray:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
            weakref.finalize(self, os.close, self._fd)
        size = self.dtype.itemsize
        data = os.pread(self._fd, count * size, start * size)
        while len(data) < count * size:  # a short read (never at a regular file's middle)
            more = os.pread(self._fd, count * size - len(data), start * size + len(data))
            if not more:
                raise OSError(f"{self.path} is shorter than its token store says")
            data += more
        return np.frombuffer(data, dtype=self.dtype)
