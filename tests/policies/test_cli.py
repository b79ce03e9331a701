"""Adaptive policies through the command line: flags and TOML reach metrics.jsonl.

Most tests drive a one-parameter model whose gradient IS a chosen number: loss = w * g, so
the step's global norm is g, and with SGD(lr=1) the clipped gradient is visible as the
parameter change. Expected values are computed the plain way, in float64, from the
papers' formulas, independently of the implementation (``helpers.py``).
"""

from __future__ import annotations

from gradstep.policies import (
    SpikeGuard,
    clip_policies,
)

# ------------------------------------------------------------------ the CLI


TINY_TRAIN = [
    "train", "--n-layer", "1", "--n-head", "2", "--d-model", "32", "--seq-len", "32",
    "--micro-batch-size", "2", "--accum-steps", "2", "--eval-batches", "1",
    "--sample-tokens", "0", "--warmup", "1", "--eval-every", "0",
]  # fmt: skip


def test_cli_agc_excludes_the_output_layer_and_toml_spike_guard(tmp_path):
    from gradstep_cli.config.settings import resolve
    from gradstep_cli.models.gpt import GPT, GPTConfig

    toml = tmp_path / "c.toml"
    toml.write_text('clip = "agc:0.01"\nspike-guard = true\n')
    cfg = resolve(toml, spike_guard=None)
    assert cfg.clip == "agc:0.01" and cfg.spike_guard is True
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=8, max_seq_len=8))
    guard, agc = clip_policies(cfg.clip, cfg.spike_guard, model)
    assert isinstance(guard, SpikeGuard) and agc.exclude == {"embed.weight"}  # tied lm_head


def test_cli_rejects_a_bad_clip_spec(capsys):
    from gradstep_cli.cli import main

    assert main([*TINY_TRAIN, "--clip", "zclip:-1"]) == 2
    err = capsys.readouterr().err
    assert "clip" in err and "z_thresh" in err
