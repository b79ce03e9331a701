"""``gradstep plan`` says how long it took and where; past 30 s it says why (issue 30 §4: the
walk's plan took 248 s on a loaded machine without a word)."""

from __future__ import annotations

from types import SimpleNamespace

from gradstep_cli.plan import planning


def planned(seconds: float, sizes: int = 3, shapes: int = 6):
    probe = SimpleNamespace(
        points=[(b, 0, 1.0) for b in (1, 2, 4)[:sizes]],
        warmup=(1, 0, 1.0),
        shapes_run=shapes,
        seconds_total=seconds,
    )
    return SimpleNamespace(probe=probe)


def test_a_plan_says_how_long_it_took(monkeypatch) -> None:
    line = planning.timing_line(planned(20.0), total=24.5, setup=3.0)
    assert line == (
        "planned in 24.5s: reading the data and the model 3.0s, probing 20.0s (10 training "
        "steps of the model: 3 sizes, 6 more input shapes)"
    )
    assert planning.timing_line(SimpleNamespace(probe=None), 1.5, 1.0).endswith(
        "the analytic estimate (no probe)"
    )


def test_a_plan_over_30_seconds_says_why(monkeypatch) -> None:
    monkeypatch.setattr(planning.os, "getloadavg", lambda: (9.5, 9.0, 8.0))
    monkeypatch.setattr(planning.os, "cpu_count", lambda: 2)
    line = planning.timing_line(planned(240.0), total=248.0, setup=6.0)
    assert "; over 30s: a probe step took 24.0s here, and the machine is loaded (9.5 " in line
    assert line.endswith(
        "--no-probe plans from the analytic estimate alone, without running a step"
    )
    slow_data = planning.timing_line(planned(10.0), total=70.0, setup=58.0)
    assert "over 30s: reading the data and the model took 58.0s" in slow_data
