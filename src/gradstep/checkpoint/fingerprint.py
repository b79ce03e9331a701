"""The fingerprint of a model's frozen base: what an adapter-only checkpoint was trained on.

A ``Checkpointer(trainable_only=True)`` checkpoint holds the adapters, not the base they
adapt: the base comes from wherever the user builds it (``from_pretrained``, a seed). A
different base with the same architecture fits every key and shape check and would load in
silence (PEFT does not check either), training on a different function. So the save
records a fingerprint of the frozen weights and the load refuses another base.

What is hashed: every frozen parameter (``requires_grad`` False) of the unwrapped module,
sorted by name, as its name, dtype, shape and raw bytes (sha256, one digest per tensor,
then one over the list). Buffers are left out: they are not weights one trains on, and some
change in training (BatchNorm statistics) while the base stays the same.

Sharding-independent: a sharded (DTensor, FSDP2) parameter is hashed as its full tensor,
gathered one parameter at a time, so a checkpoint saved on 2 ranks checks against the same
base on 1 or 4. With several ranks the tensors are hashed round-robin (rank ``i % W`` hashes
tensor ``i``) and the digests exchanged: every rank gets the same fingerprint.

Cost: one sha256 pass over the frozen weights, on up to ``_THREADS`` threads (about 1 GB/s
per core; measured in docs/library/checkpoint.md). It is computed once per model and remembered
while the frozen parameters are unchanged (same storage, same autograd version counter,
which every in-place write through the parameter bumps); a write through ``.data``
bypasses the counter.
"""

from __future__ import annotations

import hashlib
import logging
import os
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..parallel import collectives
from ..parallel.dtensor import to_local
from .errors import CheckpointError
from .state import listed

__all__ = ["ALGORITHM", "Fingerprint", "base_fingerprint", "check_base", "mismatch"]

ALGORITHM = "sha256-frozen-params-v1"
logger = logging.getLogger("gradstep.checkpoint")
_CHUNK = 64 << 20  # bytes hashed per copy: bounds the host copy of a large GPU tensor
_SHOWN = 16  # hex digits of a digest shown to people (64 bits)
_THREADS = 8  # hashing threads at most (sha256 is about 1 GB/s on one core)


@dataclass(frozen=True)
class Fingerprint:
    """The frozen base of a model: one digest, and one short digest per frozen tensor (to
    say which ones differ)."""

    digest: str
    tensors: dict[str, str]
    """``name -> "dtype shape digest16"`` for every frozen parameter."""
    nbytes: int

    def describe(self) -> str:
        """``sha256 ab12... (N frozen tensors, X MB)``."""
        return (
            f"sha256 {self.digest[:_SHOWN]} ({len(self.tensors)} frozen tensors, "
            f"{_size(self.nbytes)})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "algorithm": ALGORITHM,
            "digest": self.digest,
            "bytes": self.nbytes,
            "tensors": self.tensors,
        }

    @classmethod
    def from_json(cls, raw: Any) -> Fingerprint | None:
        """The fingerprint a manifest recorded; None when it is not one this version reads."""
        if not isinstance(raw, dict) or raw.get("algorithm") != ALGORITHM:
            return None
        digest, nbytes, tensors = raw.get("digest"), raw.get("bytes"), raw.get("tensors")
        if not (isinstance(digest, str) and isinstance(nbytes, int) and isinstance(tensors, dict)):
            return None
        return cls(digest, {str(k): str(v) for k, v in tensors.items()}, nbytes)


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def mismatch(saved: Fingerprint, now: Fingerprint, limit: int = 3) -> str:
    """What differs between two fingerprints, for a person: missing, extra and changed
    tensors (dtype, shape or values), the first ``limit`` of each."""
    if saved.digest == now.digest:
        return "nothing"
    parts = []
    missing = sorted(set(saved.tensors) - set(now.tensors))
    extra = sorted(set(now.tensors) - set(saved.tensors))
    changed = [
        k
        for k in sorted(set(saved.tensors) & set(now.tensors))
        if saved.tensors[k] != now.tensors[k]
    ]
    for label, names in (
        ("frozen tensor(s) only the checkpoint's base has", missing),
        ("frozen tensor(s) only this model has", extra),
        ("frozen tensor(s) that differ", changed),
    ):
        if names:
            parts.append(f"{len(names)} {label} ({listed(names, limit)})")
    if changed:
        first = changed[0]
        parts.append(f"e.g. {first}: checkpoint {saved.tensors[first]}, now {now.tensors[first]}")
    return "; ".join(parts) or "the tensor list is the same but the digest is not"


# Per model: (the frozen parameters' identity, the fingerprint). Weak: a model that goes away
# takes its entry with it.
_CACHE: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, Fingerprint]] = (
    weakref.WeakKeyDictionary()
)


def _frozen(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The frozen parameters of the unwrapped module, sorted by name (a tied weight once)."""
    params = collectives.unwrap(module).named_parameters()
    return sorted(((n, p) for n, p in params if not p.requires_grad), key=lambda np: np[0])


def _identity(frozen: list[tuple[str, torch.Tensor]]) -> tuple:
    """What changes when a frozen parameter is replaced or written in place."""
    out = []
    for name, p in frozen:
        local = to_local(p)
        out.append((name, local.data_ptr(), local._version, p.dtype, tuple(p.shape)))
    return tuple(out)


def base_fingerprint(module: nn.Module) -> Fingerprint:
    """The fingerprint of ``module``'s frozen parameters (collective with several ranks:
    every rank calls it, and every rank gets the same result)."""
    frozen = _frozen(module)
    key = _identity(frozen)
    cached = _CACHE.get(module)
    hit = cached is not None and cached[0] == key
    if collectives.min_over_ranks(int(hit)):  # every rank must take the same path
        return cached[1]  # type: ignore[index]
    found = _compute(frozen)
    _CACHE[module] = (key, found)
    return found


def _compute(frozen: list[tuple[str, torch.Tensor]]) -> Fingerprint:
    rank, world = collectives.rank(), collectives.world_size()
    mine: dict[str, Future] = {}
    gathered: deque[Future] = deque()  # digests of gathered copies, oldest first
    workers = max(1, min(_THREADS, os.cpu_count() or 1))
    # sha256 releases the GIL: tensors are hashed on several cores at once.
    with ThreadPoolExecutor(workers) as pool:
        for i, (name, p) in enumerate(frozen):
            if p.device.type == "meta":
                raise CheckpointError(
                    f"frozen parameter {name!r} is on the meta device (not materialised): "
                    "load the base weights before saving or loading an adapter-only checkpoint"
                )
            sharded = hasattr(p, "full_tensor")
            full = p.full_tensor() if sharded else p  # collective for a DTensor
            if i % world != rank:
                continue
            mine[name] = pool.submit(_tensor_digest, name, full.detach())
            if sharded:  # a gathered copy is memory: at most one per worker at a time
                gathered.append(mine[name])
                if len(gathered) > workers:
                    gathered.popleft().result()
        digests = _gathered({name: f.result() for name, f in mine.items()}, world)
    combined = hashlib.sha256()
    tensors: dict[str, str] = {}
    nbytes = 0
    for name, _ in frozen:
        desc, digest, size = digests[name]
        combined.update(f"{name}\t{desc}\t{digest}\n".encode())
        tensors[name] = f"{desc} {digest[:_SHOWN]}"
        nbytes += size
    return Fingerprint(combined.hexdigest(), tensors, nbytes)


def _tensor_digest(name: str, t: torch.Tensor) -> tuple[str, str, int]:
    """(``"dtype shape"``, sha256 of name, dtype, shape and bytes, byte count)."""
    desc = f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"
    h = hashlib.sha256(f"{name}\t{desc}\n".encode())
    flat = t.contiguous().reshape(-1).view(torch.uint8)
    for start in range(0, flat.numel(), _CHUNK):
        # .cpu() copies one chunk from an accelerator; on the CPU it is the view itself
        h.update(flat[start : start + _CHUNK].cpu().numpy())
    return desc, h.hexdigest(), flat.numel()


def _gathered(mine: dict[str, Any], world: int) -> dict[str, Any]:
    """Every rank's share of the per-tensor digests, merged (on every rank)."""
    if world == 1:
        return mine
    import torch.distributed as dist

    shares: list[Any] = [None] * world
    dist.all_gather_object(shares, mine)
    return {k: v for share in shares for k, v in share.items()}


def check_base(path: Path, name: str, entry: dict[str, Any], module: nn.Module) -> None:
    """Refuse to load the adapter-only manifest ``entry`` of ``name`` (checkpoint ``path``)
    onto a base other than the one it was trained on. Collective with several ranks, with
    the same verdict on every rank (the fingerprint is the same everywhere)."""
    saved = Fingerprint.from_json(entry.get("base_fingerprint"))
    if saved is None:
        logger.warning(
            "checkpoint %s holds only trainable parameters and records no base fingerprint: "
            "the frozen base it is loaded onto cannot be checked; make sure it is the base "
            "the run was trained on",
            path,
        )
        return
    now = base_fingerprint(module)
    if now.digest != saved.digest:
        raise CheckpointError(
            f"checkpoint {path}: {name!r} holds adapters trained on another base. The "
            f"checkpoint's base is {saved.describe()}, this model's is {now.describe()}: "
            f"{mismatch(saved, now)}. Build the model from the base the run was trained on "
            "(the same pretrained weights, or the same seed, dtype and adapter layout) before "
            "loading; nothing was loaded"
        )
