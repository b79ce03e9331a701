"""parse_size / format_bytes: the units people write budgets in, and clear errors."""

import pytest

from gradstep.memory import format_bytes, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1.5GiB", 3 * 2**29),
        ("1.5gib", 3 * 2**29),
        ("800 MB", 800 * 10**6),
        ("512KiB", 512 * 1024),
        ("2kb", 2000),
        ("3GB", 3 * 10**9),
        ("1TiB", 2**40),
        ("100B", 100),
        (" .5 MiB ", 2**19),
        ("7.b", 7),
        (4096, 4096),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected
    assert isinstance(parse_size(text), int)


@pytest.mark.parametrize("text", ["8", "", "GiB", "-1GiB", "1.5 GiBs", "1e9B", "1,5GB", "1 G"])
def test_parse_size_rejects_with_units_listed(text):
    with pytest.raises(ValueError, match="memory budget") as err:
        parse_size(text)
    assert "KiB" in str(err.value) and "GB" in str(err.value)


@pytest.mark.parametrize("value", ["0GiB", "0.0000001B", 0, -5, True])
def test_parse_size_rejects_zero_and_non_sizes(value):
    with pytest.raises(ValueError, match="memory budget"):
        parse_size(value)


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (3 * 2**29, "1.50 GiB"),
        (5 * 2**20 + 2**19, "5.50 MiB"),
        (2**50, "1024.00 TiB"),
        (-(2**20), "-1.00 MiB"),
    ],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_round_trip():
    for text in ("1.25 GiB", "3.00 MiB", "999.50 KiB"):
        assert format_bytes(parse_size(text.replace(" ", ""))) == text


@pytest.mark.parametrize("text", ["1e30GiB", "4e8", "1E3MB", "2.5e-1GB"])
def test_exponents_are_refused_and_the_message_says_so(text):
    with pytest.raises(ValueError, match="exponents are not accepted") as err:
        parse_size(text)
    assert "GiB" in str(err.value)
