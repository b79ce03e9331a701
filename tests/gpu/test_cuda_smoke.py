"""GPU smoke suite: the exact step, bf16/fp16, DDP/FSDP2 over NCCL and a checkpoint on CUDA.

``make test-gpu`` runs it; without CUDA every test is skipped (the NCCL ones also need two
GPUs). The model, the data and the references are defined here, apart from the CPU suite's;
starting and reaping the NCCL ranks (``free_port``, ``join_or_kill``) is
tests/support/multiproc.py's.

Every claim is checked against the plain computation: one float64 full batch (every
sequence of the window, right-padded, mean over all non-ignored tokens), torch's own
``clip_grad_norm_``/``get_total_norm`` and optimizer. Micro-batches carry very different
token counts and ``-100`` labels, so a mean of per-micro-batch (or per-rank) means is off
by order 1, far above every tolerance below.
"""

from __future__ import annotations

import copy
import os
import tempfile
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import gradstep
from tests.support.multiproc import free_port, join_or_kill

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEVICE = torch.device("cuda")
BACKEND = "nccl"
VOCAB = 13
IGNORE = -100
# Per micro-batch, the lengths of its sequences (2, 26 and 4 labelled tokens at seed 1).
LENGTHS = [[2, 1], [12, 9, 11], [5]]
# Per rank of the NCCL runs: rank 1 holds several times rank 0's tokens.
RANK_LENGTHS = [[[2], [3, 1]], [[12, 10], [9, 11, 8]]]


class TinyCausalLM(nn.Module):
    """Embedding, a causal prefix mean, residual tanh blocks, a head.

    The prefix mean is causal (like attention), so right-padding never changes the logits
    of real positions: micro-batches padded to their own width give exactly the per-token
    losses of the full batch padded to the longest sequence. The blocks sit in a
    ``ModuleList`` so that FSDP2 shards each one (several all-gather/reduce-scatter groups).
    """

    def __init__(self, dim: int = 16, n_blocks: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n_blocks))
        # nn.Identity, not Dropout(0): no RNG draw at all when dropout is off.
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        steps = torch.arange(1, ids.size(1) + 1, device=ids.device, dtype=h.dtype)
        h = h.cumsum(1) / steps[None, :, None]
        for block in self.blocks:
            h = h + self.drop(torch.tanh(block(h)))
        return self.head(h)


def tiny_lm(dtype: torch.dtype, device: Any, seed: int = 0, dropout: float = 0.0) -> nn.Module:
    """The same initial weights on every call with ``seed`` (drawn on the CPU generator)."""
    torch.manual_seed(seed)
    return TinyCausalLM(dropout=dropout).to(device=device, dtype=dtype)


def collate(seqs: list, device: Any) -> dict[str, torch.Tensor]:
    """Right-pad: inputs with 0, labels with -100 (padding carries no loss)."""
    width = max(len(ids) for ids, _ in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    labels = torch.full((len(seqs), width), IGNORE, dtype=torch.long)
    for i, (x, y) in enumerate(seqs):
        ids[i, : len(x)], labels[i, : len(y)] = x, y
    return {"input_ids": ids.to(device), "labels": labels.to(device)}


def make_window(lengths: list[list[int]], seed: int, device: Any) -> tuple[list, list]:
    """Micro-batches (one per list of sequence lengths) and all their sequences, with ~25%
    of the labels ignored; the first label is always kept so no micro-batch is empty."""
    gen = torch.Generator().manual_seed(seed)
    per_mb = []
    for mb in lengths:
        seqs = []
        for n in mb:
            ids = torch.randint(0, VOCAB, (n,), generator=gen)
            labels = torch.randint(0, VOCAB, (n,), generator=gen)
            labels[1:][torch.rand(n - 1, generator=gen) < 0.25] = IGNORE
            seqs.append((ids, labels))
        per_mb.append(seqs)
    return [collate(s, device) for s in per_mb], [s for mb in per_mb for s in mb]


def token_count(mbs: list) -> list[int]:
    return [int((mb["labels"] != IGNORE).sum()) for mb in mbs]


def loss_fn(model: nn.Module, mb: dict[str, torch.Tensor]) -> gradstep.LossSum:
    return gradstep.token_loss(model(mb["input_ids"]), mb["labels"])


def full_batch(model: nn.Module, seqs: list, device: Any) -> tuple[nn.Module, float]:
    """The plain way, in float64: one batch of every sequence, mean token loss, backward.
    Returns the reference copy (holding ``.grad``) and the loss."""
    ref = copy.deepcopy(model).to(device=device, dtype=torch.float64)
    batch = collate(seqs, device)
    logits = ref(batch["input_ids"])
    loss = nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), batch["labels"].reshape(-1), ignore_index=IGNORE
    )
    loss.backward()
    return ref, float(loss.detach())


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters()}


def rel_err(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """||got - want|| / ||want|| over all tensors together, in float64 on the CPU."""
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    g = torch.cat([got[n].detach().double().cpu().flatten() for n in want])
    w = torch.cat([t.detach().double().cpu().flatten() for t in want.values()])
    return float((g - w).norm() / w.norm())


@pytest.fixture(autouse=True)
def _ieee_fp32_matmuls():
    """TF32 matmuls (if something earlier in the process enabled them) carry a 10-bit
    significand: the float32 parity tolerance would then measure TF32, not the step."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(saved)


# ------------------------------------------------------------------ the exact step


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_three_micro_batches_equal_the_full_batch_on_cuda(dtype: torch.dtype, tol: float):
    """float64: only summation order is left (~1e-15). float32 against the float64
    reference: float32 rounding through a few layers is ~1e-7; 1e-5 leaves margin."""
    model = tiny_lm(dtype, DEVICE)
    mbs, seqs = make_window(LENGTHS, seed=1, device=DEVICE)
    counts = token_count(mbs)
    assert max(counts) >= 4 * min(counts)  # guard: token weighting is exercised
    ref, ref_loss = full_batch(model, seqs, DEVICE)
    # SGD with lr=0 keeps the parameters and leaves the gradient it was handed in .grad.
    stepper = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.0), clip=None)
    stats = stepper.step(mbs, loss_fn)
    got = grads_of(model)
    assert all(g.device.type == DEVICE.type and g.dtype == dtype for g in got.values())
    assert (stats.items, stats.micro_batches, stats.skipped) == (sum(counts), 3, False)
    assert rel_err(got, grads_of(ref)) <= tol
    assert stats.loss == pytest.approx(ref_loss, rel=tol)
    want_norm = float(torch.nn.utils.get_total_norm(list(grads_of(ref).values())))
    assert stats.grad_norm == pytest.approx(want_norm, rel=tol)


# ------------------------------------------------------------------ bf16 / fp16

# (parameter dtype, precision, tolerance vs float64). bf16 keeps 8 significand bits (unit
# roundoff 2^-9 ~ 2e-3) and rounds every activation, the logits and (bf16 parameters) the
# final gradient: 3-5e-3 measured with CPU autocast, so 2e-2 leaves 4x for other kernels.
# fp16 keeps 11 bits (roundoff 4.9e-4): 4.8e-4 measured, so 3e-3. The lower bound (1e-6,
# float32 gives ~1e-7) proves that the reduced precision really ran.
PRECISIONS = {
    "bf16-autocast": (torch.float32, "bf16", 2e-2),
    "bf16-params-fp32-buffers": (torch.bfloat16, "bf16", 2e-2),
    "fp16-autocast-gradscaler": (torch.float32, "fp16", 3e-3),
}


@pytest.mark.parametrize("case", list(PRECISIONS))
def test_mixed_precision_gradient_close_to_float64_on_cuda(case: str):
    dtype, precision, tol = PRECISIONS[case]
    model = tiny_lm(dtype, DEVICE)
    mbs, seqs = make_window(LENGTHS, seed=2, device=DEVICE)
    ref, _ = full_batch(model, seqs, DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # SGD: update = -lr * this gradient
    stepper = gradstep.Stepper(model, opt, clip=None, precision=precision)
    if dtype == torch.bfloat16:  # accum_dtype=None: float32 buffers for bf16 parameters
        assert stepper.accumulator is not None and stepper.accumulator.dtype == torch.float32
    for _ in range(20):  # GradScaler starts at 2^16 and may overflow first: skip, halve
        stats = stepper.step(mbs, loss_fn)
        if not stats.skipped:
            break
    assert not stats.skipped
    got = grads_of(model)
    assert all(g.dtype == dtype for g in got.values())  # bf16 params: rounded once, at the step
    assert 1e-6 < rel_err(got, grads_of(ref)) <= tol
    want_norm = float(torch.nn.utils.get_total_norm(list(grads_of(ref).values())))
    assert stats.grad_norm == pytest.approx(want_norm, rel=tol)


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Copies of every parameter and optimizer tensor, for bitwise comparisons (in parameter
    and key order: a loaded optimizer's per-parameter dicts may list their keys otherwise)."""
    tensors = _params(model)
    for p in model.parameters():
        state = opt.state.get(p, {})
        tensors += [state[k].detach().clone() for k in sorted(state) if torch.is_tensor(state[k])]
    return tensors


def _bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_fp16_overflow_skips_keeps_params_and_halves_the_scale_on_cuda():
    model = tiny_lm(torch.float32, DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stepper = gradstep.Stepper(model, opt, precision="fp16")
    mbs, _ = make_window(LENGTHS, seed=3, device=DEVICE)
    for _ in range(20):  # a taken step first: AdamW state exists, the scale has settled
        if not stepper.step(mbs, loss_fn).skipped:
            break
    assert stepper.step_count == 1
    scale, before, calls = stepper.loss_scale, _state(model, opt), []

    def overflow_in_second(model: nn.Module, mb: dict) -> gradstep.LossSum:
        out = loss_fn(model, mb)
        calls.append(1)
        return gradstep.LossSum(out.total * float("inf"), out.count) if len(calls) == 2 else out

    stats = stepper.step(mbs, overflow_in_second)
    assert stats.skipped and "non-finite" in stats.skip_reason
    assert stepper.loss_scale == scale * 0.5 and stepper.step_count == 1
    assert _bitwise_equal(_state(model, opt), before)
    assert all(p.grad is None for p in model.parameters())
    assert not stepper.step(mbs, loss_fn).skipped  # recovers at the lower scale


# ------------------------------------------------------------------ DDP / FSDP2 over NCCL

LR = 0.1


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the CPU (an FSDP2 DTensor shard is all-gathered first)."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def _rank_step(device: torch.device, rank: int, strategy: str, max_norm: float) -> dict:
    """One clipped SGD step on this rank's share of the data (float64: NCCL reduces
    doubles natively, so the comparison measures the step, not float32 rounding)."""
    import gradstep.parallel as gd

    model = gd.prepare_model(tiny_lm(torch.float64, device), strategy)
    stepper = gradstep.Stepper(
        model, torch.optim.SGD(model.parameters(), lr=LR), clip=gradstep.ClipNorm(max_norm)
    )
    before = {n.removeprefix("module."): _full(p) for n, p in model.named_parameters()}
    mbs, _ = make_window(RANK_LENGTHS[rank], seed=10 + rank, device=device)
    stats = stepper.step(mbs, loss_fn)
    named = [(n.removeprefix("module."), p) for n, p in model.named_parameters()]
    return {
        "stats": stats,
        "strategy": stepper.strategy.name,
        "grad_devices": {p.grad.device.type for _, p in named},
        "grads": {n: _full(p.grad) for n, p in named},
        "update": {n: _full(p) - before[n] for n, p in named},
    }


def _rank_main(rank: int, port: int, out: str, device: str, backend: str, job: tuple) -> None:
    # The variables torchrun sets; gradstep.parallel.init() reads them.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
    import gradstep.parallel as gd

    env = gd.init(device=device, backend=backend, timeout_s=60)
    try:
        result = _rank_step(env.device, rank, *job)
        result["backend"] = env.backend
    except BaseException:
        result = {"error": traceback.format_exc()}
    torch.save(result, Path(out, f"rank{rank}.pt"))
    # On an error the peer may never reach the barrier: leave without it.
    gd.shutdown(barrier="error" not in result)


def run_two_ranks(strategy: str, max_norm: float, timeout: float = 240) -> list[dict]:
    """Spawn 2 ranks (spawn: a forked CUDA context is unusable); kill them on a hang."""
    with tempfile.TemporaryDirectory() as out:
        args = (free_port(), out, DEVICE.type, BACKEND, (strategy, max_norm))
        ctx = mp.start_processes(_rank_main, args=args, nprocs=2, join=False, start_method="spawn")
        failure = join_or_kill(ctx, timeout)
        files = [Path(out, f"rank{r}.pt") for r in range(2)]
        results = [torch.load(f, weights_only=False) if f.exists() else None for f in files]
    for r, res in enumerate(results):  # a rank's own traceback is the root cause
        if isinstance(res, dict) and "error" in res:
            raise RuntimeError(f"rank {r} failed:\n{res['error']}")
    if failure is not None or None in results:
        raise RuntimeError(failure or "a rank wrote no result")
    return results


def _reference() -> dict[str, Any]:
    """Single process, float64, CPU: all ranks' sequences in one batch, mean token loss,
    torch's clip_grad_norm_ at half the norm (so the clip acts), one SGD step."""
    seqs = [s for r in range(2) for s in make_window(RANK_LENGTHS[r], 10 + r, "cpu")[1]]
    init = tiny_lm(torch.float64, "cpu")
    ref, loss = full_batch(init, seqs, "cpu")
    params = list(ref.parameters())
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in params]))
    torch.nn.utils.clip_grad_norm_(params, norm / 2)
    torch.optim.SGD(params, lr=LR).step()
    start = dict(init.named_parameters())
    return {
        "loss": loss,
        "items": sum(int((y != IGNORE).sum()) for _, y in seqs),
        "norm": norm,
        "grads": grads_of(ref),
        "update": {n: (p - start[n]).detach() for n, p in ref.named_parameters()},
    }


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_over_nccl_equal_the_single_process_full_batch(strategy: str):
    """float64 end to end; what is left is summation order (the gloo CPU suite measures
    ~5e-15), so 1e-10 catches any normalisation or clip mistake with a wide margin."""
    counts = [
        sum(token_count(make_window(r, 10 + i, "cpu")[0])) for i, r in enumerate(RANK_LENGTHS)
    ]
    assert counts[1] >= 3 * counts[0]  # guard: a mean over ranks of means would be wrong
    ref = _reference()
    max_norm = ref["norm"] / 2
    for rank, res in enumerate(run_two_ranks(strategy, max_norm)):
        where, stats = f"{strategy} rank {rank}", res["stats"]
        got = (res["backend"], res["strategy"], res["grad_devices"])
        assert got == (BACKEND, strategy, {DEVICE.type}), where
        assert stats.items == ref["items"] and not stats.skipped, where
        assert stats.loss == pytest.approx(ref["loss"], rel=1e-10), where
        assert stats.grad_norm == pytest.approx(ref["norm"], rel=1e-10), where
        assert stats.clipped, where
        assert stats.clip_coef == pytest.approx(max_norm / (ref["norm"] + 1e-6), rel=1e-10)
        assert rel_err(res["grads"], ref["grads"]) <= 1e-10, where
        assert rel_err(res["update"], ref["update"]) <= 1e-10, where


# ------------------------------------------------------------------ checkpoint round trip


def _build_run(precision: str, seed: int) -> dict[str, Any]:
    """Model (with dropout, so the restored CUDA RNG matters), AdamW and Stepper on CUDA."""
    model = tiny_lm(torch.float32, DEVICE, seed=seed, dropout=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stepper = gradstep.Stepper(model, optimizer, clip=gradstep.ClipNorm(0.5), precision=precision)
    return {"model": model, "optimizer": optimizer, "stepper": stepper}


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_checkpoint_round_trip_on_cuda_is_bitwise(tmp_path: Path, precision: str):
    """2 steps, save, 2 steps == fresh objects (other weights, other RNG), load, the same
    2 steps: parameters, AdamW state, Stepper state (fp16: the CUDA GradScaler) bitwise."""
    windows = [make_window(LENGTHS, seed=20 + i, device=DEVICE)[0] for i in range(4)]
    run = _build_run(precision, seed=0)
    for mbs in windows[:2]:
        run["stepper"].step(mbs, loss_fn)
    gradstep.Checkpointer(tmp_path).save(2, **run)
    saved = _params(run["model"])
    for mbs in windows[2:]:
        run["stepper"].step(mbs, loss_fn)
    expected = _state(run["model"], run["optimizer"])

    fresh = _build_run(precision, seed=1)  # also reseeds the CUDA RNG: the load must restore it
    assert not _bitwise_equal(_params(fresh["model"]), saved)
    assert gradstep.Checkpointer(tmp_path).load_latest(**fresh) == 2
    assert _bitwise_equal(_params(fresh["model"]), saved)
    assert all(p.device.type == DEVICE.type for p in fresh["model"].parameters())
    for mbs in windows[2:]:
        fresh["stepper"].step(mbs, loss_fn)
    assert _bitwise_equal(_state(fresh["model"], fresh["optimizer"]), expected)
    assert fresh["stepper"].state_dict() == run["stepper"].state_dict()
