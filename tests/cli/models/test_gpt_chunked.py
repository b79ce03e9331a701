"""The demo GPT's chunked loss (``GPTConfig(loss_chunk_tokens=N)``, ``model(ids, labels)``).

- equal to the unchunked loss sum, count and every gradient in float64 (≤ 1e-12 relative),
  tied and untied heads, ignored labels; the unchunked ``labels=`` path is bitwise
  ``token_loss(model(ids), labels)``;
- no tensor of the logits' size is ever produced, in forward or backward (the unchunked
  loss does produce one: the detector works);
- under FSDP2 on 2 gloo ranks, a step with the chunked loss equals the unchunked step (the
  head's weight is the one FSDP2 gathered for the forward, tied to the embedding or not).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from gradstep import token_loss
from gradstep_cli.models.gpt import GPTConfig
from tests.cli.models.test_gpt_packing import assert_close_grads, gpt64, grads

EXACT = 1e-12


def _batch(rows: int, cols: int, vocab: int, ignored: float, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, cols), generator=gen)
    labels = torch.randint(0, vocab, (rows, cols), generator=gen)
    labels[torch.rand(rows, cols, generator=gen) < ignored] = -100
    return ids, labels


def _loss_and_grads(model, ids, labels) -> tuple:
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels)
    loss.total.backward()
    return float(loss.total.detach()), int(loss.count), grads(model)


@given(
    rows=st.integers(1, 3),
    cols=st.integers(1, 20),
    chunk=st.integers(1, 25),
    tie=st.booleans(),
    ignored=st.sampled_from([0.0, 0.3, 1.0]),
    seed=st.integers(0, 999),
)
def test_the_chunked_loss_equals_the_unchunked(rows, cols, chunk, tie, ignored, seed) -> None:
    ids, labels = _batch(rows, cols, 61, ignored, seed)
    want = _loss_and_grads(gpt64(seed % 3, tie_weights=tie), ids, labels)
    got = _loss_and_grads(gpt64(seed % 3, tie_weights=tie, loss_chunk_tokens=chunk), ids, labels)
    assert got[1] == want[1]
    if want[1] == 0:
        assert got[0] == want[0] == 0.0
        return
    assert abs(got[0] - want[0]) <= EXACT * abs(want[0])
    assert_close_grads(got[2], want[2])


def test_the_unchunked_labels_path_is_token_loss_of_the_logits_bitwise() -> None:
    model = gpt64(1, tie_weights=False)
    ids, labels = _batch(2, 9, 61, 0.3, seed=4)
    inside = model(ids, labels)
    outside = token_loss(model(ids), labels)
    assert torch.equal(inside.total, outside.total) and int(inside.count) == int(outside.count)


class _Largest(TorchDispatchMode):
    """The numel of the largest tensor any operator produced while active."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("tie", [True, False])
def test_no_tensor_of_the_logits_size_is_ever_produced(tie: bool) -> None:
    rows, cols, vocab, d = 2, 24, 2000, 16  # the logits: 96,000 numbers; the head: 32,000
    largest = {}
    for chunk in (None, 8):
        model = gpt64(0, vocab_size=vocab, tie_weights=tie, loss_chunk_tokens=chunk)
        ids, labels = _batch(rows, cols, vocab, 0.0, seed=0)
        with _Largest() as seen:
            model(ids, labels).total.backward()
        largest[chunk] = seen.numel
    assert largest[None] >= rows * cols * vocab  # the detector sees the whole logits
    assert largest[8] <= max(8 * vocab, vocab * d)  # a chunk's logits, or the head's weight


def test_a_bad_chunk_size_is_refused() -> None:
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="loss_chunk_tokens must be None or an int >= 1"):
            GPTConfig(loss_chunk_tokens=bad)


def fsdp_ranks(rank: int, world: int) -> dict:
    """One clipped SGD step of the float64 GPT under FSDP2 (each block and the root
    sharded), with the chunked loss and without, tied and untied head, on packed rows:
    the full parameters after it and the gradient norm."""
    import gradstep
    import gradstep.parallel as gd
    from gradstep.packing import pack, plan_rows
    from tests.cli.models.test_gpt_packing import count_fn, loss_fn, sequences

    out = {}
    for tie in (True, False):
        for chunk in (None, 3):
            model = gd.prepare_model(gpt64(3, tie_weights=tie, loss_chunk_tokens=chunk), "fsdp")
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            stepper = gradstep.Stepper(model, opt, clip=gradstep.ClipNorm(0.05))
            window = []
            for k in range(2):
                lengths = [3 + rank + k, 5, 2 + 2 * rank, 7 - k]
                seqs = sequences(lengths, seed=10 * rank + k)
                window.append(pack(seqs, plan_rows(lengths, 12), 12))
            stats = stepper.step(window, loss_fn, count=count_fn)
            params = {
                n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for n, p in model.named_parameters()
            }
            out[(tie, chunk)] = {"params": params, "norm": stats.grad_norm}
    return out


@pytest.mark.distributed
def test_fsdp2_steps_with_the_chunked_loss_equal_the_unchunked() -> None:
    from tests.support.multiproc import run_ranks

    for res in run_ranks(fsdp_ranks, 2, timeout=240):
        assert "error" not in res, res.get("error")
        for tie in (True, False):
            got, want = res[(tie, 3)], res[(tie, None)]
            assert got["norm"] == pytest.approx(want["norm"], rel=EXACT), tie
            for name, value in want["params"].items():
                torch.testing.assert_close(got["params"][name], value, rtol=EXACT, atol=EXACT)
