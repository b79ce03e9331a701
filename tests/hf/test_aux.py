"""MoE router (load-balancing) loss under accumulation: the step's gradient is that of
sum(CE) / N + mean over micro-batches of coef * aux_loss, over the whole window and every
rank, checked against the single-process float64 reference (tests.hf.helpers).

Tolerance 3e-7 relative (whole gradient and router weights alone): HF computes RMSNorm and
the router softmax in float32 even in a float64 model, which floors the error near 6e-8.
Weighting the aux term by 1/N instead of 1/k (the obvious LossSum(ce + aux, n)) gives ~0.9
on the router gradient, so the tolerance separates right from wrong by 6 orders.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

pytest.importorskip("transformers")

import gradstep  # noqa: E402
from gradstep.hf import causal_lm_loss, count_tokens  # noqa: E402
from tests.hf.helpers import (  # noqa: E402
    grads_of,
    hf_batch,
    llama,
    mixtral,
    reference_grads,
    rel_err,
    window_seqs,
)
from tests.hf.hf_ranks import aux_grads  # noqa: E402
from tests.support.multiproc import run_ranks  # noqa: E402

TOL = 3e-7


def _router(grads: dict) -> dict:
    return {k: v for k, v in grads.items() if ".gate." in k or k.endswith("gate.weight")}


def _aux_terms(model, seqs) -> list[float]:  # noqa: ANN001
    """coef * aux_loss of each micro-batch, as HF computes it (the model's own output)."""
    coef = model.config.router_aux_loss_coef
    with torch.no_grad():
        return [coef * float(model(**hf_batch(s)).aux_loss) for s in seqs]


def test_aux_loss_is_a_mean_over_micro_batches_one_process() -> None:
    gen = torch.Generator().manual_seed(5)
    model = mixtral(dtype=torch.float64)
    seqs = window_seqs(gen, 4)
    want, loss, n = reference_grads(copy.deepcopy(model), seqs, aux=True)
    assert _router(want), "the router weights are where the aux term acts"
    stepper = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.0), clip=None)
    stats = stepper.step([hf_batch(s) for s in seqs], causal_lm_loss, count=count_tokens)
    got = grads_of(model)
    assert rel_err(got, want) <= TOL
    assert rel_err(_router(got), _router(want)) <= TOL
    terms = _aux_terms(model, seqs)
    assert stats.aux["router"] == pytest.approx(sum(terms) / len(terms), rel=1e-7)
    # stats.loss is the token-weighted CE alone; the aux term is reported beside it.
    assert stats.loss + stats.aux["router"] == pytest.approx(loss, rel=1e-7)
    assert stats.items == n


def test_aux_coef_argument_overrides_the_config() -> None:
    model = mixtral()
    batch = hf_batch([torch.arange(6)])
    default = causal_lm_loss(model, batch).aux["router"].detach()
    doubled = causal_lm_loss(model, batch, aux_coef=0.04).aux["router"].detach()
    assert float(doubled) == pytest.approx(2 * float(default), rel=1e-6)
    assert causal_lm_loss(model, batch, aux_coef=0).aux == {}


def test_aux_coef_turns_the_router_loss_on_when_the_config_has_it_off() -> None:
    """HF MoE configs ship output_router_logits=False: aux_coef= must still add the router
    term (asked for in the forward), with the gradient of the full-window reference."""
    gen = torch.Generator().manual_seed(7)
    on = mixtral(dtype=torch.float64)
    seqs = window_seqs(gen, 4)
    want, _, n = reference_grads(copy.deepcopy(on), seqs, aux=True)
    coef = on.config.router_aux_loss_coef
    model = copy.deepcopy(on)
    model.config.output_router_logits = False
    window = [hf_batch(s) for s in seqs]
    assert causal_lm_loss(model, window[0]).aux == {}, "off by default: HF semantics"
    stepper = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.0), clip=None)
    loss_fn = functools.partial(causal_lm_loss, aux_coef=coef)
    stats = stepper.step(window, loss_fn, count=count_tokens)
    got = grads_of(model)
    assert rel_err(got, want) <= TOL
    assert rel_err(_router(got), _router(want)) <= TOL
    terms = _aux_terms(on, seqs)
    assert stats.aux["router"] == pytest.approx(sum(terms) / len(terms), rel=1e-7)
    assert stats.items == n


def test_aux_coef_on_a_model_without_router_is_an_error() -> None:
    model = llama()
    before = [p.detach().clone() for p in model.parameters()]
    batch = hf_batch([torch.arange(6)])
    with pytest.raises(ValueError, match=r"aux_coef=0.5 .*not a mixture of experts"):
        causal_lm_loss(model, batch, aux_coef=0.5)
    stepper = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="aux_coef"):
        stepper.step([batch], functools.partial(causal_lm_loss, aux_coef=0.5), count=count_tokens)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert causal_lm_loss(model, batch, aux_coef=0).aux == {}  # 0: nothing asked for


def test_an_empty_moe_window_is_skipped_and_counted_apart() -> None:
    """0 targets in the whole window: no update even though the router loss is non-zero
    (reported in stats.aux, not applied); counted under its own reason."""
    model = mixtral()
    before = [p.detach().clone() for p in model.parameters()]
    stepper = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.1), clip=None)
    masked = hf_batch([torch.arange(5)])
    masked["labels"][:] = -100
    window = [hf_batch([torch.tensor([5]), torch.tensor([7])]), masked]
    stats = stepper.step(window, causal_lm_loss, count=count_tokens)
    assert stats.skipped and stats.items == 0 and stepper.step_count == 0
    assert stats.skip_reason == "empty window: 0 items (every label ignored)"
    assert stats.aux["router"] > 0
    assert dict(stepper.skip_reasons) == {stats.skip_reason: 1} and stepper.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.distributed
def test_aux_loss_two_ranks_equal_the_one_process_window() -> None:
    gen = torch.Generator().manual_seed(6)
    seqs = window_seqs(gen, 6)  # ranks get 3 micro-batches each, unequal token counts
    want, loss, n = reference_grads(mixtral(dtype=torch.float64), seqs, aux=True)
    results = run_ranks(aux_grads, 2, seqs)
    for res in results:
        assert rel_err(res["grads"], want) <= TOL
        assert rel_err(_router(res["grads"]), _router(want)) <= TOL
        assert res["loss"] + res["aux"]["router"] == pytest.approx(loss, rel=1e-7)
        assert res["items"] == n
