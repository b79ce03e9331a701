"""The chunked causal-LM loss never holds the whole logits and changes nothing else.

``chunked_token_loss`` against ``token_loss`` of the full projection, and
``causal_lm_loss(..., chunk_tokens=N)`` against ``causal_lm_loss`` for every tiny HF family
the suite builds: the loss sum, the item count and every gradient equal to float64
rounding (≤ 1e-12 relative), for right and left padding, HF's unshifted labels and
``shift_labels``, a MoE router loss (its aux term unchanged), tied and untied heads.
What cannot be chunked exactly (a LoRA-adapted head, a soft-capped or scaled logit) is
refused with the reason.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from gradstep.step.loss import chunked_token_loss, token_loss

EXACT = 1e-12


@given(
    rows=st.integers(1, 4),
    cols=st.integers(1, 9),
    chunk=st.integers(1, 40),
    ignored=st.floats(0.0, 1.0),
    bias=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_chunked_token_loss_equals_the_full_projection(rows, cols, chunk, ignored, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    d, vocab = 8, 37
    hidden = torch.randn(rows, cols, d, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, d, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(vocab, generator=gen, dtype=torch.float64, requires_grad=True) if bias else None
    labels = torch.randint(0, vocab, (rows, cols), generator=gen)
    labels[torch.rand(rows, cols, generator=gen) < ignored] = -100
    want = token_loss(F.linear(hidden, weight, b), labels)
    got = chunked_token_loss(hidden, weight, labels, b, chunk_tokens=chunk)
    assert int(got.count) == int(want.count)
    inputs = [t for t in (hidden, weight, b) if t is not None]
    if int(want.count) == 0:
        assert float(got.total.detach()) == 0.0
        return
    g_total, w_total = float(got.total.detach()), float(want.total.detach())
    assert abs(g_total - w_total) <= EXACT * abs(w_total)
    for g, w in zip(torch.autograd.grad(got.total, inputs), torch.autograd.grad(want.total, inputs),
                    strict=True):  # fmt: skip
        assert float((g - w).norm()) <= EXACT * max(float(w.norm()), 1e-30)


def test_under_bf16_autocast_the_projection_rounds_as_a_linear_does() -> None:
    """The chunks run in autocast's dtype both in forward and in backward: the result is
    a bf16 projection's loss (as the unchunked Linear under autocast), not fp32's."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 16, generator=gen, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, requires_grad=True)
    labels = torch.randint(0, 50, (2, 5), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = token_loss(F.linear(hidden, weight), labels)
        got = chunked_token_loss(hidden, weight, labels, chunk_tokens=3)
    assert float(got.total.detach()) == pytest.approx(float(want.total.detach()), rel=1e-6)
    gw = torch.autograd.grad(got.total, weight)[0]
    ww = torch.autograd.grad(want.total, weight)[0]
    assert float((gw - ww).norm() / ww.norm()) < 2e-2  # bf16 rounding of the two orders


def test_bad_arguments_are_named() -> None:
    h, w = torch.zeros(2, 3, 4), torch.zeros(5, 4)
    with pytest.raises(ValueError, match="does not match labels shape"):
        chunked_token_loss(h, w, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_tokens must be an int >= 1, got 0"):
        chunked_token_loss(h, w, torch.zeros(2, 3, dtype=torch.long), chunk_tokens=0)


@pytest.mark.parametrize("bad", [37, -1, -5])
def test_a_target_outside_the_vocabulary_is_an_index_error_as_unchunked(bad: int) -> None:
    hidden, weight = torch.zeros(2, 3, 8), torch.zeros(37, 8)
    labels = torch.tensor([[1, 2, bad], [0, -100, 2]])
    with pytest.raises(IndexError):
        token_loss(F.linear(hidden, weight), labels)
    with pytest.raises(IndexError, match="target out of range"):
        chunked_token_loss(hidden, weight, labels, chunk_tokens=2)


# --------------------------------------------------------------- Hugging Face models

pytest.importorskip("transformers")

from gradstep.hf import causal_lm_loss, chunkable  # noqa: E402
from tests.hf.helpers import hf_batch, mixtral  # noqa: E402
from tests.support import hf_assets  # noqa: E402


def _batch(pad: str, shift: bool, vocab: int = hf_assets.VOCAB) -> dict:
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in (9, 4, 1)]
    batch = hf_batch(seqs, pad=pad)
    if shift:  # HF's shift_labels: aligned with the logits, the last position's next unknown
        labels = batch.pop("labels")
        batch["shift_labels"] = torch.cat(
            [labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1
        )
    return batch


def _loss_and_grads(model, batch, **kw):
    torch.manual_seed(0)  # the same dropout masks (OPT's config has dropout) both ways
    loss = causal_lm_loss(model, batch, **kw)
    objective = loss.total + sum(loss.aux.values()) if loss.aux else loss.total
    params = [p for p in model.parameters() if p.requires_grad]
    return loss, torch.autograd.grad(objective, params, allow_unused=True)


def _compare(model, batch, chunk: int) -> None:
    want, wg = _loss_and_grads(copy.deepcopy(model), batch)
    got, gg = _loss_and_grads(model, batch, chunk_tokens=chunk)
    assert int(got.count) == int(want.count) > 0
    g_total, w_total = float(got.total.detach()), float(want.total.detach())
    assert abs(g_total - w_total) <= EXACT * abs(w_total)
    assert sorted(got.aux) == sorted(want.aux)
    for name in want.aux:
        g_aux, w_aux = float(got.aux[name].detach()), float(want.aux[name].detach())
        assert g_aux == pytest.approx(w_aux, rel=EXACT)
    # Relative to the whole gradient: some tensors' gradients are 0 in exact arithmetic
    # (an attention key bias: softmax ignores a shift every key shares) and hold noise.
    whole = sum(float(w.square().sum()) for w in wg if w is not None) ** 0.5
    for g, w in zip(gg, wg, strict=True):
        if w is None:
            assert g is None or float(g.abs().max()) == 0.0
            continue
        assert float((g - w).norm()) <= EXACT * whole


@pytest.mark.parametrize("family", hf_assets.FAMILIES)
@pytest.mark.parametrize(("pad", "shift"), [("right", False), ("left", False), ("right", True)])
def test_every_family_chunked_equals_unchunked_in_float64(family: str, pad: str, shift: bool):
    # MoE experts' grouped_mm kernel has no float64 version: the eager experts loop.
    model = hf_assets.build_model(family, seed=1, _experts_implementation="eager").double()
    assert chunkable(model) is None
    _compare(model, _batch(pad, shift), chunk=5)


def test_a_tied_head_and_a_moe_router_loss_are_unchanged() -> None:
    tied = hf_assets.build_model("llama", seed=2, tie_word_embeddings=True).double()
    tied.tie_weights()
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    _compare(tied, _batch("right", False), chunk=3)
    moe = mixtral(seed=3, dtype=torch.float64)
    batch = _batch("right", False, vocab=moe.config.vocab_size)
    assert "router" in causal_lm_loss(moe, batch).aux
    _compare(moe, batch, chunk=4)


def test_what_cannot_be_chunked_exactly_is_refused_with_the_reason() -> None:
    peft = pytest.importorskip("peft")
    model = hf_assets.build_model("llama", seed=0)
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["lm_head"]))
    assert "not a plain nn.Linear" in chunkable(adapted)
    with pytest.raises(ValueError, match="chunk_tokens= cannot be used here: its output"):
        causal_lm_loss(adapted, _batch("right", False), chunk_tokens=4)
    capped = hf_assets.build_model("llama", seed=0)
    capped.config.final_logit_softcapping = 30.0
    assert "soft-capped" in chunkable(capped)
    other = peft.get_peft_model(
        hf_assets.build_model("llama", seed=0), peft.LoraConfig(r=2, target_modules=["q_proj"])
    )
    assert chunkable(other) is None  # adapters elsewhere: the head is still plain
    _compare(other.double(), _batch("right", False), chunk=4)


@pytest.mark.parametrize(("key", "value"), [("labels", 999), ("labels", -5), ("shift_labels", -1)])
def test_a_label_outside_the_vocabulary_names_the_key_when_chunked(key: str, value: int) -> None:
    from gradstep.hf import BatchError

    batch = _batch("right", key == "shift_labels")
    batch[key][0, 2] = value
    with pytest.raises(BatchError, match=rf"batch\['{key}'\].*{value}"):
        causal_lm_loss(hf_assets.build_model("llama", seed=0), batch, chunk_tokens=2)


def chunked_ranks(rank: int, world: int) -> dict:
    """One SGD step of the tiny float64 Llama on 2 ranks under DDP and FSDP2, with the
    chunked loss and without: the parameters after it (full tensors)."""
    import functools

    import gradstep
    import gradstep.parallel as gd
    from gradstep.hf import count_tokens

    out = {}
    for strategy in ("ddp", "fsdp"):
        for chunk in (None, 3):
            model = gd.prepare_model(hf_assets.build_model("llama", seed=4).double(), strategy)
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            stepper = gradstep.Stepper(model, opt, clip=gradstep.ClipNorm(0.05))
            gen = torch.Generator().manual_seed(20 + rank)
            window = [_batch_from(gen) for _ in range(2)]
            loss = functools.partial(causal_lm_loss, chunk_tokens=chunk)
            stats = stepper.step(window, loss, count=count_tokens)
            params = {
                n.removeprefix("module."): (p.full_tensor() if hasattr(p, "full_tensor") else p)
                .detach().clone()
                for n, p in model.named_parameters()
            }  # fmt: skip
            out[(strategy, chunk)] = {"params": params, "norm": stats.grad_norm}
    return out


def _batch_from(gen: torch.Generator) -> dict:
    lengths = torch.randint(2, 12, (2,), generator=gen).tolist()
    return hf_batch([torch.randint(0, hf_assets.VOCAB, (n,), generator=gen) for n in lengths])


@pytest.mark.distributed
def test_ddp_and_fsdp2_steps_with_the_chunked_loss_equal_the_unchunked() -> None:
    """Under FSDP2 the projection's weight is the one the root gathered for its forward:
    its gradient must reach the reduce-scatter like any other (2 gloo ranks, float64)."""
    from tests.support.multiproc import run_ranks

    for res in run_ranks(chunked_ranks, 2, timeout=240):
        for strategy in ("ddp", "fsdp"):
            got, want = res[(strategy, 3)], res[(strategy, None)]
            assert got["norm"] == pytest.approx(want["norm"], rel=EXACT), strategy
            for name, value in want["params"].items():
                torch.testing.assert_close(got["params"][name], value, rtol=EXACT, atol=EXACT)
