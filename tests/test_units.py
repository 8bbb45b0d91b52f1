import pytest

from kvtier.units import SizeError, fmt_bytes, parse_bytes, parse_count


@pytest.mark.parametrize("text,expected", [
    ("256MiB", 256 * 2**20), ("80GB", 80 * 10**9), ("4096", 4096), ("1.5GiB", 3 * 2**29),
    ("10 kb", 10_000), (512, 512), ("0", 0),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text,expected", [("128k", 131072), ("1M", 1048576), ("8192", 8192), ("2.5k", 2560)])
def test_parse_count_binary(text, expected):
    assert parse_count(text) == expected


def test_parse_count_decimal():
    assert parse_count("3M", binary=False) == 3_000_000


@pytest.mark.parametrize("bad", ["-5", "abc", "12 parsecs", "", "1..2k", -3])
def test_bad_sizes_raise_clear_error(bad):
    with pytest.raises(SizeError):
        parse_bytes(bad)


def test_fmt_bytes_prints_unit():
    assert fmt_bytes(3 * 2**30) == "3.00 GiB"
    assert fmt_bytes(3 * 10**9, binary=False) == "3.00 GB"
    assert fmt_bytes(12) == "12 B"
