import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw_cli.core.clusterfile.quantities import format_duration, format_size, parse_duration, parse_size


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90s", 90),
        ("10m", 600),
        ("1h", 3600),
        ("1h30m", 5400),
        ("250ms", 0.25),
        ("1d", 86400),
        ("1.5h", 5400),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["", "10", "10x", "m10", "1h-5m", "ten minutes"])
def test_parse_duration_refuses(bad: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(bad)


def test_bare_number_asks_for_a_unit() -> None:
    with pytest.raises(ValueError, match="has no unit: write 30s, 30m or 30h"):
        parse_duration(30)


@given(st.integers(min_value=0, max_value=10**7))
def test_duration_round_trip_whole_seconds(seconds: int) -> None:
    assert parse_duration(format_duration(seconds)) == seconds


def test_format_duration_is_compact() -> None:
    assert format_duration(5400) == "1h30m"
    assert format_duration(0.25) == "250ms"
    assert format_duration(0) == "0s"


@pytest.mark.parametrize(
    ("text", "size"),
    [("80GiB", 80 * 2**30), ("512MiB", 512 * 2**20), ("2TB", 2 * 10**12), ("1.5GiB", 3 * 2**29)],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["80", "80gb", "GiB", "-1GiB", 80])
def test_parse_size_refuses(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_size(bad)


@given(st.integers(min_value=0, max_value=2**50))
def test_size_round_trip(size: int) -> None:
    assert parse_size(format_size(size)) == size
