"""Deprecated name of :mod:`gradstep.parallel`, kept so existing scripts keep working.

``gradstep.distributed.init()``, ``prepare_model``, ``shutdown`` and the rest are the same
objects as in :mod:`gradstep.parallel`; new code should import from there.
"""

from __future__ import annotations

from .parallel import *  # noqa: F403
from .parallel import __all__ as _parallel_all
from .parallel.instrumentation import CommCounter, count_gradient_comms

__all__ = [*_parallel_all, "CommCounter", "count_gradient_comms"]
