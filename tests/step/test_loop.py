"""The micro-batch loop's seams and its cost in files.

- ``Strategy.micro_batch(mb, is_last)``: entered around each micro-batch's forward and
  backward, with ``is_last`` only on the last (or on every one with
  ``sync_each_micro_batch``), and what it yields is what ``loss_fn`` sees (a
  context-parallel strategy yields its part of the micro-batch);
- ``RunsWindow``: a strategy that runs the window itself, in its own order, gets the same
  update as the step's own loop (float64, to 1e-12);
- one steady-state single-process step enters at most 30 gradstep files' code, in at most
  10 files (the architecture review's tracer; issue 29 §2).
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import gradstep
from gradstep.parallel import LocalStrategy, RunsWindow, capabilities
from tests.support.asserts import rel_err
from tests.support.batches import make_window
from tests.support.models import TinyLM
from tests.support.reference import lm_loss


class Recording(LocalStrategy):
    """One process, recording what the micro-batch seam saw, and yielding a copy of each
    micro-batch (as a context-parallel strategy yields a part of it)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, bool]] = []
        self.yielded: list[int] = []

    @contextlib.contextmanager
    def micro_batch(self, micro_batch: Any, is_last: bool) -> Iterator[Any]:
        self.seen.append((id(micro_batch), is_last))
        part = dict(micro_batch)
        self.yielded.append(id(part))
        yield part


class Reversed(LocalStrategy):
    """Runs the window itself, last micro-batch first (a pipeline schedule would run them
    in its own order): the step's loop is handed over whole."""

    def __init__(self) -> None:
        self.order: list[int] = []

    def run_window(self, loop: Any, micro_batches: Any, tally: Any, loss_fn: Any, final: Any):
        mbs = list(micro_batches)
        for index in reversed(range(len(mbs))):
            self.order.append(index)
            last = index == 0  # the one backward that synchronises, here the final one
            loop.one(index, mbs[index], last, loss_fn, tally, final if last else loop_null())


def loop_null() -> contextlib.AbstractContextManager[None]:
    from gradstep.step.loop import NULL

    return NULL


def _window(seed: int = 3) -> list[dict]:
    mbs, _ = make_window([[3, 5], [2], [7, 1, 4]], seed=seed)
    return mbs


def _step(strategy: Any, model: torch.nn.Module, **kw: Any) -> tuple[list, Any]:
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepper = gradstep.Stepper(model, opt, clip=gradstep.ClipNorm(0.01), strategy=strategy, **kw)
    stats = stepper.step(_window(), _loss_of(strategy))
    return [p.detach().clone() for p in model.parameters()], stats


def _loss_of(strategy: Any):
    def loss_fn(model: torch.nn.Module, mb: dict) -> gradstep.LossSum:
        if isinstance(strategy, Recording):  # loss_fn sees what the seam yielded
            assert id(mb) == strategy.yielded[-1]
        return lm_loss(model, mb)

    return loss_fn


@pytest.mark.parametrize("sync_each", [False, True])
def test_the_micro_batch_seam_sees_each_micro_batch_and_the_last(sync_each: bool) -> None:
    strategy = Recording()
    torch.manual_seed(0)
    model = TinyLM().double()
    got, stats = _step(strategy, model, sync_each_micro_batch=sync_each)
    want, _ = _step(None, model)
    assert [last for _, last in strategy.seen] == (
        [True] * 3 if sync_each else [False, False, True]
    )
    assert rel_err(got, want) <= 1e-12 and stats.micro_batches == 3


def test_a_strategy_that_runs_the_window_itself_takes_the_same_step() -> None:
    strategy = Reversed()
    assert isinstance(strategy, RunsWindow) and capabilities(strategy).run_window is not None
    torch.manual_seed(0)
    model = TinyLM().double()
    got, stats = _step(strategy, model)
    want, ref = _step(None, model)
    assert strategy.order == [2, 1, 0]
    assert rel_err(got, want) <= 1e-12
    assert stats.items == ref.items and stats.clipped and ref.clipped
    assert stats.grad_norm == pytest.approx(ref.grad_norm, rel=1e-12)


TRACE_ENTRIES, TRACE_FILES = 30, 10


def test_one_plain_step_enters_at_most_30_file_entries_in_at_most_10_files() -> None:
    """The review's tracer: every call into a gradstep source file during one steady-state
    step of a small MLP on one process, consecutive calls within one file merged."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    stepper = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.1))

    def loss_fn(m: torch.nn.Module, mb: tuple) -> gradstep.LossSum:
        x, y = mb
        return gradstep.LossSum(((m(x) - y) ** 2).sum(), x.shape[0])

    window = [(torch.randn(4, 8), torch.randn(4, 1))]
    stepper.step(window, loss_fn)  # warm-up
    root = os.path.dirname(os.path.dirname(gradstep.__file__)) + os.sep
    seq: list[str] = []

    def tracer(frame: Any, event: str, arg: Any) -> None:
        f = frame.f_code.co_filename
        if event == "call" and f.startswith(root) and (not seq or seq[-1] != f):
            seq.append(f)

    sys.settrace(tracer)
    try:
        stepper.step(window, loss_fn)
    finally:
        sys.settrace(None)
    files = {f.removeprefix(root) for f in seq}
    assert len(seq) <= TRACE_ENTRIES and len(files) <= TRACE_FILES, (len(seq), sorted(files))
