"""The demo GPT on packed rows (``GPT.forward(..., seq_ids=)``): exact, in float64.

- a packed row's loss sum, item count and gradient equal each sequence run alone (≤ 1e-12
  relative), for random lengths, tied and untied heads, with the loss chunked or not;
- the logits of a packed row are each sequence's logits alone (to rounding);
- one accumulated packed step of the Stepper equals the unpacked step;
- positions derived from ``seq_ids`` are :func:`gradstep.packing.pack`'s;
- the pitfall: the same row without ``seq_ids`` leaks, and ``position_ids`` alone is refused.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gradstep.packing import pack, plan_rows
from gradstep_cli.models.gpt import GPT, GPTConfig, positions_from

EXACT = 1e-12
CFG = GPTConfig(vocab_size=61, n_layer=2, n_head=2, d_model=16, max_seq_len=32)


def gpt64(seed: int = 0, **overrides: object) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**CFG.__dict__, **overrides})).double()
    with torch.no_grad():  # norms that are not ones and zeros: every parameter matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def sequences(lengths: list[int], seed: int, vocab: int = CFG.vocab_size) -> list[tuple]:
    """(ids, aligned labels) pairs: the next token of the sequence, some ignored (-100)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n + 1,), generator=gen)
        labels = ids[1:].clone()
        labels[torch.rand(n, generator=gen) < 0.2] = -100
        out.append((ids[:-1], labels))
    return out


def grads(model: GPT) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def alone(model: GPT, seqs: list[tuple]) -> tuple[float, int, dict]:
    """Loss sum, count and gradient of each sequence run alone (unpacked), summed."""
    model.zero_grad(set_to_none=True)
    total, count = torch.zeros((), dtype=torch.float64), 0
    for ids, labels in seqs:
        loss = model(ids[None], labels[None])
        total, count = total + loss.total, count + int(loss.count)
    total.backward()
    return float(total.detach()), count, grads(model)


def packed(model: GPT, batch: dict[str, torch.Tensor]) -> tuple[float, int, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(
        batch["input_ids"],
        batch["shift_labels"],
        seq_ids=batch["seq_ids"],
        position_ids=batch["position_ids"],
    )
    loss.total.backward()
    return float(loss.total.detach()), int(loss.count), grads(model)


def assert_close_grads(got: dict, want: dict) -> float:
    """Every gradient within EXACT of the whole gradient's norm (a tensor whose gradient is
    0 in exact arithmetic holds rounding noise); returns the worst relative error."""
    whole = sum(float(w.square().sum()) for w in want.values()) ** 0.5
    worst = max(float((got[n] - w).norm()) / whole for n, w in want.items())
    assert worst <= EXACT, worst
    return worst


@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=7),
    extra=st.integers(0, 6),
    chunk=st.sampled_from([None, 1, 5]),
    tie=st.booleans(),
    seed=st.integers(0, 999),
)
def test_a_packed_row_equals_each_sequence_alone(lengths, extra, chunk, tie, seed) -> None:
    model = gpt64(seed % 3, tie_weights=tie, loss_chunk_tokens=chunk)
    seqs = sequences(lengths, seed)
    row_tokens = max(lengths) + extra
    rows = plan_rows(lengths, row_tokens)
    want_total, want_count, want_grads = alone(model, seqs)
    total, count, got_grads = packed(model, pack(seqs, rows, row_tokens))
    assert count == want_count
    if want_count == 0:
        assert total == 0.0
        return
    assert abs(total - want_total) <= EXACT * abs(want_total)
    assert_close_grads(got_grads, want_grads)


def test_packed_logits_are_each_sequences_logits_and_positions_are_derived() -> None:
    model = gpt64().eval()
    seqs = sequences([5, 9, 3, 7], seed=1)
    rows = plan_rows([5, 9, 3, 7], 16)
    batch = pack(seqs, rows, 16)
    with torch.no_grad():
        given_pos = model(batch["input_ids"], seq_ids=batch["seq_ids"],
                          position_ids=batch["position_ids"])  # fmt: skip
        derived = model(batch["input_ids"], seq_ids=batch["seq_ids"])
        leaked = model(batch["input_ids"])  # one causal row: the sequences see each other
        assert torch.equal(given_pos, derived)
        for r, row in enumerate(rows):
            at = 0
            for i in row:
                ids = seqs[i][0]
                want = model(ids[None])[0]
                got = given_pos[r, at : at + len(ids)]
                assert float((got - want).abs().max()) <= EXACT * float(want.abs().max())
                if at > 0:  # a later sequence of the row, without the mask: not itself
                    assert float((leaked[r, at : at + len(ids)] - want).abs().max()) > 1e-3
                at += len(ids)


@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=8), extra=st.integers(0, 5))
def test_positions_from_seq_ids_are_packs(lengths, extra) -> None:
    seqs = [(torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)) for n in lengths]
    row_tokens = max(lengths) + extra
    batch = pack(seqs, plan_rows(lengths, row_tokens), row_tokens)
    assert torch.equal(positions_from(batch["seq_ids"]), batch["position_ids"])


def test_position_ids_alone_and_a_misshapen_seq_ids_are_refused() -> None:
    model = gpt64()
    ids = torch.zeros(2, 6, dtype=torch.long)
    with pytest.raises(ValueError, match="position_ids without seq_ids"):
        model(ids, position_ids=torch.zeros(2, 6, dtype=torch.long))
    with pytest.raises(ValueError, match=r"seq_ids shape \(2, 5\) differs"):
        model(ids, seq_ids=torch.zeros(2, 5, dtype=torch.long))


def loss_fn(model: GPT, batch: dict) -> object:
    extra = {k: batch[k] for k in ("seq_ids", "position_ids") if k in batch}
    return model(batch["input_ids"], batch["shift_labels"], **extra)


def count_fn(batch: dict) -> int:
    return int((batch["shift_labels"] != -100).sum())


@pytest.mark.parametrize("chunk", [None, 4])
def test_one_accumulated_packed_step_equals_the_unpacked_step(chunk) -> None:
    """The Stepper over 2 packed micro-batches = over the same sequences one per row."""
    import gradstep

    lengths = [7, 3, 11, 1, 5, 9, 4]
    seqs = sequences(lengths, seed=5)
    base = gpt64(2, loss_chunk_tokens=chunk).train()

    def run(window: list[dict]) -> tuple:
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.3)
        stepper = gradstep.Stepper(model, opt, clip=gradstep.ClipNorm(0.01))
        stats = stepper.step(window, loss_fn, count=count_fn)
        return stats, {n: p.detach().clone() for n, p in model.named_parameters()}

    halves = [list(range(3)), list(range(3, len(seqs)))]
    window = [
        pack([seqs[i] for i in h], plan_rows([lengths[i] for i in h], 16), 16) for h in halves
    ]
    assert all(b["input_ids"].shape[0] < 3 for b in window)  # sequences share rows
    plain = [{"input_ids": s[None], "shift_labels": lab[None]} for s, lab in seqs]
    got, got_params = run(window)
    want, want_params = run(plain)
    assert got.items == want.items and got.clipped and want.clipped
    assert got.loss == pytest.approx(want.loss, rel=EXACT)
    assert got.grad_norm == pytest.approx(want.grad_norm, rel=EXACT)
    assert_close_grads(got_params, want_params)
