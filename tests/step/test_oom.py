"""Exact recovery from out-of-memory: ``Stepper(on_oom="split")``.

Out-of-memory is injected (a loss or a backward that raises ``torch.OutOfMemoryError`` when a
micro-batch holds more than R rows); the split window's update must equal the unsplit
reference's, because normalisation is by items, not by micro-batches.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gradstep
from gradstep.errors import MicroBatchTooLarge
from gradstep.step.oom import split_in_half
from tests.support.asserts import rel_err
from tests.support.batches import make_window, make_windows
from tests.support.models import TinyLM, tiny_gpt
from tests.support.reference import lm_loss

WINDOW = [[3, 5, 2, 7], [4, 6, 1, 2]]  # two micro-batches of 4 rows each


class OOMAbove:
    """``loss_fn`` that runs out of memory for micro-batches of more than ``rows`` rows."""

    def __init__(self, rows: int, in_backward: bool = False) -> None:
        self.rows, self.in_backward, self.seen = rows, in_backward, []

    def __call__(self, model: nn.Module, mb: dict) -> gradstep.LossSum:
        n = mb["input_ids"].shape[0]
        self.seen.append(n)
        if n > self.rows and not self.in_backward:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate (injected)")
        total, count = lm_loss(model, mb)
        if n > self.rows:

            def fail(grad: torch.Tensor) -> torch.Tensor:
                raise torch.OutOfMemoryError("CUDA out of memory (injected, in backward)")

            total.register_hook(fail)
        return gradstep.LossSum(total, count)


def _run(loss_fn, precision="fp32", dtype=torch.float32, steps=1, seed=0, **kw):  # noqa: ANN001
    torch.manual_seed(seed)
    model = TinyLM().to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    stepper = gradstep.Stepper(model, opt, clip=None, precision=precision, **kw)
    before = [p.detach().clone() for p in model.parameters()]
    stats = [stepper.step(make_window(WINDOW, seed=i)[0], loss_fn) for i in range(steps)]
    update = [(b - p.detach()).double() for b, p in zip(before, model.parameters(), strict=True)]
    return stats, update, stepper


@pytest.mark.parametrize("in_backward", [False, True], ids=["forward", "backward"])
def test_split_window_equals_the_unsplit_one(in_backward):
    ref_stats, ref_update, _ = _run(lm_loss, steps=2)
    loss_fn = OOMAbove(1, in_backward=in_backward)
    stats, update, stepper = _run(loss_fn, steps=2, on_oom="split")
    assert [s.oom_splits for s in stats] == [2, 0]  # 4 rows -> 2 -> 1; then halved up front
    assert stepper.oom_halvings == 2 and loss_fn.seen[-8:] == [1] * 8
    assert rel_err(update, ref_update) < 1e-6  # float32: only the summation order differs
    for got, want in zip(stats, ref_stats, strict=True):
        assert (got.items, got.loss) == (want.items, pytest.approx(want.loss, rel=1e-6))
        assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-6)
        assert got.micro_batches == 8  # the window now runs as 8 one-row micro-batches


def test_recovery_leaves_no_stale_state_in_fp16_and_bf16_buffers():
    for precision, dtype in (("fp16", torch.float32), ("bf16", torch.bfloat16)):
        ref_stats, ref_update, ref = _run(lm_loss, precision, dtype, steps=2)
        stats, update, stepper = _run(OOMAbove(2), precision, dtype, steps=2, on_oom="split")
        assert stats[0].oom_splits == 1
        assert stepper.loss_scale == ref.loss_scale  # the scaler neither grew nor backed off
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-3
        assert rel_err(update, ref_update) < tol, precision


def test_a_one_item_micro_batch_that_does_not_fit_is_a_clear_error():
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    stepper = gradstep.Stepper(model, opt, on_oom="split")
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(MicroBatchTooLarge, match="after 2 halvings, micro-batches of one item"):
        stepper.step(make_window(WINDOW)[0], OOMAbove(0))
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])
    assert all(p.grad is None for p in model.parameters())


def test_raise_is_the_default_and_bad_arguments_are_named():
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with pytest.raises(torch.OutOfMemoryError):
        gradstep.Stepper(model, opt).step(make_window(WINDOW)[0], OOMAbove(1))
    with pytest.raises(ValueError, match="on_oom must be one of raise, split"):
        gradstep.Stepper(model, opt, on_oom="halve")
    with pytest.raises(TypeError, match="split_fn"):
        gradstep.Stepper(model, opt, split_fn=3)


def test_default_splitter_and_a_custom_one():
    x = torch.arange(10).view(5, 2)
    a, b = split_in_half({"ids": x, "meta": [x, (x,)], "tag": "keep"})
    assert a["ids"].shape[0] == 3 and b["ids"].shape[0] == 2 and a["tag"] == b["tag"] == "keep"
    assert torch.equal(torch.cat([a["meta"][1][0], b["meta"][1][0]]), x)
    one, empty = split_in_half(x[:1])
    assert torch.equal(one, x[:1]) and empty.shape == (0, 2)
    with pytest.raises(TypeError, match="split_fn="):
        split_in_half({"a": x, "b": x[:2]})
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    calls = []

    def by_rows(mb):  # noqa: ANN001, ANN202
        calls.append(mb["input_ids"].shape[0])
        return split_in_half(mb)

    stepper = gradstep.Stepper(model, opt, on_oom="split", split_fn=by_rows)
    assert stepper.step(make_window(WINDOW)[0], OOMAbove(2)).oom_splits == 1
    assert calls == [4, 4]


def oom_rank(rank: int, world: int, strategy: str) -> dict:
    """Rank 0 runs out of memory for micro-batches of more than one row; rank 1 never does.
    Both must split together, twice, and take the unsplit step."""
    import gradstep.parallel as gd

    model = gd.prepare_model(tiny_gpt(torch.float64), strategy)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    stepper = gradstep.Stepper(model, opt, clip=None, on_oom="split")
    loss_fn = OOMAbove(1) if rank == 0 else lm_loss
    stats = [stepper.step(window[rank], loss_fn) for window in make_windows(2, 2, 2, seed=3)]
    full = {n.removeprefix("module."): p for n, p in model.named_parameters()}
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for n, p in full.items()}  # fmt: skip
    return {"splits": [s.oom_splits for s in stats], "norm": [s.grad_norm for s in stats],
            "params": params}  # fmt: skip


def _single_process_reference() -> dict[str, torch.Tensor]:
    model = tiny_gpt(torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    stepper = gradstep.Stepper(model, opt, clip=None)
    for window in make_windows(2, 2, 2, seed=3):
        stepper.step([mb for rank in window for mb in rank], lm_loss)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_an_oom_on_one_rank_splits_every_rank_and_stays_exact(strategy):
    from tests.support.multiproc import run_ranks

    a, b = run_ranks(oom_rank, 2, strategy, timeout=90, collective_timeout_s=30)
    assert a["splits"] == b["splits"] and a["splits"][0] >= 1 and a["splits"][1] == 0
    assert a["norm"] == b["norm"]
    want = _single_process_reference()
    for name, value in want.items():
        assert rel_err([a["params"][name]], [value]) < 1e-12, name
        assert torch.equal(a["params"][name], b["params"][name]), name


# ------------------------------------------- ranks whose micro-batches differ in size

UNEVEN = {  # scenario: (rows per micro-batch on rank 0, on rank 1, OOM above rows: r0, r1)
    "one rank splits, the other cannot shrink": ((1, 1), (4, 4), (None, 2)),
    "the rank that cannot shrink runs out": ((1, 1), (4, 4), (0, None)),
    "both split, by different amounts": ((3, 3), (4, 4), (1, 2)),
    "windows of different lengths": ((2, 2), (2, 2, 2), (None, None)),
}


def _uneven_window(rank: int, sizes: tuple[int, ...], seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed + 17 * rank)
    return [_rows(gen, n) for n in sizes]


def _rows(gen: torch.Generator, n: int) -> dict:
    from tests.support.batches import collate
    from tests.support.models import TINY_GPT

    lengths = torch.randint(2, TINY_GPT.max_seq_len, (n,), generator=gen).tolist()
    ids = torch.randint(1, TINY_GPT.vocab_size, (n, TINY_GPT.max_seq_len + 1), generator=gen)
    return collate([(ids[r, :k], ids[r, 1 : k + 1]) for r, k in enumerate(lengths)])


def uneven_rank(rank: int, world: int, strategy: str) -> dict:
    """Every scenario of UNEVEN in one start of the ranks: what each rank ended with."""
    import gradstep.parallel as gd

    out = {}
    for name, (rows0, rows1, limits) in UNEVEN.items():
        model = gd.prepare_model(tiny_gpt(torch.float64), strategy)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        stepper = gradstep.Stepper(model, opt, clip=None, on_oom="split")
        limit = limits[rank]
        loss_fn = lm_loss if limit is None else OOMAbove(limit)
        window = _uneven_window(rank, (rows0, rows1)[rank], seed=5)
        try:
            stats = stepper.step(window, loss_fn)
            result = {"splits": stats.oom_splits, "micro_batches": stats.micro_batches}
        except (MicroBatchTooLarge, RuntimeError) as exc:
            result = {"error": type(exc).__name__, "message": str(exc)}
        params = {n.removeprefix("module."): p for n, p in model.named_parameters()}
        result["params"] = {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in params.items()
        }
        result["grads_left"] = any(p.grad is not None for p in model.parameters())
        out[name] = result
    out["eval"] = _evaluate_split(rank, gd.prepare_model(tiny_gpt(torch.float64), strategy))
    return out


def _evaluate_split(rank: int, model: nn.Module) -> float:
    """Validation on two ranks: rank 0 runs out of memory above one row, rank 1 never."""
    from gradstep_cli.run.evaluation import evaluate

    batches = _uneven_window(rank, (4, 3), seed=9)
    return evaluate(model, batches, torch.device("cpu"), OOMAbove(1) if rank == 0 else lm_loss)


def _uneven_reference(name: str) -> dict[str, torch.Tensor]:
    rows0, rows1, _ = UNEVEN[name]
    model = tiny_gpt(torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    window = _uneven_window(0, rows0, 5) + _uneven_window(1, rows1, 5)
    gradstep.Stepper(model, opt, clip=None).step(window, lm_loss)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ranks_with_different_micro_batch_sizes_end_the_same_way(strategy):
    """One rank's micro-batches hold 1 item, the other's 4: an out-of-memory on either
    ends every rank the same way, never in a hang: all split together and take the
    one-process step, or all raise MicroBatchTooLarge with nothing changed."""
    from tests.support.multiproc import run_ranks

    a, b = run_ranks(uneven_rank, 2, strategy, timeout=120, collective_timeout_s=30)
    start = {n: p.detach().clone() for n, p in tiny_gpt(torch.float64).named_parameters()}
    for name in UNEVEN:
        got = (a[name], b[name])
        for r in got:
            for key, value in r["params"].items():
                assert torch.equal(value, got[0]["params"][key]), (name, key)
        errors = {r.get("error") for r in got}
        if name == "the rank that cannot shrink runs out":
            assert errors == {"MicroBatchTooLarge"}, (name, got)
            assert "after 0 halvings" in a[name]["message"]
            assert "CUDA out of memory" in a[name]["message"]  # the rank's own error, said
        if name == "windows of different lengths":
            assert errors == {"RuntimeError"} and "micro-batches" in a[name]["message"], got
        if errors != {None}:  # an error: every rank's parameters are untouched
            assert not any(r["grads_left"] for r in got), name
            for key, value in start.items():
                assert torch.equal(a[name]["params"][key], value), (name, key)
            continue
        want = _uneven_reference(name)
        assert a[name]["splits"] == b[name]["splits"] >= 1, name
        assert a[name]["micro_batches"] == b[name]["micro_batches"], name
        for key, value in want.items():
            assert rel_err([a[name]["params"][key]], [value]) < 1e-12, (name, key)
    assert a["both split, by different amounts"]["splits"] == 2  # 3 rows -> 2 -> 1
    from gradstep_cli.run.evaluation import evaluate

    every = _uneven_window(0, (4, 3), seed=9) + _uneven_window(1, (4, 3), seed=9)
    want = evaluate(tiny_gpt(torch.float64), every, torch.device("cpu"), lm_loss)
    assert a["eval"] == b["eval"] == pytest.approx(want, rel=1e-12)


def test_evaluation_splits_a_batch_that_runs_out_of_memory():
    """The final evaluation of a run that recovered in training must not crash at the
    planned size: the batch is halved, and the token-weighted loss stays the unsplit one."""
    from gradstep_cli.run.evaluation import evaluate

    model = tiny_gpt(torch.float64)
    batches = _uneven_window(0, (4, 3, 4), seed=2)
    cpu = torch.device("cpu")
    want = evaluate(model, batches, cpu, lm_loss)
    tight = OOMAbove(1)
    assert evaluate(model, batches, cpu, tight) == pytest.approx(want, rel=1e-12)
    assert max(tight.seen[-4:]) <= 1  # later batches start split
    with pytest.raises(torch.OutOfMemoryError):
        evaluate(model, batches, cpu, OOMAbove(1), on_oom="raise")
    with pytest.raises(MicroBatchTooLarge, match="after 2 halvings.*CUDA out of memory"):
        evaluate(model, batches, cpu, OOMAbove(0))
    assert model.training  # restored, also after the error
    with pytest.raises(ValueError, match="on_oom must be one of raise, split"):
        evaluate(model, batches, cpu, on_oom="halve")


@pytest.mark.parametrize(
    ("exc", "oom"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
        (MemoryError(), True),
        (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
                      "can't allocate memory: you tried to allocate 25165824 bytes."), True),
        (RuntimeError("could not create a primitive"), True),
        (RuntimeError("CUDA error: out of memory"), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x4)"), False),
        (ValueError("can't allocate memory"), False),  # not an allocator's error type
    ],
)  # fmt: skip
def test_out_of_memory_is_recognised_as_the_allocators_report_it(exc, oom):
    from gradstep.step.oom import is_out_of_memory

    assert is_out_of_memory(exc) is oom


def test_a_memory_error_without_a_message_is_split_too():
    calls = []

    def loss_fn(model, mb):  # noqa: ANN001, ANN202
        calls.append(mb["input_ids"].shape[0])
        if mb["input_ids"].shape[0] > 2:
            raise MemoryError  # what numpy or Python raise under an address-space limit
        return lm_loss(model, mb)

    stats, update, _ = _run(loss_fn, on_oom="split")
    assert stats[0].oom_splits == 1 and max(calls[-4:]) == 2


def test_a_one_dnn_kernel_failure_says_the_thread_cannot_compile_any_more():
    """oneDNN (torch 2.13) fails every later compile on a thread where one ran out of
    memory: the error must say the halvings measured that, not the memory left."""
    from gradstep.step.oom import too_large_error

    plain = str(too_large_error(3, "RuntimeError: DefaultCPUAllocator: can't allocate memory"))
    assert "after 3 halvings" in plain and "oneDNN" not in plain
    kernel = str(too_large_error(5, "RuntimeError: could not create a primitive"))
    assert "cannot compile one for any new shape" in kernel and "restart the process" in kernel
