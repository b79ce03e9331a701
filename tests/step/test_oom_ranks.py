"""``on_oom="split"`` on two ranks whose micro-batches differ: the rank that runs out of
memory can still shrink, the other cannot (its micro-batches hold one item). Every rank
splits together and the step equals the one-process step of the whole window (float64, to
1e-12); ``MicroBatchTooLarge`` is only for a rank that runs out in a one-item micro-batch.
A held-out mutation audit found "give up when ANY rank can no longer shrink" surviving
(issue 20, section 4): the test beside it accepted an agreed error in this case.
"""

from __future__ import annotations

import pytest
import torch

import gradstep
from tests.support.asserts import rel_err
from tests.support.batches import collate
from tests.support.models import TINY_GPT, tiny_gpt
from tests.support.reference import lm_loss

SCENARIOS = {  # name: (rows per micro-batch on rank 0, on rank 1, rank 1 runs out above)
    "one halving": ((1, 1), (4, 4), 2),
    "down to one item on both": ((1, 1), (4, 4), 1),
    "uneven micro-batches on the rank that splits": ((1, 1), (3, 1), 1),
}
LAST = {"out of memory in the last micro-batch": ((1, 2), (1, 2), 1)}
"""The forward that runs out is the window's last, the one with gradient sync on: under DDP
the other rank's reducer is then armed for a backward that never comes (issue 28 §4)."""
STEPS = 2
"""Windows per scenario: the one that splits, and one after it (DDP rebuilds its buckets)."""


def window(rank: int, sizes: tuple[int, ...], step: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(11 + 17 * rank + 101 * step)
    out = []
    for n in sizes:
        lengths = torch.randint(2, TINY_GPT.max_seq_len, (n,), generator=gen).tolist()
        ids = torch.randint(1, TINY_GPT.vocab_size, (n, TINY_GPT.max_seq_len + 1), generator=gen)
        out.append(collate([(ids[r, :k], ids[r, 1 : k + 1]) for r, k in enumerate(lengths)]))
    return out


class OutOfMemoryAbove:
    """``loss_fn`` that runs out of memory on micro-batches of more than ``rows`` rows."""

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def __call__(self, model: torch.nn.Module, mb: dict) -> gradstep.LossSum:
        if mb["input_ids"].shape[0] > self.rows:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate (injected)")
        return lm_loss(model, mb)


def split_ranks(rank: int, world: int, strategy: str, scenarios: dict = SCENARIOS) -> dict:
    import gradstep.parallel as gd

    out = {}
    for name, (rows0, rows1, limit) in scenarios.items():
        model = gd.prepare_model(tiny_gpt(torch.float64), strategy)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        stepper = gradstep.Stepper(model, opt, clip=None, on_oom="split")
        loss_fn = lm_loss if rank == 0 else OutOfMemoryAbove(limit)
        try:
            stats = [
                stepper.step(window(rank, (rows0, rows1)[rank], s), loss_fn) for s in range(STEPS)
            ]
            result: dict = {"splits": stats[0].oom_splits, "items": [s.items for s in stats]}
        except Exception as exc:  # reported, not raised: the other rank's result is wanted
            result = {"error": f"{type(exc).__name__}: {exc}"}
        result["params"] = {
            n.removeprefix("module."): (p.full_tensor() if hasattr(p, "full_tensor") else p)
            .detach()
            .clone()
            for n, p in model.named_parameters()
        }
        out[name] = result
    return out


def one_process(rows0: tuple[int, ...], rows1: tuple[int, ...]) -> dict[str, torch.Tensor]:
    model = tiny_gpt(torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    stepper = gradstep.Stepper(model, opt, clip=None)
    for s in range(STEPS):
        stepper.step(window(0, rows0, s) + window(1, rows1, s), lm_loss)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_rank_that_can_shrink_splits_while_another_holds_one_item(strategy):
    from tests.support.multiproc import run_ranks

    check(run_ranks(split_ranks, 2, strategy, timeout=120, collective_timeout_s=30), SCENARIOS)


def check(ranks: list[dict], scenarios: dict) -> None:
    for name, (rows0, rows1, _) in scenarios.items():
        got = [r[name] for r in ranks]
        assert all("error" not in r for r in got), (name, [r.get("error") for r in got])
        assert got[0]["splits"] == got[1]["splits"] >= 1, name
        want = one_process(rows0, rows1)
        for r in got:
            for key, value in want.items():
                assert rel_err([r["params"][key]], [value]) < 1e-12, (name, key)


@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_out_of_memory_in_the_last_micro_batch_on_one_rank_splits_every_rank(strategy):
    from tests.support.multiproc import run_ranks

    ranks = run_ranks(split_ranks, 2, strategy, LAST, timeout=120, collective_timeout_s=30)
    check(ranks, LAST)


def tp_last_ranks(rank: int, world: int) -> dict:
    """FSDP2 + tensor parallel on (dp=2, tp=2): rank 1 ALONE (dp rank 0, one of its two
    tensor-parallel peers) runs out of memory in the window's last micro-batch (3 rows) of
    the first step; tp_ranks' AdamW, ClipNorm acting, then two more steps."""
    from tests.parallel import tp_ranks as tp

    model, mesh = tp.build(sp=False)
    opt = tp.optimizer("adamw", model.parameters())
    stepper = gradstep.Stepper(model, opt, on_oom="split")
    dp_rank = mesh["dp"].get_local_rank()

    def loss_fn(m: torch.nn.Module, mb: dict) -> gradstep.LossSum:
        if rank == 1 and stepper.step_count == 0 and mb["input_ids"].shape[0] > 2:
            raise torch.OutOfMemoryError("out of memory (injected)")
        return tp.loss_sum(m, mb)

    steps = []
    for step, per_rank in enumerate(tp.data()):
        stepper.clip = gradstep.ClipNorm(tp.MAX_NORM, norm_type=tp.NORM_TYPES[step])
        stats = stepper.step(per_rank[dp_rank], loss_fn)
        params = {n: tp._full(p).detach().clone() for n, p in model.named_parameters()}
        steps.append({"stats": stats, "params": params})
    return {"steps": steps}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_out_of_memory_in_the_last_micro_batch_on_one_tensor_parallel_rank():
    from tests.parallel import tp_ranks as tp
    from tests.support.multiproc import run_ranks

    ref = tp.reference("adamw")
    for rank, res in enumerate(run_ranks(tp_last_ranks, 4, timeout=240, collective_timeout_s=60)):
        assert [s["stats"].oom_splits for s in res["steps"]] == [1, 0, 0], rank
        tp.check_steps(rank, res["steps"], ref, 1e-12)
