"""Padding-free packing (gradstep.packing): rows, masks, and exactness on every tiny family.

- plan_rows: every sequence in exactly one row, no row over capacity, stream order kept;
- pack: the rows give back each sequence, its aligned labels and positions from 0;
- block_causal_mask: position i may attend to j iff j <= i in the same sequence;
- for each tiny HF family under ``sdpa`` (boolean mask) and ``eager`` (additive mask): a
  packed micro-batch's loss sum, item count and gradient equal each sequence run alone
  (float64, ≤ 1e-12 relative), and one accumulated packed step equals the unpacked step;
- ``max_leak`` finds the leak of ``position_ids`` without the mask (the pitfall), and an
  implementation without a 4-D mask is refused by name.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gradstep.packing import block_causal_mask, max_leak, pack, plan_rows

EXACT = 1e-12


@given(
    lengths=st.lists(st.integers(1, 16), min_size=1, max_size=20),
    extra=st.integers(0, 8),
    order=st.sampled_from(["stream", "bfd"]),
)
def test_every_sequence_lands_in_exactly_one_row_that_holds_it(lengths, extra, order):
    cap = max(lengths) + extra
    rows = plan_rows(lengths, cap, order)
    flat = [i for row in rows for i in row]
    assert sorted(flat) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= cap for row in rows)
    if order == "stream":
        assert flat == list(range(len(lengths)))  # the data order is kept
        # greedy: a row is closed only when the next sequence did not fit in it
        for row, nxt in zip(rows, rows[1:], strict=False):
            assert sum(lengths[i] for i in row) + lengths[nxt[0]] > cap


@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=8), seed=st.integers(0, 99))
def test_pack_gives_back_each_sequence_its_labels_and_positions(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    seqs = [
        (torch.randint(1, 100, (n,), generator=gen), torch.randint(-1, 100, (n,), generator=gen))
        for n in lengths
    ]
    rows = plan_rows(lengths, max(lengths) + 3)
    batch = pack(seqs, rows)
    for r, row in enumerate(rows):
        at = 0
        for k, i in enumerate(row):
            n = lengths[i]
            assert torch.equal(batch["input_ids"][r, at : at + n], seqs[i][0])
            assert torch.equal(batch["shift_labels"][r, at : at + n], seqs[i][1])
            assert torch.equal(batch["position_ids"][r, at : at + n], torch.arange(n))
            assert bool((batch["seq_ids"][r, at : at + n] == k).all())
            at += n
        assert bool((batch["shift_labels"][r, at:] == -100).all())  # padding trains nothing
    mask = block_causal_mask(batch["seq_ids"])
    ids = batch["seq_ids"]
    t = ids.shape[1]
    for r in range(len(rows)):
        for i in range(t):
            for j in range(t):
                assert bool(mask[r, 0, i, j]) == (j <= i and bool(ids[r, i] == ids[r, j]))
    additive = block_causal_mask(ids, torch.float64)
    assert torch.equal(additive == 0, mask) and bool((additive[~mask] == float("-inf")).all())


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="sequence 1 has 9 tokens, outside 1..row_tokens"):
        plan_rows([3, 9], 8)
    with pytest.raises(ValueError, match="order must be 'stream' or 'bfd'"):
        plan_rows([3], 8, order="first")


# --------------------------------------------------------------- Hugging Face models

pytest.importorskip("transformers")

from gradstep.hf import causal_lm_loss  # noqa: E402
from gradstep.packing import (  # noqa: E402
    EXACT_ATTENTION,
    EXACT_FAMILIES,
    SEGMENTS,
    check_exact,
    mask_for,
    use_segments,
)
from tests.support import hf_assets  # noqa: E402

LENGTHS = (7, 3, 11, 1, 5, 9)


def _model(family: str, impl: str) -> torch.nn.Module:
    built = "sdpa" if impl == SEGMENTS else impl
    model = hf_assets.build_model(
        family, seed=1, attn_implementation=built, _experts_implementation="eager"
    )
    model = model.double().eval()  # eval: OPT's config has dropout
    if impl == SEGMENTS:
        assert use_segments(model) and model.config._attn_implementation == SEGMENTS
    return model


def _sequences(seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in LENGTHS:
        ids = torch.randint(0, hf_assets.VOCAB, (n + 1,), generator=gen)
        out.append((ids[:-1], ids[1:]))  # aligned labels: the next token of the sequence
    return out


def _alone(model, seqs):
    """Loss sum, count and gradient of each sequence run alone, summed."""
    model.zero_grad(set_to_none=True)
    total, count = torch.zeros((), dtype=torch.float64), 0
    for ids, labels in seqs:
        loss = causal_lm_loss(model, {"input_ids": ids[None], "shift_labels": labels[None]})
        total, count = total + loss.total, count + int(loss.count)
    total.backward()
    return float(total.detach()), count, {n: p.grad.clone() for n, p in model.named_parameters()}


def _packed(model, seqs, row_tokens):
    model.zero_grad(set_to_none=True)
    batch = pack(seqs, plan_rows([len(s) for s, _ in seqs], row_tokens), row_tokens)
    loss = causal_lm_loss(model, mask_for(model, batch, torch.float64))
    loss.total.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return float(loss.total.detach()), int(loss.count), grads, batch


# HF's eager attention takes its softmax in float32 whatever the model's dtype, so a
# sequence's scores round differently in a row of 16 than alone: exact to float32 (a leak
# moves the logits by ~0.2, test_position_ids_alone_leak_and_the_leak_is_measured).
EAGER = 1e-6


def _close(got: dict, want: dict, tol: float = EXACT) -> None:
    whole = sum(float(w.square().sum()) for w in want.values()) ** 0.5
    for name, w in want.items():
        assert float((got[name] - w).norm()) <= tol * whole, name


@pytest.mark.parametrize("impl", EXACT_ATTENTION)
@pytest.mark.parametrize("family", EXACT_FAMILIES)
def test_a_packed_micro_batch_equals_each_sequence_alone(family: str, impl: str) -> None:
    model = _model(family, impl)
    assert model.config._attn_implementation == impl
    tol = EAGER if impl == "eager" else EXACT
    seqs = _sequences()
    want_total, want_count, want_grads = _alone(model, seqs)
    total, count, grads, batch = _packed(model, seqs, row_tokens=16)
    assert batch["input_ids"].shape[0] < len(seqs)  # several sequences share a row
    assert count == want_count == sum(LENGTHS)
    assert abs(total - want_total) <= tol * abs(want_total)
    _close(grads, want_grads, tol)
    assert max_leak(model) < tol


def test_position_ids_alone_leak_and_the_leak_is_measured() -> None:
    """The pitfall: without the block-causal mask, a packed row attends across sequences."""
    model = _model("llama", "sdpa")
    seqs = _sequences()[:2]
    batch = pack(seqs, [[0, 1]])
    plain = {k: v for k, v in batch.items() if k != "seq_ids"}  # positions restart, no mask
    with torch.no_grad():
        leaked = model(input_ids=plain["input_ids"], position_ids=plain["position_ids"]).logits
        alone = model(input_ids=seqs[1][0][None]).logits
    assert float((leaked[0, len(seqs[0][0]) :] - alone[0]).abs().max()) > 1e-3
    assert max_leak(model) < 1e-12


def test_an_implementation_without_a_4d_mask_is_refused_by_name() -> None:
    model = _model("llama", "sdpa")
    model.config._attn_implementation = "flash_attention_2"
    batch = pack(_sequences()[:2], [[0, 1]])
    with pytest.raises(ValueError, match="attention implementation 'flash_attention_2'"):
        mask_for(model, batch, torch.float64)


@pytest.mark.parametrize("impl", ["sdpa", SEGMENTS])
def test_one_accumulated_packed_step_equals_the_unpacked_step(impl: str) -> None:
    """The Stepper over 2 packed micro-batches = over the same sequences one per row."""
    import gradstep
    from gradstep.hf import count_tokens

    seqs = _sequences(seed=5)
    base = _model("llama", impl).train()

    def run(window):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.3)
        stepper = gradstep.Stepper(model, opt, clip=gradstep.ClipNorm(0.01))
        stats = stepper.step(window, causal_lm_loss, count=count_tokens)
        return stats, {n: p.detach().clone() for n, p in model.named_parameters()}

    lengths = [len(s) for s, _ in seqs]
    halves = [list(range(3)), list(range(3, len(seqs)))]
    packed = [
        mask_for(base, pack([seqs[i] for i in h], plan_rows([lengths[i] for i in h], 16), 16),
                 torch.float64)
        for h in halves
    ]  # fmt: skip
    plain = [
        {"input_ids": s[None], "shift_labels": lab[None]} for s, lab in seqs
    ]  # one sequence per micro-batch: nothing padded, nothing packed
    got, got_params = run(packed)
    want, want_params = run(plain)
    assert got.items == want.items and got.clipped and want.clipped
    assert got.loss == pytest.approx(want.loss, rel=EXACT)
    assert got.grad_norm == pytest.approx(want.grad_norm, rel=EXACT)
    _close(got_params, want_params)


def test_the_documented_example_runs() -> None:
    """docs/library/packing.md's code blocks, in order, in one namespace: the library loop
    on a packed, masked batch with the chunked loss, then the demo GPT on the same rows."""
    import re
    from pathlib import Path

    page = Path(__file__).resolve().parents[1] / "docs" / "library" / "packing.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    assert len(blocks) == 2
    scope: dict = {}
    for block in blocks:
        exec(compile(block, str(page), "exec"), scope)  # noqa: S102
    assert scope["rows"] == [[0, 1], [2, 3], [4]]
    assert scope["stats"].items == int(scope["loss"].count) == 35


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_check_exact_passes_a_family_shown_exact(family: str) -> None:
    check_exact(hf_assets.build_model(family, seed=0, attn_implementation="sdpa"))


def test_check_exact_refuses_a_family_or_implementation_not_shown_exact() -> None:
    other = hf_assets.build_model("llama", seed=0, attn_implementation="sdpa")
    other.config.model_type = "mistral"  # a family the suite does not test
    with pytest.raises(ValueError, match="not shown exact for the family 'mistral' under the "
                       "attention implementation 'sdpa'"):  # fmt: skip
        check_exact(other)
    llama = hf_assets.build_model("llama", seed=0, attn_implementation="sdpa")
    llama.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="'llama' under the attention implementation "
                       "'flash_attention_2'"):  # fmt: skip
        check_exact(llama)


def test_check_exact_measures_the_model_itself(monkeypatch) -> None:
    """A family in the table whose model still leaks (e.g. a custom attention) is refused."""
    import gradstep.packing as packing

    model = hf_assets.build_model("llama", seed=0, attn_implementation="sdpa")
    monkeypatch.setattr(packing, "max_leak", lambda m: 0.2)
    with pytest.raises(ValueError, match="lets packed sequences attend to each other"):
        packing.check_exact(model)


def test_segment_attention_needs_the_positions_and_no_mask() -> None:
    from gradstep.packing import segment_attention

    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match="needs position_ids"):
        segment_attention(torch.nn.Module(), q, q, q, None)
    with pytest.raises(ValueError, match="no attention_mask"):
        segment_attention(torch.nn.Module(), q, q, q, torch.ones(1, 1, 5, 5, dtype=torch.bool),
                          position_ids=torch.arange(5)[None])  # fmt: skip


def test_use_segments_keeps_the_mask_where_it_is_not_shown_exact(monkeypatch) -> None:
    import gradstep.packing as packing

    eager = hf_assets.build_model("llama", seed=0, attn_implementation="eager")
    assert not use_segments(eager) and eager.config._attn_implementation == "eager"
    window = hf_assets.build_model("qwen2", seed=0, attn_implementation="sdpa")
    window.config.sliding_window, window.config.use_sliding_window = 4, True
    assert not use_segments(window) and window.config._attn_implementation == "sdpa"
    half = hf_assets.build_model("llama", seed=0, attn_implementation="sdpa").bfloat16()
    assert not use_segments(half)
    leaky = hf_assets.build_model("llama", seed=0, attn_implementation="sdpa")
    monkeypatch.setattr(packing, "max_leak", lambda m: 0.2)
    assert not use_segments(leaky) and leaky.config._attn_implementation == "sdpa"


def test_an_unpacked_right_padded_batch_is_plain_causal_under_segments() -> None:
    """Evaluation and samples run the same model unpacked: one sequence a row."""
    model = _model("llama", SEGMENTS)
    ids = torch.randint(0, hf_assets.VOCAB, (2, 9))
    with torch.no_grad():
        got = model(input_ids=ids, use_cache=False).logits
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
    assert float((got - want).abs().max()) < 1e-12


# ------------------------------------------ held-out mutations (tools/mutants.py P31-*)


def test_best_fit_puts_a_sequence_in_the_fullest_row_that_holds_it() -> None:
    # 5 then 4 open two rows (room 3 and 4); 3 fills the first (room 0); each 2 goes to
    # the fullest row with room: the second (4 -> 2 -> 0). Worst fit needs a third row.
    assert plan_rows([5, 4, 3, 2, 2], 8, order="bfd") == [[0, 2], [1, 3, 4]]


def test_max_leak_is_the_worst_sequence_not_the_first() -> None:
    """The first sequence of a row cannot leak (nothing before it): a leak shows in the
    later ones, and max_leak must report it, so check_exact refuses."""
    import gradstep.packing as packing

    model = hf_assets.build_model("llama", seed=0, attn_implementation="sdpa").double()
    real = packing.mask_for

    def no_boundaries(m, batch, dtype):  # causal, but across the sequences
        out = real(m, batch, dtype)
        out["attention_mask"] = block_causal_mask(torch.zeros_like(batch["seq_ids"]))
        return out

    mp = pytest.MonkeyPatch()
    mp.setattr(packing, "mask_for", no_boundaries)
    try:
        assert packing.max_leak(model) > 1e-2
        with pytest.raises(ValueError, match="attend to each other"):
            packing.check_exact(model)
    finally:
        mp.undo()


def test_opt_needs_the_mask_not_the_positions_alone() -> None:
    """The run's HF loss on packed rows of OPT (whose attention does not read sequence
    starts from position_ids) equals each sequence alone: the 4-D mask is built."""
    from gradstep_cli.models.hf_loss import HFLoss

    model = _model("opt", "sdpa")
    seqs = _sequences(seed=4)[:3]
    batch = pack(seqs, [[0, 1, 2]])
    batch["labels"] = batch.pop("shift_labels")
    got = HFLoss(torch.device("cpu"))(model, batch)
    want = sum(
        float(
            causal_lm_loss(model, {"input_ids": s[None], "shift_labels": lab[None]}).total.detach()
        )
        for s, lab in seqs
    )
    assert float(got.total.detach()) == pytest.approx(want, rel=EXACT)
