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

import pytest
import torch

pytest.importorskip("transformers")

import gradstep  # noqa: E402
from gradstep.hf import causal_lm_loss, count_tokens  # noqa: E402
from tests.hf.helpers import grads_of, hf_batch, mixtral, reference_grads, rel_err, window_seqs  # noqa: E402
from tests.hf.workers import aux_grads  # noqa: E402
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
