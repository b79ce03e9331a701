"""gradstep._validate, the one home of argument checks: each checker accepts exactly the
values its rule allows (a reference predicate written out plainly), and every refusal names
the owner and the parameter, says what is allowed and shows what was given."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gradstep._validate import check_choice, check_flag, check_number, check_params

BOUNDS = st.tuples(
    st.sampled_from([0.0, 1.0, -2.5]),  # low
    st.sampled_from([None, 1.0, 3.0, 100.0]),  # high (an offset above low), or none
    st.booleans(),  # above: low excluded
    st.booleans(),  # closed: high included
)
VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-5, 200),
    st.sampled_from([0.0, 1.0, -2.5, 3.5, 101.0, True, False, None, "1.0", [1.0]]),
)


def allowed(value: Any, low: float, high: float | None, above: bool, closed: bool) -> bool:
    """The rule, written out: a real number, not a bool, finite, within the bounds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if not math.isfinite(value) or value < low or (above and value == low):
        return False
    return high is None or value < high or (closed and value == high)


@given(bounds=BOUNDS, value=VALUES)
def test_check_number_accepts_exactly_what_the_rule_allows(bounds: tuple, value: Any) -> None:
    low, offset, above, closed = bounds
    high = None if offset is None else low + offset
    kwargs = dict(low=low, high=high, above=above, closed=closed)
    if allowed(value, low, high, above, closed):
        got = check_number("x", value, "Owner", **kwargs)
        assert type(got) is float and got == value
        return
    wrong_type = isinstance(value, bool) or not isinstance(value, (int, float))
    with pytest.raises(TypeError if wrong_type else ValueError) as caught:
        check_number("x", value, "Owner", **kwargs)
    message = str(caught.value)
    assert message.startswith("Owner: x must be ") and message.endswith(f", got {value!r}")
    shown = f"{low:g}" if high is None else f"{low:g}, {high:g}"
    assert shown in message
    with pytest.raises(KeyError, match=re.escape(message)):  # ``error`` replaces both types
        check_number("x", value, "Owner", error=KeyError, **kwargs)


def test_optional_numbers_and_flags_take_none_and_say_so() -> None:
    assert check_number("cap", None, "ZClip", above=True, optional=True) is None
    with pytest.raises(ValueError, match=r"^ZClip: cap must be a finite number > 0 or None"):
        check_number("cap", 0.0, "ZClip", above=True, optional=True)
    with pytest.raises(ValueError, match=r"must be a finite number >= 0, got None"):
        check_number("lr", None, "LAMB", error=ValueError)
    assert check_flag("foreach", None, "LARS", optional=True) is None
    assert check_flag("nesterov", True, "LARS") is True
    with pytest.raises(TypeError, match=r"^LARS: nesterov must be True or False, got 'yes'$"):
        check_flag("nesterov", "yes", "LARS")
    with pytest.raises(TypeError, match=r"must be True, False or None, got 1$"):
        check_flag("foreach", 1, "LARS", optional=True)


def test_check_choice_lists_the_names_in_order() -> None:
    assert check_choice("mode", "mean", ("zscore", "mean")) == "mean"
    with pytest.raises(ValueError, match=r"^ZClip: mode must be one of zscore, mean, got 'x'$"):
        check_choice("mode", "x", ("zscore", "mean"), "ZClip")


def test_check_params_copies_groups_and_refuses_no_parameter() -> None:
    w = torch.nn.Parameter(torch.ones(2))
    group = {"params": w, "lr": 0.1}
    (copied,) = check_params([group], "LAMB")
    assert copied == {"params": [w], "lr": 0.1} and group["params"] is w  # caller's intact
    assert check_params(iter([w]), "LAMB") == [w]
    with pytest.raises(ValueError, match="LAMB: params holds no parameter"):
        check_params([{"params": []}], "LAMB")
    with pytest.raises(TypeError, match="LARS: params must be an iterable .* got a Tensor"):
        check_params(w, "LARS")
