"""``gradstep`` under torchrun with one rank that fails on purpose, for tests/parallel/
test_failures.py: ``python -m torch.distributed.run ... -m tests.parallel.failing_rank
train ...``.

``GRADSTEP_TEST_FAIL`` says how rank ``GRADSTEP_TEST_FAIL_RANK`` (default 1) fails when it
enters its ``GRADSTEP_TEST_FAIL_AT``-th optimizer step (default 2), so the other ranks are
already inside that step's collectives:

- ``sleep``: it never joins them (a stuck rank: deadlocked, paused, far slower); torchrun's
  SIGTERM ends it once the others have left;
- ``exit``: it leaves at once without closing anything (a rank that died; exit status 0,
  so torchrun does not stop the others before they notice).

Everything else is the real CLI (``gradstep_cli.cli.main``).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import gradstep
from gradstep_cli.cli import main


def _fail(how: str) -> None:
    if how == "sleep":
        time.sleep(3600)
    elif how == "exit":
        os._exit(0)  # no cleanup, no goodbye to the peers: as if the process died
    else:
        raise ValueError(f"GRADSTEP_TEST_FAIL must be sleep or exit, got {how!r}")


def _install(how: str, at: int) -> None:
    original = gradstep.Stepper.step
    calls = [0]

    def step(self: gradstep.Stepper, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == at:
            _fail(how)
        return original(self, *args, **kwargs)

    gradstep.Stepper.step = step  # type: ignore[method-assign]


if __name__ == "__main__":
    how = os.environ.get("GRADSTEP_TEST_FAIL", "")
    if how and os.environ.get("RANK") == os.environ.get("GRADSTEP_TEST_FAIL_RANK", "1"):
        _install(how, int(os.environ.get("GRADSTEP_TEST_FAIL_AT", "2")))
    sys.exit(main(sys.argv[1:]))
