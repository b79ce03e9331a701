"""gradstep.hf.causal_lm_loss / count_tokens against a float64 full-window reference in
which every sequence runs alone and unpadded (so padding, the shift and the count are all
checked), with right and left padding and micro-batches of 0 and 1 targets.

Tolerances: GPT2 in float64 is exact to float64 rounding (<= 1e-13 relative). Llama against
the usual reference (backpropagating the mean) stops near 6e-8 even in float64, because HF's
RMSNorm casts activation gradients to float32 and that rounding depends on the scale
backpropagated: <= 3e-7 there, and <= 1e-13 against a reference that backpropagates the
sum first, as the Stepper does.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import gradstep  # noqa: E402
from gradstep.hf import causal_lm_loss, causal_lm_targets, count_tokens  # noqa: E402
from tests.hf.helpers import (  # noqa: E402
    gpt2,
    grads_of,
    hf_batch,
    llama,
    reference_grads,
    rel_err,
    window_seqs,
)

TOL = {"gpt2": 1e-13, "llama": 3e-7}


@pytest.mark.parametrize("pad", ["right", "left"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_window_gradient_equals_the_unpadded_full_window(name: str, pad: str) -> None:
    build = {"gpt2": gpt2, "llama": llama}[name]
    gen = torch.Generator().manual_seed(3)
    model = build(dtype=torch.float64)
    for k in (1, 4):
        seqs = window_seqs(gen, k)
        want, loss, n = reference_grads(copy.deepcopy(model), seqs)
        stepper = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.0), clip=None)
        window = [hf_batch(s, pad) for s in seqs]
        stats = stepper.step(window, causal_lm_loss, count=count_tokens)
        assert rel_err(grads_of(model), want) <= TOL[name]
        assert stats.items == n and stats.loss == pytest.approx(loss, rel=TOL[name])
        # Also without count= (no aux term: nothing changes).
        again = stepper.step(window, causal_lm_loss)
        assert rel_err(grads_of(model), want) <= TOL[name] and again.items == n


@pytest.mark.parametrize("pad", ["right", "left"])
def test_llama_float64_equals_a_sum_first_reference_to_rounding(pad: str) -> None:
    """The ~6e-8 floor of Llama in float64 is HF's float32 cast in RMSNorm's backward, whose
    rounding depends on the scale backpropagated (measured 1.4e-16 against a reference that
    backpropagates the sum first, 5.3e-8 against the mean-first one): gradstep itself is
    exact to float64 rounding, left padding included."""
    gen = torch.Generator().manual_seed(3)
    model = llama(dtype=torch.float64)
    seqs = window_seqs(gen, 4)
    want, _, n = reference_grads(copy.deepcopy(model), seqs, sum_first=True)
    stepper = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.0), clip=None)
    stats = stepper.step([hf_batch(s, pad) for s in seqs], causal_lm_loss, count=count_tokens)
    assert rel_err(grads_of(model), want) <= 1e-13 and stats.items == n


def test_zero_and_one_target_micro_batches() -> None:
    model = llama()
    empty = hf_batch([torch.tensor([5]), torch.tensor([7])])
    one = hf_batch([torch.tensor([5, 9])], pad="left")
    loss = causal_lm_loss(model, empty)
    assert int(loss.count) == 0 == count_tokens(empty) and float(loss.total.detach()) == 0.0
    loss = causal_lm_loss(model, one)
    assert int(loss.count) == 1 == count_tokens(one) and torch.isfinite(loss.total)


def test_targets_skip_pads_on_both_sides_and_ignored_labels() -> None:
    batch = hf_batch([torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6, 7, 8])], pad="left")
    batch["labels"][1, 3] = -100  # the user ignores token 7: position 2 has no target
    targets = causal_lm_targets(batch)
    # Row 0 is [pad, pad, 1, 2, 3]: the pad before "1" must not predict it.
    assert targets.tolist() == [[-100, -100, 2, 3], [5, 6, -100, 8]]
    assert count_tokens(batch) == 5
    shifted = {"input_ids": batch["input_ids"], "labels": targets}
    assert count_tokens(shifted, shifted=True) == 5


def test_model_is_called_without_labels_and_without_cache() -> None:
    model = llama()
    seen = {}
    forward = model.forward

    def spy(**kwargs):
        seen.update(kwargs)
        return forward(**kwargs)

    model.forward = spy
    causal_lm_loss(model, hf_batch([torch.tensor([1, 2, 3])]))
    assert "labels" not in seen and seen["use_cache"] is False
    assert "position_ids" not in seen  # right padding: HF's own positions are right


def test_clear_errors() -> None:
    model = llama()
    with pytest.raises(KeyError, match="labels"):
        causal_lm_loss(model, {"input_ids": torch.zeros(1, 3, dtype=torch.long)})
    with pytest.raises(TypeError, match="mapping"):
        count_tokens([torch.zeros(1, 3)])
    with pytest.raises(ValueError, match="aux_coef"):
        causal_lm_loss(model, hf_batch([torch.tensor([1, 2])]), aux_coef=-1.0)
