"""The gradient noise scale (McCandlish et al. 2018) measured for free by accumulation.

Each micro-batch is a small batch and each window a big one, so the two-batch estimator
needs no extra forward or backward: ``on_param_grad`` takes the squared norm of every
micro-batch's own gradient before it is summed into the accumulation (no full-size
buffer), ``on_norm`` the squared norm of the window's gradient over all ranks.

With per-item gradients of mean G and covariance Sigma, micro-batch i of n_i items has the
gradient SUM s_i (E|s_i|^2 = n_i^2 |G|^2 + n_i tr(Sigma)), and the window s = sum_i s_i of
N = sum_i n_i items. The cross terms s_i . s_j (i != j) have expectation n_i n_j |G|^2, so

    |G|^2     ~ (|s|^2 - sum_i |s_i|^2) / (N^2 - sum_i n_i^2)
    tr(Sigma) ~ (sum_i |s_i|^2 - sum_i n_i^2 |G|^2) / N

are unbiased for any micro-batch sizes; with equal sizes they are McCandlish et al.'s
B_small / B_big formulas (App. A.1). Their ratio is not unbiased, so each is smoothed by
its own bias-corrected EMA and ``b_simple`` is the ratio of the EMAs (as in gpt-neox and
AdaptDL). A window needs two non-empty micro-batches over all ranks to be measured.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ._validate import check_number
from .parallel.dtensor import counted, norm32, to_local
from .policies import GradientView

__all__ = ["GradientNoiseScale"]


class GradientNoiseScale:
    """A Stepper hook estimating the critical batch size: ``Stepper(..., hooks=[gns])``.

    Args:
        beta: EMA decay of the |G|^2 and tr(Sigma) estimates, in [0, 1). One window's
            estimate is noisy; 0.99 averages about 100 windows.

    Read after a step: ``b_simple`` (items, e.g. tokens: tr(Sigma)/|G|^2, None until it is
    measurable), ``grad_sq`` and ``trace_cov`` (the smoothed parts, per-item units),
    ``measured_steps`` and ``last`` (the raw estimates of the latest measured window).
    Reading them waits for the device; measuring does not.

    Works in every precision (squared norms in float32, the fp16 loss scale undone) and
    strategy (under FSDP2 the hook sees each rank's unsharded micro-batch gradient; with
    tensor parallelism on a (dp, tp) mesh each tensor-parallel peer's part of it, counted
    so that every micro-batch gradient is measured whole and once; the sums are
    all-reduced in one collective per step). A step the Stepper skips (non-finite
    gradient, a policy's skip) is not measured. Saved and restored with
    ``Stepper.state_dict()``.
    """

    def __init__(self, beta: float = 0.99) -> None:
        self.beta = check_number("beta", beta, "GradientNoiseScale", high=1.0, error=ValueError)
        self._ema = torch.zeros(3, dtype=torch.float64)  # |G|^2, tr(Sigma), weight sum
        self._measured = torch.zeros((), dtype=torch.float64)
        self._last = torch.full((2,), math.nan, dtype=torch.float64)
        self._reset_window()

    # ------------------------------------------------------------------ hook points
    def on_step_start(self, stepper: Any) -> None:
        self._reset_window()

    def on_param_grad(
        self, stepper: Any, index: int, name: str, param: nn.Parameter, grad: torch.Tensor
    ) -> None:
        self._norms.append(_counted_square(grad, _peers(stepper)))

    def on_micro_batch_end(self, stepper: Any, index: int, is_last: bool, loss: Any) -> None:
        if self._norms:
            sq = torch.stack(self._norms).sum()
            self._sq_sum = self._sq_sum + sq / stepper.loss_scale_factor**2
        self._norms = []
        n = torch.as_tensor(loss.count, dtype=torch.float64)
        self._n_sum = self._n_sum + n
        self._n_sq_sum = self._n_sq_sum + n * n

    def on_norm(self, stepper: Any, view: GradientView) -> None:
        grads = view.raw_grads()
        dev = grads[0].device if grads else torch.device("cpu")
        sums = (self._sq_sum, self._n_sq_sum, self._n_sum)
        local = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=dev) for v in sums])
        # Over every rank: the squares count each micro-batch gradient once (see
        # _counted_square); the sizes ``peers`` times: tensor-parallel peers share them.
        caps, peers = stepper.capabilities, _peers(stepper)
        shared = torch.tensor([1.0, peers, peers], dtype=torch.float64, device=dev)
        sq_sum, n_sq_sum, n = (caps.agree_sum(local) / shared).unbind()
        window_sq = (n * view.total_norm(2.0)) ** 2  # |s|^2: the window's gradient sum
        denom = n * n - n_sq_sum
        grad_sq = (window_sq - sq_sum) / denom
        trace = (sq_sum - n_sq_sum * grad_sq) / n
        # No estimate from a window of one non-empty micro-batch: a 0 weight.
        self._pending = torch.stack([grad_sq, trace, (denom > 0).double()]).nan_to_num(0.0)

    def on_step_end(self, stepper: Any, stats: Any) -> None:
        pending, self._pending = self._pending, None
        if pending is None or stats.skipped:
            return
        if self._ema.device != pending.device:  # once: the state follows the gradients
            self._ema, self._measured, self._last = (
                t.to(pending.device) for t in (self._ema, self._measured, self._last)
            )
        valid = pending[2]
        decay = 1 - valid * (1 - self.beta)  # 1 (no change) when the window was unmeasurable
        update = torch.stack([pending[0], pending[1], torch.ones_like(valid)])
        self._ema = self._ema * decay + (1 - decay) * update
        self._measured = self._measured + valid
        self._last = torch.where(valid > 0, pending[:2], self._last)

    # ------------------------------------------------------------------ results
    @property
    def measured_steps(self) -> int:
        """Windows that contributed an estimate."""
        return int(self._measured)

    @property
    def grad_sq(self) -> float | None:
        """Smoothed |G|^2, the squared norm of the true per-item gradient (None: unmeasured)."""
        return self._smoothed(0)

    @property
    def trace_cov(self) -> float | None:
        """Smoothed tr(Sigma), the per-item gradient variance summed over parameters."""
        return self._smoothed(1)

    @property
    def b_simple(self) -> float | None:
        """tr(Sigma) / |G|^2 in items: the batch size above which larger batches stop
        paying (McCandlish et al.'s B_simple). None until a window was measured, and while
        the smoothed |G|^2 is not positive (the noise hides the signal entirely)."""
        g, s = self.grad_sq, self.trace_cov
        if g is None or s is None or g <= 0:
            return None
        return s / g

    @property
    def last(self) -> dict[str, float]:
        """The latest measured window's raw (unsmoothed) estimates."""
        g, s = self._last.tolist()
        return {"grad_sq": g, "trace_cov": s}

    def _smoothed(self, i: int) -> float | None:
        ema = self._ema.tolist()
        if ema[2] <= 0:  # the bias correction: the EMA's weight on real estimates
            return None
        return ema[i] / ema[2]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "beta": self.beta,
            "ema": self._ema.tolist(),
            "measured": float(self._measured),
            "last": self._last.tolist(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if float(state["beta"]) != self.beta:
            raise ValueError(
                f"GradientNoiseScale: the state was saved with beta={state['beta']}, this "
                f"hook has beta={self.beta}; build it with the saved beta to resume"
            )
        self._ema = torch.tensor(state["ema"], dtype=torch.float64)
        self._measured = torch.tensor(float(state["measured"]), dtype=torch.float64)
        self._last = torch.tensor(state["last"], dtype=torch.float64)

    def __repr__(self) -> str:
        return f"GradientNoiseScale(beta={self.beta})"

    def _reset_window(self) -> None:
        self._norms: list[torch.Tensor] = []
        self._sq_sum: Any = 0.0
        self._n_sum: Any = 0.0
        self._n_sq_sum: Any = 0.0
        self._pending: torch.Tensor | None = None


def _peers(stepper: Any) -> int:
    """The ranks that share one micro-batch: 1, or the tensor-parallel peers of a data rank
    (every rank over the data-parallel ones)."""
    return stepper.capabilities.agree_ranks // stepper.world_size


def _counted_square(grad: torch.Tensor, peers: int) -> torch.Tensor:
    """This rank's share of the squared norm of one micro-batch gradient (float64), such
    that the shares summed over every rank are the sum over the data-parallel ranks of the
    whole gradients' squared norms.

    The ``peers`` ranks of a data rank (tensor-parallel peers: 1 without tensor parallel)
    hold one micro-batch gradient between them: a plain tensor (a parameter outside the
    tensor-parallel plan, or no tensor parallelism) is a whole copy on each of them; a
    DTensor on the tensor-parallel mesh is split over its ``Shard`` dims and copied along
    its ``Replicate`` dims. :func:`~gradstep.parallel.dtensor.counted` weighs each part
    so that the peers count it once. A ``Partial`` one (a sequence-parallel norm's weight:
    each rank's part of a sum) is reduced first, a collective of its mesh inside the
    backward, which every peer runs at the same point of the same graph.
    """
    mesh = getattr(grad, "device_mesh", None)
    if mesh is not None:
        placements = tuple(grad.placements)  # type: ignore[attr-defined]
        if any(pl.is_partial() for pl in placements):
            from torch.distributed.tensor import Replicate

            whole = [Replicate() if pl.is_partial() else pl for pl in placements]
            grad = grad.redistribute(mesh, whole)  # type: ignore[attr-defined]
    weight = counted(grad, peers)
    if not weight:
        return torch.zeros((), dtype=torch.float64, device=to_local(grad).device)
    # At least float32, without a float32 copy of a half-precision gradient.
    return norm32(to_local(grad)).double().square() * weight
