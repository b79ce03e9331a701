"""AGC, ZClip and SpikeGuard under FSDP2 on 2 gloo ranks equal one process.

Most tests drive a one-parameter model whose gradient IS a chosen number: loss = w * g, so
the step's global norm is g, and with SGD(lr=1) the clipped gradient is visible as the
parameter change. Expected values are computed the plain way, in float64, from the
papers' formulas, independently of the implementation (``helpers.py``).
"""

from __future__ import annotations

import pytest
import torch

from tests.policies.helpers import fsdp_worker

# ------------------------------------------------------- FSDP2 (2 ranks, gloo)


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_agc_zclip_spike_guard_under_fsdp2_match_single_process():
    from tests.support.multiproc import run_ranks

    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    run_ranks(fsdp_worker, 2, timeout=75)
