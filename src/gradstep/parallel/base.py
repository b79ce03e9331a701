"""The strategy protocol: what the step asks of a parallel layout, and nothing more.

Every strategy implements the small core, :class:`Strategy`: the data-parallel ranks, how
the reduced gradient lies on them (``gradient_layout``), what the backend divided it by, a
context around each micro-batch (gradient sync on the last one only), two small
collectives over the data-parallel ranks, and how it recognises a model (``detects``).

Anything else is an optional capability, declared by implementing a small protocol and
read once, when a Stepper is built (:func:`capabilities`):

=========================  =====================================================  ==========
capability                 what it tells the step                                 built-ins
=========================  =====================================================  ==========
:class:`ModelParallel`     more ranks than the data-parallel ones must take        TP
                           every decision together (``agree_sum``)
:class:`ForwardCollectives` the forward runs collectives: window lengths are       DDP with
                           compared first, out-of-memory is agreed before each     buffers,
                           communicating module                                   FSDP2
:class:`BackendGradients`  gradients a failed window leaves outside ``.grad``;     DDP, FSDP2
                           the tensor autograd fills per micro-batch
:class:`ShardReplicas`     this rank's shards are copies of another's (HSDP)       FSDP2
:class:`SelfReducedNorm`   ``gradient_layout == "self_reduced"``: its own norm      TP
:class:`FinalGrads`        where a gradient becomes final (the norm in backward)  all but TP
:class:`RunsWindow`        the strategy runs the whole window itself (pipeline)   none
=========================  =====================================================  ==========

Item counts are summed over the data-parallel ranks only: ranks that hold no distinct data
(tensor peers) must not be counted twice. Every member, and which built-in implements it:
docs/reference/strategy.md; what a new strategy touches: docs/library/distributed.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from .._handles import removing
from .dtensor import to_local

__all__ = [
    "GRADIENT_LAYOUTS",
    "BackendGradients",
    "Capabilities",
    "FinalGrads",
    "ForwardCollectives",
    "ModelParallel",
    "ProcessGroupStrategy",
    "RunsWindow",
    "SelfReducedNorm",
    "ShardReplicas",
    "Strategy",
    "capabilities",
    "post_accumulate_hooks",
    "window_length_error",
]

GRADIENT_LAYOUTS = ("replicated", "dp_sharded", "self_reduced")
"""How the reduced gradient lies on the ranks, which says how its global norm is assembled
(:mod:`gradstep.step.norm`, the one place that does). ``replicated``: every rank holds all
of it (one process, DDP): the local norm is the global one. ``dp_sharded``: each rank holds
a disjoint shard over the data-parallel ranks (FSDP2): the p-th powers of the local norms
sum over them, in the step's one collective (a max for the inf-norm). ``self_reduced``: the
strategy's :class:`SelfReducedNorm` ``total_norm`` reduces it with collectives of its own."""


@runtime_checkable
class Strategy(Protocol):
    """The core every strategy implements."""

    name: str
    """Short name, as in ``prepare_model(model, strategy=...)`` ("none", "ddp", "fsdp")."""
    world_size: int
    """Data-parallel ranks: ranks that read different data (1 on a single process)."""
    distributed: bool
    """True when a backend reduces the gradients (DDP, FSDP2)."""
    gradient_layout: str
    """One of :data:`GRADIENT_LAYOUTS`."""

    @property
    def grad_divisor(self) -> float:
        """What the backend divided the summed gradients by (1 when it sums)."""
        ...

    def micro_batch(self, micro_batch: Any, is_last: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-batch's forward AND backward, entered before the forward;
        it yields the micro-batch to run (a context-parallel strategy yields this rank's
        part). ``is_last``: the gradients are synchronised in this backward (the window's
        last micro-batch, or every one with ``sync_each_micro_batch``)."""
        ...

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a small tensor over the data-parallel ranks (identity on one process)."""
        ...

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        """The maximum of a small tensor over the data-parallel ranks, in float64."""
        ...

    @staticmethod
    def detects(model: nn.Module) -> bool:
        """Whether ``model`` is wrapped for this strategy (``strategy_for`` asks each)."""
        ...


@runtime_checkable
class ModelParallel(Protocol):
    """Ranks beyond the data-parallel ones hold other parts of the model (tensor peers):
    decisions every rank must take together (window lengths, out-of-memory, a skip) are
    summed over all of them, not over the data-parallel ranks alone."""

    agree_ranks: int
    """Every rank of the job that takes the step's branches together."""

    def agree_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a small tensor over :attr:`agree_ranks`: for decisions, not for data."""
        ...


@runtime_checkable
class ForwardCollectives(Protocol):
    """The forward pass runs collectives (FSDP2 all-gathers, DDP broadcasting buffers):
    ranks with different window lengths would pair unrelated collectives and hang, so the
    lengths are compared before the first forward, and an out-of-memory on one rank is
    agreed before each communicating module's forward."""

    forward_communicates: bool
    """False when this model's forward happens not to communicate (DDP without buffers)."""

    def communicating_modules(self) -> list[nn.Module]:
        """Modules whose forward starts with a collective, in no particular order."""
        ...


@runtime_checkable
class BackendGradients(Protocol):
    """The backend keeps gradient state outside ``param.grad`` (FSDP2's unreduced
    accumulation, DDP's armed reducer) and computes on other tensors than the parameters."""

    def discard_partial_grads(self) -> None:
        """Forget what a failed window left in the backend (on every rank together)."""
        ...

    def hook_targets(
        self, named: Sequence[tuple[str, nn.Parameter]]
    ) -> list[tuple[str, nn.Parameter, torch.Tensor]]:
        """(name, parameter, tensor whose autograd gradient is that parameter's micro-batch
        gradient): the parameter itself, except where the backend computes on a copy."""
        ...


@runtime_checkable
class ShardReplicas(Protocol):
    """Some ranks hold copies of other ranks' shards (HSDP's replicate dimension)."""

    norm_weight: float
    """1, or 0 on a rank whose shards are copies: what its ``norm**p`` counts for in a
    ``dp_sharded`` sum."""


@runtime_checkable
class SelfReducedNorm(Protocol):
    """A ``self_reduced`` gradient layout: the strategy reduces the norm itself."""

    def total_norm(self, grads: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
        """Norm of all gradients on all ranks, counting each element once, on every rank."""
        ...


@runtime_checkable
class FinalGrads(Protocol):
    """A strategy that knows where each gradient becomes final in the last backward."""

    def final_grads(
        self, params: Sequence[nn.Parameter], record: Callable[[nn.Parameter, torch.Tensor], None]
    ) -> contextlib.AbstractContextManager[None] | None:
        """A context for the last micro-batch's backward that calls ``record(param, this
        rank's part of its final gradient)``; None when it cannot on this model."""
        ...


@runtime_checkable
class RunsWindow(Protocol):
    """A strategy that runs the whole window itself (a pipeline schedule): instead of the
    step's micro-batch loop, ``run_window(loop, micro_batches, tally, loss_fn, final)``
    runs ``loop.one(index, micro_batch, is_last, loss_fn, tally, final if is_last else
    NULL)`` for every micro-batch, in the order its schedule needs (the loop's contexts,
    the tally and the backward stay the step's; ``is_last`` marks the one backward that
    synchronises gradients)."""

    def run_window(
        self, loop: Any, micro_batches: Any, tally: Any, loss_fn: Any, final: Any
    ) -> None: ...


@dataclass(frozen=True)
class Capabilities:
    """A strategy's optional capabilities, resolved once, with the defaults of a strategy
    that lacks them (a plain data-parallel one)."""

    agree_ranks: int
    agree_sum: Callable[[torch.Tensor], torch.Tensor]
    forward_communicates: bool
    check_window: Callable[[int], None]
    """Raise on every rank unless every rank passes ``n`` micro-batches (one collective
    over the agreeing ranks; nothing on one process)."""
    communicating_modules: Callable[[], list[nn.Module]]
    discard_partial_grads: Callable[[], None]
    hook_targets: Callable[..., list[tuple[str, nn.Parameter, torch.Tensor]]]
    norm_weight: float
    total_norm: Callable[[Sequence[torch.Tensor], float], torch.Tensor] | None
    final_grads: Callable[..., Any] | None
    run_window: Callable[..., None] | None


def _no_window_check(n: int) -> None:
    return None


def _window_check(agree_sum: Callable, ranks: int) -> Callable[[int], None]:
    def check_window(n: int) -> None:
        local = torch.tensor([float(n), float(n * n)], dtype=torch.float64)
        n_sum, n2_sum = agree_sum(local).tolist()
        error = window_length_error(n, n_sum, n2_sum, ranks)
        if error is not None:
            raise error

    return check_window


def _nothing() -> None:
    return None


def _no_modules() -> list[nn.Module]:
    return []


def _own_params(named: Sequence[tuple[str, nn.Parameter]]) -> list[Any]:
    return [(n, p, p) for n, p in named]


def capabilities(strategy: Strategy) -> Capabilities:
    """What ``strategy`` declares beyond the core (see the module docs), checked."""
    if strategy.gradient_layout not in GRADIENT_LAYOUTS:
        raise ValueError(
            f"{type(strategy).__name__}.gradient_layout must be one of {GRADIENT_LAYOUTS}, "
            f"got {strategy.gradient_layout!r}"
        )
    reduces = isinstance(strategy, SelfReducedNorm)
    if strategy.gradient_layout == "self_reduced" and not reduces:
        raise TypeError(
            f"{type(strategy).__name__} declares gradient_layout 'self_reduced' and must "
            "then implement total_norm(grads, norm_type) (SelfReducedNorm)"
        )
    parallel = isinstance(strategy, ModelParallel)
    forward = isinstance(strategy, ForwardCollectives) and strategy.forward_communicates
    backend = isinstance(strategy, BackendGradients)
    agree_ranks = strategy.agree_ranks if parallel else strategy.world_size
    agree_sum = strategy.agree_sum if parallel else strategy.all_reduce_sum
    return Capabilities(
        agree_ranks=agree_ranks,
        agree_sum=agree_sum,
        forward_communicates=forward,
        check_window=_window_check(agree_sum, agree_ranks) if agree_ranks > 1 else _no_window_check,
        communicating_modules=(
            strategy.communicating_modules if forward else _no_modules  # type: ignore[attr-defined]
        ),
        discard_partial_grads=strategy.discard_partial_grads if backend else _nothing,
        hook_targets=strategy.hook_targets if backend else _own_params,
        norm_weight=strategy.norm_weight if isinstance(strategy, ShardReplicas) else 1.0,
        total_norm=strategy.total_norm if reduces else None,
        final_grads=strategy.final_grads if isinstance(strategy, FinalGrads) else None,
        run_window=strategy.run_window if isinstance(strategy, RunsWindow) else None,
    )


def post_accumulate_hooks(
    params: Sequence[nn.Parameter], record: Callable[[Any, torch.Tensor], None]
) -> contextlib.AbstractContextManager[None]:
    """``record(param, local part of param.grad)`` each time autograd (or FSDP2, for a
    shard) has finished accumulating a parameter's gradient; nothing stays registered
    after the ``with`` block."""
    return removing(
        p.register_post_accumulate_grad_hook(lambda p: record(p, to_local(p.grad))) for p in params
    )


def window_length_error(n: int, n_sum: float, n2_sum: float, world: int) -> RuntimeError | None:
    """The error for ranks whose windows differ, from sums over ranks of n and n^2.

    All n equal <=> world * sum(n^2) == sum(n)^2 (Cauchy-Schwarz), so one sum-reduction of
    two numbers tells every rank the same thing.
    """
    if n2_sum * world == n_sum * n_sum:
        return None
    return RuntimeError(
        f"ranks ran windows of different lengths (this rank: {n} micro-batches, mean over "
        f"{world} ranks: {n_sum / world:g}); every rank must pass the same number of "
        "micro-batches to Stepper.step"
    )


class ProcessGroupStrategy:
    """What every strategy on a process group shares: the group, its size, the collectives.

    ``dp_group`` None means the default group: pure data parallelism over every rank. It
    implements :class:`ModelParallel` (over the whole default group) and
    :class:`BackendGradients` (nothing held, the parameters themselves) for its subclasses.
    """

    name = "group"
    distributed = True
    gradient_layout = "replicated"
    model_parallel = False
    """True in a subclass whose ``dp_group`` is smaller than the world on purpose (the other
    ranks hold other parts of the model, not other data)."""

    def __init__(self, dp_group: Any = None) -> None:
        from ..errors import UnsupportedSetup
        from . import collectives

        if not collectives.is_initialized():
            raise RuntimeError(
                "a DDP/FSDP model was given but torch.distributed is not initialised; "
                "call gradstep.parallel.init() (or dist.init_process_group) first"
            )
        import torch.distributed as dist

        self.dp_group = dp_group
        self.world_size = dist.get_world_size(dp_group)
        self.agree_ranks = dist.get_world_size()
        if self.world_size != self.agree_ranks and not self.model_parallel:
            raise UnsupportedSetup(
                f"dp_group spans {self.world_size} of {dist.get_world_size()} ranks; the "
                "built-in strategies are data parallel over the whole default group, except "
                "FSDP2TPStrategy (a model-parallel strategy sets model_parallel = True and "
                "reduces its norm over the other ranks itself)"
            )

    @staticmethod
    def detects(model: nn.Module) -> bool:
        return False  # a base class: its subclasses say what they wrap

    @property
    def grad_divisor(self) -> float:
        return float(self.world_size)

    @contextlib.contextmanager
    def micro_batch(self, micro_batch: Any, is_last: bool) -> Iterator[Any]:
        yield micro_batch

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        from .collectives import all_reduce_sum

        return all_reduce_sum(t, self.dp_group)

    def agree_sum(self, t: torch.Tensor) -> torch.Tensor:
        from .collectives import all_reduce_sum

        return all_reduce_sum(t, None)

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        """The maximum of a small tensor over the data-parallel ranks, as a float64 copy."""
        from .collectives import all_reduce_max

        return all_reduce_max(t, self.dp_group)

    def agree_max(self, t: torch.Tensor) -> torch.Tensor:
        """The maximum of a small tensor over :attr:`agree_ranks` (every rank), float64."""
        from .collectives import all_reduce_max

        return all_reduce_max(t, None)

    def discard_partial_grads(self) -> None:
        return None

    def hook_targets(
        self, named: Sequence[tuple[str, nn.Parameter]]
    ) -> list[tuple[str, nn.Parameter, torch.Tensor]]:
        return [(n, p, p) for n, p in named]

    def communicating_modules(self) -> list[nn.Module]:
        model = getattr(self, "model", None)
        return [model] if getattr(self, "forward_communicates", False) and model else []

    def _check_group_size(self, size: int, what: str) -> None:
        from ..errors import UnsupportedSetup

        if size != self.world_size:
            raise UnsupportedSetup(
                f"{what} spans {size} of {self.world_size} ranks; gradstep supports data "
                "parallelism over the whole default process group (DDP, FSDP2, HSDP) and "
                "FSDP2 + tensor parallel over a (dp_shard, tp) or (dp_replicate, dp_shard, tp) "
                "mesh; pipeline parallelism is not supported (docs/library/distributed.md)"
            )
