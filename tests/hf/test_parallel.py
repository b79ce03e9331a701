"""HF models on 2 gloo ranks (DDP, FSDP2) equal one process running the whole window, and a
PEFT adapter-only checkpoint saved through DCP on 2 ranks resumes bitwise.

Float64 models, 3 AdamW + ClipNorm steps: the ranks differ from one process only in the
order gradients are summed, so parameters agree to 1e-10 relative (to the distance moved).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from tests.hf.helpers import window_seqs  # noqa: E402
from tests.hf.hf_ranks import single, strategies  # noqa: E402
from tests.support.multiproc import run_ranks  # noqa: E402

TOL = 1e-10


def _moved_rel(got: dict, want: dict, start: dict) -> float:
    diff = sum(float((got[k] - want[k]).square().sum()) for k in want)
    moved = sum(float((want[k] - start[k]).square().sum()) for k in want)
    return (diff / moved) ** 0.5


@pytest.mark.distributed
def test_ddp_fsdp2_and_trainable_only_resume_on_two_ranks(tmp_path) -> None:
    gen = torch.Generator().manual_seed(9)
    windows = [window_seqs(gen, 4) for _ in range(4)]  # 2 micro-batches per rank
    want = single(windows)
    from tests.hf.helpers import llama, lora

    start = {n: p.detach().clone() for n, p in llama(dtype=torch.float64).named_parameters()}
    peft_start = {
        n: p.detach().clone() for n, p in lora(llama(dtype=torch.float64)).named_parameters()
    }
    results = run_ranks(strategies, 2, windows, str(tmp_path), timeout=240)
    for res in results:
        for strategy in ("ddp", "fsdp"):
            got = res[strategy]
            assert _moved_rel(got["params"], want["params"], start) <= TOL, strategy
            assert got["norms"] == pytest.approx(want["norms"], rel=TOL)
        assert res["resume_bitwise"]
        keys = res["dcp_model_keys"]  # the DCP checkpoint holds the adapters only
        assert keys and all("lora_" in k for k in keys)
        got_peft, want_peft, start_peft = (
            {k: d[k] for k in peft_start if "lora_" in k}
            for d in (res["peft"], want["peft"], peft_start)
        )
        assert _moved_rel(got_peft, want_peft, start_peft) <= TOL
