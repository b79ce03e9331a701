"""How long a plan's step takes, relative to the other candidates: from the shapes and the
data's row lengths, never from timings (:func:`row_time`, :func:`step_time_model`).

A planner that ranks candidates by timed probe steps chooses differently from one process
to the next: on a shared CPU the same step's time moves by more than the candidates differ
(2x between runs on the 2-core test machine, CPU time included), so ``gradstep plan`` and
``train --micro-batch-size auto`` could not agree. What separates the candidates is
countable instead:

* **padding.** A micro-batch is padded to its longest row, so ``m`` rows of a
  variable-length stream cost ``m x E[longest of m rows]`` positions
  (:func:`expected_longest`, exact from the lengths' distribution). Packed rows are all
  ``--seq-len`` long (``lengths=None``): no padding, and every size costs the same per row.
* **work per position**: ``2 x`` the matmul weights a token meets per forward (x3 with
  backward; x2 for frozen weights, which compute no weight gradient) and causal
  attention's ``2 x L x width x W`` for a row of ``W`` positions.
* **the loss**: from the whole logits, the head projects every position, padding included
  (``6 V d`` per position); chunked (``gradstep.step.chunked_token_loss``), only the
  positions that train (``trained``: their share of the real tokens; a prompt's do not),
  each twice forward (``8 V d``, or ``6 V d`` through a frozen head: backward recomputes
  each chunk's logits).
* **the softmax**: per logit element, the log-softmax, its gradient and the allocations
  around them (:data:`LOGIT_FLOPS`), over every position from the whole logits and over
  the trained positions chunked. Not a matmul's flops but memory traffic at the matmul's
  rate: on CPU ~1000 flops' worth an element, which outweighs the projection's ``6 d``
  below a width of ~170 (a width-64 head at a 128k vocabulary is three quarters softmax).
* **checkpointing** recomputes the blocks' forward: :data:`RECOMPUTE` forwards' worth (more
  than one: the recomputed forward's memory-bound operations, hooks and allocations), its
  math and its share of the fixed cost.
* **a fixed cost per micro-batch** (dispatch, Python, allocator): :data:`OVERHEAD_FLOPS`
  per block, in flops of the same device.

The constants were calibrated on CPU (torch 2.13, one thread, the demo GPT and a small
Llama, a one-off sweep not kept as a script; bench/planner.py measures the choices they
lead to); on CUDA the fixed cost per micro-batch is larger relative to the math
(:data:`OVERHEAD_FLOPS` has a value per device type, the CUDA one not calibrated).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .hf_shape import HFShape
from .shape import Shape

__all__ = [
    "LOGIT_FLOPS",
    "OVERHEAD_FLOPS",
    "RECOMPUTE",
    "expected_longest",
    "row_time",
    "step_time_model",
]

RECOMPUTE = 1.5
"""Checkpointing's recomputed forward, in forwards (flops) of the blocks. Calibrated on CPU,
torch 2.13: a checkpointed step took 1.45x (demo GPT) to 1.6x (HF Llama) the plain step's
time, where flops alone say 1.33x."""

LOGIT_FLOPS = {"cpu": (1060.0, 875.0), "cuda": (2000.0, 1800.0)}
"""(from the whole logits, chunked): what one logit element costs beyond its matmul
(log-softmax forward and backward, the loss's gather and the gradient's scatter,
allocating and faulting in the tensors), in flops of the device at its matmul rate. CPU:
fitted on the 2-core test machine, torch 2.13, one thread (``causal_lm`` head + loss
forward and backward, widths 32-256, vocabularies 32k and 128k: 11.0 and 9.4 ns an element
at 93-97 Gflop/s); the chunked loss never holds the whole tensors, so its passes stay
cheaper. CUDA: not calibrated (memory-bound passes at ~3 TB/s against ~2e14 flop/s)."""

OVERHEAD_FLOPS = {"cpu": 5.0e7, "cuda": 5.0e10}
"""A micro-batch's fixed cost per block (kernel dispatch, Python, autograd bookkeeping,
allocation), in flops of the device. CPU: calibrated on the 2-core test machine, torch
2.13, one thread (the one-off sweep above: ~2-5 ms per block's forward and backward at
~10-20 Gflop/s). CUDA: not calibrated (no GPU here): ~50 kernel launches of
~5 us per block against ~2e14 flop/s, so a GPU wants larger micro-batches."""


def expected_longest(lengths: np.ndarray, counts: np.ndarray, rows: int) -> float:
    """``E[max]`` of ``rows`` lengths drawn independently from the distribution of
    ``lengths`` (distinct, ascending) with ``counts``: the width a micro-batch of
    ``rows`` random rows is padded to."""
    cdf = np.cumsum(counts) / counts.sum()
    below = np.concatenate(([0.0], cdf[:-1]))
    return float(np.sum(lengths * (cdf**rows - below**rows)))


def _work(shape: Shape) -> tuple[float, float, float, float]:
    """(training flops per position of the blocks' matmuls, of attention per position and
    position of width, of the head per position, the blocks' forward share of the first)."""
    v, d = shape.vocab_size, shape.d_model
    if isinstance(shape, HFShape):
        base = shape.matmul_numel(part="base") - v * d
        adapters = shape.matmul_numel(part="adapters")
        frozen = shape.lora
        width = shape.q_width
    else:
        base, adapters, frozen, width = shape.matmul_numel() - v * d, 0, False, shape.d_model
    # Forward 2 flops per weight; backward 2 for the input's gradient, 2 for the weight's.
    body = 2 * base * (2 if frozen else 3) + 6 * adapters
    head_trains = not frozen or (isinstance(shape, HFShape) and shape.targeted("lm_head"))
    head = 2 * v * d * (3 if head_trains else 2)
    return body, 6.0 * shape.n_layer * width, head, 2.0 * (base + adapters)


def row_time(
    shape: Shape,
    device: str = "cpu",
) -> Callable[[int, float, float, bool, bool], float]:
    """``time(rows, width, trained, checkpointing, chunked)``: flops of one micro-batch of
    ``rows`` rows padded to ``width`` positions, ``trained`` of them targets, plus the
    fixed cost per micro-batch (the module docstring: what is counted)."""
    body, attention, head, forward = _work(shape)
    fixed = OVERHEAD_FLOPS.get(device, OVERHEAD_FLOPS["cuda"]) * (shape.n_layer + 1)
    whole, chunk = (shape.vocab_size * f for f in LOGIT_FLOPS.get(device, LOGIT_FLOPS["cuda"]))
    again = 2.0 * shape.vocab_size * shape.d_model

    def time(rows: int, width: float, trained: float, checkpointing: bool, chunked: bool) -> float:
        positions = rows * width
        blocks = positions * (body + attention * width)
        overhead = fixed
        if checkpointing:  # the recomputed forward: its math and its dispatch (a third)
            blocks += RECOMPUTE * positions * (forward + attention * width / 3)
            overhead *= 1 + RECOMPUTE / 3
        # Chunked: backward projects each chunk once more (2 v d), whether the head trains
        # (8 v d in all, not 6) or is frozen (6, not 4).
        loss = trained * (head + again + chunk) if chunked else positions * (head + whole)
        return overhead + blocks + loss

    return time


def step_time_model(
    shape: Shape,
    seq_len: int,
    lengths: Sequence[int] | None = None,
    counts: Sequence[int] | None = None,
    device: str = "cpu",
    trained: float = 1.0,
) -> Callable[[int, bool, int], float]:
    """``step_time(mbs, checkpointing, loss_chunk_tokens)`` for :func:`plan_step`: one
    micro-batch of ``mbs`` rows of the data (``lengths`` with ``counts``, each a row's
    positions; None: packed rows, all ``seq_len`` long; ``trained``: the share of real
    positions that are targets), in flops (relative: only the ranking of candidates is
    meant)."""
    time = row_time(shape, device)
    if lengths is None:
        values = np.array([seq_len], dtype=np.float64)
        weights = np.array([1.0])
    else:
        values = np.asarray(lengths, dtype=np.float64)
        weights = np.ones_like(values) if counts is None else np.asarray(counts, np.float64)
        order = np.argsort(values)
        values, weights = values[order], weights[order]
    mean = float(np.sum(values * weights) / weights.sum())
    longest: dict[int, float] = {}

    def step_time(mbs: int, checkpointing: bool, loss_chunk_tokens: int = 0) -> float:
        if mbs not in longest:
            longest[mbs] = expected_longest(values, weights, mbs)
        width = longest[mbs]
        return time(mbs, width, mbs * mean * trained, checkpointing, bool(loss_chunk_tokens))

    return step_time
