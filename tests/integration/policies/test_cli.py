"""The tests of tests/policies/test_cli.py that start processes or run the CLI end to end; its
other tests stay there.
"""

from __future__ import annotations

import json

from tests.policies.test_cli import TINY_TRAIN


def test_cli_adaptive_clip_and_spike_guard_reach_metrics(tmp_path):
    from gradstep_cli.cli import main

    out = tmp_path / "run"
    argv = [*TINY_TRAIN, "--max-steps", "3", "--clip", "zclip:2", "--spike-guard"]
    assert main([*argv, "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for row in rows:
        assert [p["name"] for p in row["policies"]] == ["SpikeGuard", "ZClip"]
        assert all({"threshold", "acted"} <= set(p) for p in row["policies"])
    config = json.loads((out / "config.json").read_text())
    assert config["clip"] == "zclip:2" and config["spike_guard"] is True
