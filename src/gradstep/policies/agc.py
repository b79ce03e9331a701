"""Adaptive Gradient Clipping (Brock et al. 2021, NFNets): unit-wise, against the weights."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from .._validate import check_choice, check_positive
from ..parallel import collectives
from ..parallel.dtensor import (
    ShardGroups,
    norm32,
    reduce_over_shards,
    shard_groups,
    sum_parts,
    to_local,
)
from .base import ClipResult, GradientView
from .registry import register

__all__ = ["AGC", "ZERO_WEIGHTS", "find_output_layer"]

ZERO_WEIGHTS = ("skip", "eps")


def _unit_groups(t: torch.Tensor) -> tuple[ShardGroups, ShardGroups]:
    """The process groups a matrix's per-row sums cross, and those its rows are spread over.

    A unit is a row (dim 0) of ``t``. A mesh dim that shards a dim >= 1 (tensor parallel's
    rowwise ``Shard(1)``) splits every row: a row's sum is reduced over it. One that shards
    dim 0 (FSDP2's ``Shard(0)``, ``_StridedShard(0)`` on a (dp, tp) mesh, colwise
    ``Shard(0)``) gives each rank whole rows: nothing to reduce for a row, but counts over
    rows (and whole-matrix sums of row sums) add up over it. ``Replicate`` dims are copies:
    neither. ``shard_groups`` refuses what is neither (``Partial``).
    """
    split = shard_groups(t)
    placements = [pl for pl in getattr(t, "placements", ()) if not pl.is_replicate()]
    within = tuple(g for g, pl in zip(split, placements, strict=True) if pl.dim >= 1)
    across = tuple(g for g, pl in zip(split, placements, strict=True) if pl.dim == 0)
    return within, across


def _row_squares(
    mats: Sequence[tuple[torch.Tensor, torch.Tensor, ShardGroups]],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per matrix, the squared norms of its rows' weights and gradients (local rows),
    reduced over the groups that split a row; one all-reduce per distinct layout, none when
    every row is whole on its rank (FSDP2, HSDP, colwise tensor parallel)."""
    parts = [
        norm32(x.flatten(1), dim=1).to(torch.float64).square() for w, g, _ in mats for x in (w, g)
    ]
    layouts = [within for _, _, within in mats for _ in (0, 1)]
    summed = sum_parts(parts, layouts)
    return list(zip(summed[0::2], summed[1::2], strict=True))


def _coef_from_norms(
    w_norm: torch.Tensor, g_norm: torch.Tensor, clipping: float, eps: float
) -> torch.Tensor:
    max_norm = clipping * w_norm.clamp_min(eps)
    # g_norm > max_norm > 0 where it is used, so the division is safe.
    return torch.where(g_norm > max_norm, max_norm / g_norm, torch.ones_like(g_norm))


def _unit_coefs(
    mats: Sequence[tuple[torch.Tensor, torch.Tensor, ShardGroups]], clipping: float, eps: float
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per matrix, each local row's factor min(1, clipping * max(||W_i||, eps) / ||G_i||)
    and its rows' squared weight norms."""
    if not any(within for _, _, within in mats):  # every row whole here: no collective
        w_rows = [norm32(w.flatten(1), dim=1) for w, _, _ in mats]
        g_rows = [norm32(g.flatten(1), dim=1) for _, g, _ in mats]
        coefs = [_coef_from_norms(w, g, clipping, eps) for w, g in zip(w_rows, g_rows, strict=True)]
        return coefs, [w.to(torch.float64).square() for w in w_rows]
    squares = _row_squares(mats)
    coefs = [_coef_from_norms(w.sqrt(), g.sqrt(), clipping, eps) for w, g in squares]
    return coefs, [w for w, _ in squares]


@torch.no_grad()
def _clip_unitwise(
    pairs: Sequence[tuple[nn.Parameter, torch.Tensor]],
    clipping: float,
    eps: float,
    skip_zero: bool = True,
) -> int:
    """Clip every unit in place; return how many units were clipped (on all ranks).

    ``skip_zero``: a matrix whose weights are all zero (a zero-initialised LoRA B) has no
    scale to clip against and is left unclipped. Whether a sharded matrix is all zero needs
    every shard, so its squared norm joins the one all-reduce of per-tensor sums.
    Sharded parameters (FSDP2, HSDP, tensor parallel on a 2-D mesh, on several meshes) are
    measured whole: see :func:`_unit_groups`. One host sync at the end (the count), so on a
    GPU the loop only queues kernels.
    """
    device = to_local(pairs[0][1]).device if pairs else torch.device("cpu")
    mats: list[tuple[torch.Tensor, torch.Tensor, ShardGroups]] = []
    mat_layouts: list[ShardGroups] = []
    whole: list[tuple[torch.Tensor, torch.Tensor]] = []
    whole_layouts: list[ShardGroups] = []
    for p, g in pairs:
        w, gl = to_local(p.detach()), to_local(g)
        if p.dim() > 1:
            within, across = _unit_groups(p)
            mats.append((w, gl, within))
            mat_layouts.append(across)
        else:
            whole.append((w, gl))
            whole_layouts.append(shard_groups(p))
    mat_coefs, w_rows = _unit_coefs(mats, clipping, eps)
    # One vector of per-tensor sums, reduced per layout: per matrix, sum w^2 and its
    # clipped units (over the groups spreading its rows); per whole tensor, sum w^2 and
    # sum g^2 (over every group sharding it).
    parts = [w.sum() for w in w_rows] + [(c < 1).sum().to(torch.float64) for c in mat_coefs]
    parts += [norm32(t).to(torch.float64).square() for wg in whole for t in wg]
    layouts = mat_layouts * 2 + [lay for lay in whole_layouts for _ in (0, 1)]
    stacked = torch.stack(parts) if parts else torch.zeros(0, dtype=torch.float64, device=device)
    stacked = reduce_over_shards(stacked, layouts)
    n = len(mats)
    mat_sq, mat_clipped, whole_sq = stacked[:n], stacked[n : 2 * n], stacked[2 * n :]
    keep = (mat_sq > 0) if skip_zero else torch.ones_like(mat_sq, dtype=torch.bool)
    count = (mat_clipped * keep).sum()
    for (_, gl, _), coef, kept in zip(mats, mat_coefs, keep, strict=True):
        coef = torch.where(kept, coef, torch.ones_like(coef))
        gl.mul_(coef.to(gl.dtype).view(-1, *([1] * (gl.dim() - 1))))
    if whole:
        norms = whole_sq.sqrt().view(-1, 2)
        coefs = _coef_from_norms(norms[:, 0], norms[:, 1], clipping, eps)
        count = count + (coefs < 1).sum()
        for (_, gl), c in zip(whole, coefs, strict=True):
            gl.mul_(c.to(gl.dtype))  # c == 1 leaves it unchanged; no sync to test it
    return int(count)


class AGC:
    """Adaptive Gradient Clipping (Brock et al. 2021, NFNets), unit-wise.

    For each unit i (row of a Linear weight, output channel of a conv, row of an embedding):
    if ||G_i|| / max(||W_i||, eps) > clipping, G_i <- clipping * max(||W_i||, eps) / ||G_i|| * G_i.
    Tensors with <= 1 dimension (biases, norm gains) are one unit. The paper does not clip
    the final classifier: pass its parameter names in ``exclude``, e.g.
    ``AGC(exclude=gradstep.find_output_layer(model))``. Names are checked against the
    model on the first step, so a typo fails instead of silently clipping everything.

    Works on plain, DDP, FSDP2 and HSDP models, on FSDP2 + tensor parallel (a (dp, tp)
    mesh, rowwise weights' rows split over tp, parameters outside the plan on the dp mesh
    alone), and on low-precision parameters whose gradients accumulate in fp32 buffers (it
    clips the buffers, before the single rounding), through ``GradientView.named_grads``.
    ``StepStats.policies`` reports ``threshold = clipping`` (a ratio, not a norm).

    ``zero_weights``: what to do with a matrix (>= 2 dims) whose weights are ALL zero, such
    as a zero-initialised LoRA B, where the ratio has no scale. ``"skip"`` (default): it is
    not clipped until it has moved away from zero (its first update is left to the
    optimizer and any global ClipNorm); clipping it against ``eps`` would cap every LoRA B
    row at ``clipping * eps`` (1e-5 by default) and stall the adapter under SGD. ``"eps"``:
    the paper's rule, ``max(||W_i||, eps)``, for those too. A zero row inside a non-zero
    matrix, and zero-initialised biases and gains (one unit each), always use ``eps``.
    """

    def __init__(
        self,
        clipping: float = 0.01,
        eps: float = 1e-3,
        exclude: Iterable[str] = (),
        zero_weights: str = "skip",
    ):
        self.clipping = check_positive("clipping", clipping, "AGC")
        self.eps = check_positive("eps", eps, "AGC")
        self.zero_weights = check_choice("zero_weights", zero_weights, ZERO_WEIGHTS, "AGC")
        exclude = exclude if isinstance(exclude, str) else list(exclude)  # a generator once
        if isinstance(exclude, str) or not all(isinstance(n, str) for n in exclude):
            raise TypeError(
                f"AGC: exclude must be a list of parameter names (str), got {exclude!r}"
            )
        self.exclude = frozenset(exclude)
        self.clipped_units = 0
        """Units clipped on the last step (over all ranks)."""

    def __repr__(self) -> str:
        return (
            f"AGC(clipping={self.clipping}, eps={self.eps}, exclude={sorted(self.exclude)}, "
            f"zero_weights={self.zero_weights!r})"
        )

    def clip(self, ctx: GradientView) -> ClipResult:
        unknown = self.exclude - {name for name, _ in ctx.params}
        if unknown:
            raise ValueError(
                f"AGC: exclude names {sorted(unknown)} are not trainable parameters of the "
                "model; use the names of model.named_parameters() (see find_output_layer)"
            )
        pairs = [(p, g) for name, p, g in ctx.named_grads() if name not in self.exclude]
        skip_zero = self.zero_weights == "skip"
        self.clipped_units = _clip_unitwise(pairs, self.clipping, self.eps, skip_zero)
        acted = self.clipped_units > 0
        return ClipResult(threshold=self.clipping, acted=acted)


def find_output_layer(model: nn.Module) -> list[str]:
    """Parameter names of the model's final classifier / output projection, for AGC.

    Looks for, in order: ``get_output_embeddings()`` (Hugging Face models),
    ``get_classifier()`` (timm models), else the last ``nn.Linear`` or conv layer in
    registration order (``lm_head``, ``fc``, ``classifier``). Names are those of
    ``model.named_parameters()`` as the Stepper sees them (a DDP wrapper's ``module.``
    prefix included); a weight tied to the input embedding is reported under its first
    name, e.g. ``embed.weight``, since it is one tensor with one gradient.

    Frozen parameters are left out (AGC only sees trainable ones): a PEFT model's frozen
    ``lm_head`` gives ``[]``. The layer is found first, then filtered, so a LoRA matrix is
    never taken for the output layer.
    """
    inner = collectives.unwrap(model)
    layer = None
    for getter in ("get_output_embeddings", "get_classifier"):
        found = getattr(inner, getter, None)
        found = found() if callable(found) else None
        if isinstance(found, nn.Module) and any(True for _ in found.parameters()):
            layer = found
            break
    if layer is None:
        kinds = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
        layers = [m for m in inner.modules() if isinstance(m, kinds)]
        if not layers:
            raise ValueError(
                "find_output_layer: the model has no Linear or Conv layer; pass AGC's exclude "
                "names explicitly"
            )
        layer = layers[-1]
    wanted = {id(p) for p in layer.parameters()}
    return [name for name, p in model.named_parameters() if id(p) in wanted and p.requires_grad]


register(
    "agc",
    AGC,
    lambda v: AGC() if v is None else AGC(clipping=v),
    arg="LAMBDA",
    help="AGC(clipping=LAMBDA), default 0.01; the demo excludes the output layer",
    order=50,
)
