"""gradstep.parallel.dtensor: the one rule for "which process groups does a whole-tensor sum
of this DTensor cross", and the one rule for "what does this rank's part count for in a sum
over every rank" (``counted``), on real device meshes of a 4- or 8-rank world held by one
process.

torch's fake process group runs no collective, but the meshes, their groups and the DTensor
placements are the real ones: the rule is checked on a 1-D mesh (FSDP2) and on a (dp, tp)
mesh (FSDP2 + tensor parallel: issue 23), without starting 4 processes. What it must hold:
the groups returned are exactly the mesh dims whose ranks hold different parts, so the sizes
of those groups multiply to the number of parts the whole tensor is cut into; and summed over
every rank of the world, the weights ``counted`` gives each distinct part add up to 1 (a
3-D (dp_replicate, dp_shard, tp) mesh included, and tensors on a sub-mesh of it).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from gradstep import UnsupportedSetup
from gradstep.parallel.dtensor import counted, norm32, shard_groups, to_local, wide_dtype

WORLD = 4

# (mesh shape, its dim names, {case: (the dims of the sub-mesh, its placements)})
COUNTED = {
    4: ((2, 2), ("dp_shard", "tp"), {
        "colwise": (("dp_shard", "tp"), "SS0,S0"),
        "rowwise bias": (("dp_shard", "tp"), "S0,R"),
        "dp mesh alone": (("dp_shard",), "S0"),
        "tp mesh alone": (("tp",), "S1"),
    }),
    8: ((2, 2, 2), ("dp_replicate", "dp_shard", "tp"), {
        "colwise": (("dp_replicate", "dp_shard", "tp"), "R,SS0,S0"),
        "rowwise": (("dp_replicate", "dp_shard", "tp"), "R,S0,S1"),
        "rowwise bias": (("dp_replicate", "dp_shard", "tp"), "R,S0,R"),
        "dp mesh alone": (("dp_replicate", "dp_shard"), "R,S0"),
        "tp mesh alone, replicated": (("tp",), "R"),
    }),
}  # fmt: skip


@pytest.mark.parametrize("world", sorted(COUNTED))
def test_counted_counts_every_part_once_in_a_sum_over_every_rank(world: int) -> None:
    """Played as each rank of the world in turn (a fake group per rank): per case, the
    weights of the ranks holding one part add up to 1, for every part; a plain tensor
    counts 1/world on each rank. A mesh whose size does not divide the ranks is refused."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    shape, names, cases = COUNTED[world]
    totals: dict[tuple[str, tuple[int, ...]], float] = {}
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            root = init_device_mesh("cpu", shape, mesh_dim_names=names)
            for case, (dims, spec) in cases.items():
                mesh, placements = root[dims], _placements(spec)
                t = _dtensor(mesh, placements)
                part = tuple(
                    mesh.get_local_rank(d) for d, p in enumerate(placements) if not p.is_replicate()
                )
                totals[case, part] = totals.get((case, part), 0.0) + counted(t, world)
            assert counted(torch.ones(2), world) == 1 / world
            with pytest.raises(UnsupportedSetup, match="not a multiple of its mesh's size"):
                counted(_dtensor(root, _placements(",".join(["S0"] * len(shape)))), world // 2)
        finally:
            dist.destroy_process_group()
    assert all(w == 1.0 for w in totals.values()), totals
    for case, (dims, spec) in cases.items():
        sizes = dict(zip(names, shape, strict=True))
        split = [sizes[d] for d, p in zip(dims, spec.split(","), strict=True) if p != "R"]
        assert sum(1 for c, _ in totals if c == case) == math.prod(split), case


@pytest.fixture(scope="module")
def meshes() -> Iterator[dict[str, Any]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        yield {
            "1d": init_device_mesh("cpu", (WORLD,)),
            "2d": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")),
        }
    finally:
        dist.destroy_process_group()


def _dtensor(mesh: Any, placements: list[Any]) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    local = torch.arange(6.0).reshape(2, 3)
    return DTensor.from_local(local, mesh, placements, run_check=False)


def _placements(spec: str) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    made = {
        "S0": Shard(0),
        "S1": Shard(1),
        "R": Replicate(),
        "SS0": _StridedShard(0, split_factor=2),  # FSDP2's dp dim over a tp-sharded dim 0
    }
    return [made[p] for p in spec.split(",")]


@pytest.mark.parametrize(
    ("mesh_name", "spec", "dims"),
    [
        ("1d", "S0", [0]),  # FSDP2
        ("1d", "R", []),  # replicated (DDP-like)
        ("2d", "S0,S0", ["dp", "tp"]),  # sharded on both dims
        ("2d", "S0,S1", ["dp", "tp"]),
        ("2d", "S0,R", ["dp"]),  # sharded on dp, replicated on tp (a norm gain under TP)
        ("2d", "R,S1", ["tp"]),  # tensor parallel alone
        ("2d", "R,R", []),
        ("2d", "SS0,S0", ["dp", "tp"]),  # FSDP2 + TP's strided shard
    ],
)
def test_shard_groups_are_the_mesh_dims_whose_ranks_hold_different_parts(
    meshes: dict[str, Any], mesh_name: str, spec: str, dims: list[Any]
) -> None:
    mesh = meshes[mesh_name]
    t = _dtensor(mesh, _placements(spec))
    groups = shard_groups(t)
    assert groups == tuple(mesh.get_group(d) for d in dims)
    # The meaning: a whole-tensor sum adds up numel/local-numel distinct parts, one per
    # rank of the returned groups together (a Replicate dim would count each part twice).
    parts = t.numel() // to_local(t).numel()
    assert math.prod(g.size() for g in groups) == parts, (spec, parts)


@pytest.mark.parametrize("spec", ["S0,P", "P,R"])
def test_a_partial_placement_is_refused_by_name(meshes: dict[str, Any], spec: str) -> None:
    from torch.distributed.tensor import Partial

    placements = [Partial() if p == "P" else _placements(p)[0] for p in spec.split(",")]
    with pytest.raises(UnsupportedSetup, match=r"Partial.*redistribute it to Shard or Replicate"):
        shard_groups(_dtensor(meshes["2d"], placements))


def test_a_plain_tensor_crosses_no_group() -> None:
    assert shard_groups(torch.ones(3)) == ()
    t = torch.ones(3)
    assert to_local(t) is t


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_norm32_is_the_float64_norm_rounded_once(dtype: torch.dtype) -> None:
    """At least float32 whatever the input: a bf16 norm taken in bf16 would be off by ~1e-2;
    this one is the float64 norm of the same values to float32's precision."""
    t = torch.randn(4096, generator=torch.Generator().manual_seed(0)).to(dtype)
    got = norm32(t)
    assert got.dtype == wide_dtype([t]) == torch.promote_types(dtype, torch.float32)
    want = torch.linalg.vector_norm(t.double())
    assert abs(float(got) / float(want) - 1) < 1e-6
    assert float(norm32(t[:0], math.inf)) == 0.0  # an empty shard's inf-norm: 0, no error


def test_wide_dtype_is_shared_by_a_mixed_list() -> None:
    half, double = torch.ones(1, dtype=torch.bfloat16), torch.ones(1, dtype=torch.float64)
    assert wide_dtype([]) == torch.float32
    assert wide_dtype([half]) == torch.float32
    assert wide_dtype([half, double]) == torch.float64
