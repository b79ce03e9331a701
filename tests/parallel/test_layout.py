"""``gradstep.parallel.Layout``: one value for how the ranks split the work.

Validation names the field and what it allows (``cp``/``pp`` refused as not implemented,
pointing to the design notes); ``resolve(world)`` makes ``dp_shard=-1`` concrete so that the
sizes multiply to the world (a hypothesis property over many worlds and layouts), or names
the sizes that do not fit; the mesh has the dims in use, torchtitan's names in its order;
``Layout.of`` reads the layout back from a model ``prepare_model`` built, for every
factorization of 2 and 4 real gloo ranks (tests/parallel/layout_ranks.py).
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from gradstep import UnsupportedSetup
from gradstep.parallel import Layout
from tests.parallel import layout_ranks as lr
from tests.support.multiproc import run_ranks


def test_the_contract_names_and_defaults() -> None:
    fields = {f.name: f.default for f in dataclasses.fields(Layout)}
    assert fields == {"dp_replicate": 1, "dp_shard": -1, "tp": 1, "cp": 1, "pp": 1}
    layout = Layout(dp_replicate=2, tp=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.tp = 4  # type: ignore[misc]
    assert {layout: 1}[Layout(tp=2, dp_replicate=2)] == 1  # a value: equal and hashable
    assert repr(layout) == "Layout(dp_replicate=2, tp=2)" and repr(Layout()) == "Layout()"
    assert eval(repr(layout)) == layout


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 0}, "Layout: tp must be an int >= 1, got 0"),
        ({"dp_replicate": True}, "Layout: dp_replicate must be an int >= 1, got True"),
        ({"dp_shard": 0}, "Layout: dp_shard must be an int >= 1, or -1 (the ranks left), got 0"),
        ({"dp_shard": -2}, "dp_shard must be an int >= 1, or -1 (the ranks left), got -2"),
        ({"tp": 2.0}, "Layout: tp must be an int >= 1, got 2.0"),
        ({"cp": 0}, "Layout: cp must be an int >= 1, got 0"),
    ],
)
def test_a_size_that_is_not_one_is_refused_naming_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Layout(**kwargs)


@pytest.mark.parametrize(("field", "what"), [("cp", "context"), ("pp", "pipeline")])
def test_context_and_pipeline_parallel_are_refused_as_not_implemented(
    field: str, what: str
) -> None:
    with pytest.raises(UnsupportedSetup) as info:
        Layout(**{field: 2})
    message = str(info.value)
    assert f"Layout: {field}=2 ({what} parallelism) is not implemented; {field} must be 1" in (
        message
    )
    assert "design notes in docs/design/pipeline-parallel.md" in message
    assert isinstance(info.value, NotImplementedError)
    section = re.search(r"docs/design/pipeline-parallel\.md \('(.+)'\)", message)
    docs = Path(__file__).resolve().parents[2] / "docs" / "design" / "pipeline-parallel.md"
    assert section and f"\n## {section[1]}\n" in docs.read_text(), message  # it exists


sizes = st.sampled_from([1, 2, 3, 4, 8])


@given(world=st.integers(1, 64), replicate=sizes, tp=sizes)
def test_resolve_fills_dp_shard_with_the_ranks_left(world: int, replicate: int, tp: int) -> None:
    """``dp_shard=-1`` takes the rest: the sizes multiply to the world, ``dp_size x tp x cp x
    pp`` is the world; when the others do not divide the world, the error names them."""
    layout = Layout(dp_replicate=replicate, tp=tp)
    if world % (replicate * tp):
        with pytest.raises(ValueError, match=re.escape(f"does not fit {world} ranks")):
            layout.resolve(world)
        return
    got = layout.resolve(world)
    assert (got.dp_replicate, got.tp, got.cp, got.pp) == (replicate, tp, 1, 1)
    assert got.dp_shard == world // (replicate * tp)
    assert math.prod(getattr(got, f.name) for f in dataclasses.fields(got)) == world
    assert got.dp_size * got.tp * got.cp * got.pp == world
    assert got.resolve(world) == got  # concrete sizes resolve to themselves
    assert math.prod(size for _, size in got.dims) == world


@given(world=st.integers(1, 32), shard=sizes, tp=sizes)
def test_explicit_sizes_must_multiply_to_the_world(world: int, shard: int, tp: int) -> None:
    layout = Layout(dp_shard=shard, tp=tp)
    if shard * tp == world:
        assert layout.resolve(world) is layout
    else:
        with pytest.raises(ValueError, match=re.escape(f"= {shard * tp} must equal the number")):
            layout.resolve(world)


def test_the_messages_of_sizes_that_do_not_fit() -> None:
    with pytest.raises(ValueError) as info:
        Layout(dp_replicate=2, tp=3).resolve(4)
    assert str(info.value) == (
        "Layout(dp_replicate=2, tp=3) does not fit 4 ranks: dp_replicate=2 x tp=3 = 6 must "
        "divide the number of ranks (4), dp_shard=-1 taking the rest: one of 1, 2, 4"
    )
    with pytest.raises(ValueError, match=re.escape("Layout.resolve: world must be an int >= 1")):
        Layout().resolve(0)
    with pytest.raises(ValueError, match=re.escape("call layout.resolve(world_size) first")):
        _ = Layout(tp=2).dp_size


@pytest.mark.parametrize(
    ("layout", "world", "dims", "dp_size"),
    [
        (Layout(), 4, (("dp_shard", 4),), 4),
        (Layout(), 1, (("dp_shard", 1),), 1),
        (Layout(dp_replicate=2), 4, (("dp_replicate", 2), ("dp_shard", 2)), 4),
        (Layout(dp_replicate=4), 4, (("dp_replicate", 4), ("dp_shard", 1)), 4),
        (Layout(tp=2), 8, (("dp_shard", 4), ("tp", 2)), 4),
        (Layout(tp=4), 4, (("dp_shard", 1), ("tp", 4)), 1),
        (Layout(dp_replicate=2, tp=2), 8, (("dp_replicate", 2), ("dp_shard", 2), ("tp", 2)), 4),
    ],
)
def test_the_mesh_has_the_dims_in_use_in_torchtitan_order(
    layout: Layout, world: int, dims: tuple, dp_size: int
) -> None:
    """``dp_shard`` always (FSDP2 shards over it, even one rank: ``(R, 1)`` is HSDP with
    every rank a replica, not FSDP2 over R), ``dp_replicate`` and ``tp`` when > 1."""
    got = layout.resolve(world)
    assert got.dims == dims and got.dp_size == dp_size
    assert got.dp_dims == tuple(name for name, _ in dims if name != "tp")
    assert [got.data_rank(r) for r in range(world)] == [r // got.tp for r in range(world)]


def test_a_model_nothing_shards_is_replicated_over_the_ranks() -> None:
    assert Layout.of(nn.Linear(2, 2)) == Layout(dp_replicate=1, dp_shard=1)
    assert Layout.of(nn.Linear(2, 2), world=4) == Layout(dp_replicate=4, dp_shard=1)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_layout_of_reads_back_every_layout_prepare_model_builds(world: int) -> None:
    """Every factorization of ``world`` into dp_replicate x dp_shard x tp (HSDP + tensor
    parallel included), and DDP: ``Layout.of(model)`` is the resolved layout, the
    checkpoints' data-parallel size its ``dp_size``, the parameters lie on its data-parallel
    mesh and (under tp) its full mesh, and the detected strategy counts its ``dp_size``."""
    layouts = lr.factorizations(world)
    assert len(layouts) == {2: 3, 4: 6}[world]
    for rank, res in enumerate(run_ranks(lr.round_trip_run, world, timeout=300)):
        for layout in layouts:
            got, where = res[repr(layout)], (repr(layout), rank)
            assert got["of"] == layout and got["dp_size"] == layout.dp_size, where
            names = tuple(name for name, _ in layout.dims)
            assert got["dims"] <= {layout.dp_dims, names}, where
            strategy = "FSDP2TPStrategy" if layout.tp > 1 else "FSDP2Strategy"
            assert got["strategy"] == (strategy, layout.dp_size), where
        assert res["ddp"] == {"of": Layout(dp_replicate=world, dp_shard=1), "dp_size": world}
