"""DistributedDataParallel: one all-reduce of the gradients, on the last micro-batch."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch import nn

from .base import ProcessGroupStrategy

__all__ = ["DDPStrategy"]


class DDPStrategy(ProcessGroupStrategy):
    """``no_sync`` must be entered before the forward pass, because DDP decides at forward
    time whether the coming backward reduces; the Stepper wraps forward and backward.
    """

    name = "ddp"

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self._check_group_size(model.process_group.size(), "the DDP process group")
        # DDP's forward broadcasts buffers (BatchNorm statistics) from rank 0 when there are
        # any: then the forward communicates, like FSDP2's.
        self.forward_communicates = bool(
            model.broadcast_buffers and any(True for _ in model.module.buffers())
        )
        self._hook_installed = False
        self._hook_refused = False  # the model has another comm hook (DDP allows one)
        self.recorder: Callable | None = None

    @staticmethod
    def detects(model: nn.Module) -> bool:
        from torch.nn.parallel import DistributedDataParallel

        return isinstance(model, DistributedDataParallel)

    @contextlib.contextmanager
    def micro_batch(self, micro_batch: Any, is_last: bool) -> Iterator[Any]:
        if is_last:
            yield micro_batch
        else:
            with self.model.no_sync():  # type: ignore[operator]
                yield micro_batch

    def discard_partial_grads(self) -> None:
        """Forget the backward DDP's reducer was told to expect.

        A forward run with sync on (the window's last micro-batch) arms the reducer for a
        reducing backward. When the window is dropped before that backward (out-of-memory
        on another rank), the armed reducer would all-reduce the next window's FIRST
        backward, under ``no_sync``, on this rank alone: the ranks' collectives no longer
        pair (gloo aborts on a size mismatch). Every rank drops the window together, so
        every rank resets here together; the reset also makes DDP rebuild its buckets at
        the next synchronised step, again on every rank alike.
        """
        reducer = getattr(self.model, "reducer", None)
        if reducer is not None:
            reducer._reset_state()  # torch has no public call for this (2.13)

    def final_grads(self, params: Sequence[nn.Parameter], record: Callable) -> Any:
        """``record(param, its reduced gradient)`` as each bucket's all-reduce completes,
        through a communication hook that is DDP's own average-and-all-reduce plus the
        record. None when the model already has another hook (DDP allows one)."""
        if self._hook_refused:
            return None
        if not self._hook_installed:
            try:
                self.model.register_comm_hook(self, _allreduce_and_record)
            except RuntimeError:
                self._hook_refused = True  # the norm is measured after backward
                return None
            self._hook_installed = True
        return self._recording(record)

    @contextlib.contextmanager
    def _recording(self, record: Callable) -> Iterator[None]:
        self.recorder = record
        try:
            yield
        finally:
            self.recorder = None


def _allreduce_and_record(strategy, bucket):  # type: ignore[no-untyped-def]
    # No annotations: DDP checks them against its own types, and this module's are strings.
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    future = allreduce_hook(strategy.model.process_group, bucket)
    record = strategy.recorder
    if record is None:
        return future

    def done(fut):  # type: ignore[no-untyped-def]
        reduced = fut.value()
        # The bucket is the concatenation of its parameters' gradients, in this order.
        offset = 0
        for param in bucket.parameters():
            n = param.numel()
            record(param, reduced[offset : offset + n])
            offset += n
        if offset != reduced.numel():  # a layout this code does not know: say so, loudly
            raise RuntimeError(
                f"DDP bucket {bucket.index()} holds {reduced.numel()} values, its parameters "
                f"{offset}; build the Stepper with norm_in_backward=False"
            )
        return reduced

    return future.then(done)
