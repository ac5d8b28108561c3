"""Slurm hostlist expansion/compression (slurm_gpu/hostlist.py)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_gpu.slurm import hostlist


@pytest.mark.parametrize("expr, names", [
    ("gpu[001-003]", ["gpu001", "gpu002", "gpu003"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("gpu[001-002,066]", ["gpu001", "gpu002", "gpu066"]),
    ("a[1-2],b[7],login", ["a1", "a2", "b7", "login"]),
    ("rack[1-2]-gpu[01-02]", ["rack1-gpu01", "rack1-gpu02", "rack2-gpu01", "rack2-gpu02"]),
    ("n[1-2]x", ["n1x", "n2x"]),  # scontrol refuses text after the last ']'; we accept it (module docstring)
    ("node5", ["node5"]),
    (" gpu[1-2] ", ["gpu1", "gpu2"]),
])
def test_expand_reads_slurm_hostlists(expr, names):
    assert hostlist.expand(expr) == names


@pytest.mark.parametrize("expr, problem", [
    ("gpu[1-", "without a matching ']'"),
    ("gpu1]", "without a matching '['"),
    ("gpu[a-b]", "bad range 'a-b'"),
    ("gpu[5-1]", "runs backwards"),
    ("gpu[]", "empty brackets"),
    ("gpu[[1]]", "nested"),
    ("a,,b", "empty host name"),
    ("", "empty"),
    ("a b", "white space"),
    ("n[1-99999999]", "more than"),
    ("n[1-2000][1-2000]", "more than"),
])
def test_expand_rejects_invalid_expression_with_clear_message(expr, problem):
    with pytest.raises(ValueError, match=problem.replace("[", r"\[").replace("]", r"\]")):
        hostlist.expand(expr)


@pytest.mark.parametrize("names, expr", [
    ([f"gpu{i:03d}" for i in range(1, 65)] + ["gpu066"], "gpu[001-064,066]"),
    ([f"n{i}" for i in range(1, 11)], "n[1-10]"),
    (["n10", "n9", "n8"], "n[8-10]"),
    (["n08", "n09", "n10"], "n[08-10]"),
    (["gpu7"], "gpu7"),
    (["login", "gpu1", "gpu2", "gpu1"], "gpu[1-2],login"),
    (["a1", "b1", "b2"], "a1,b[1-2]"),
])
def test_compress_writes_shortest_ranges(names, expr):
    assert hostlist.compress(names) == expr


def test_compress_keeps_padded_and_unpadded_apart():
    # n9 and n09 are different hosts; n010 and n10 too: each must survive the round trip.
    names = ["n9", "n09", "n010", "n10", "n11"]
    assert sorted(hostlist.expand(hostlist.compress(names))) == sorted(names)


@pytest.mark.parametrize("bad", ["a,b", "a[1]", "", "x y"])
def test_compress_rejects_names_a_hostlist_cannot_hold(bad):
    with pytest.raises(ValueError):
        hostlist.compress([bad])


_prefix = st.sampled_from(["gpu", "n", "rack1-gpu", "a", "login", "x-"])
_digits = st.integers(min_value=0, max_value=130).flatmap(
    lambda v: st.sampled_from([str(v), str(v).zfill(2), str(v).zfill(3)]))
_name = st.one_of(st.builds(lambda p, d: p + d, _prefix, _digits), _prefix)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=2000), min_size=1, max_size=80), st.sampled_from([1, 3, 4]))
def test_compress_is_one_bracket_per_prefix_for_uniform_width(nums, width):
    names = [f"gpu{str(n).zfill(width)}" for n in nums]
    expr = hostlist.compress(names)
    # one prefix, one width: a single group (no stray comma outside the brackets)
    assert hostlist._split_top(expr) == [expr]
    assert hostlist.expand(expr) == sorted(set(names), key=hostlist.sort_key)


# --- issue 10: Slurm's order, Slurm's range limit, shortest form with mixed padding -------------

def test_expand_with_three_bracket_groups_follows_slurms_order():
    # Slurm (src/common/hostlist.c _push_range_list) varies the last bracket fastest, then the
    # first, the second, ...: `scontrol show hostnames 'a[1-2]b[3-4]c[5-6]'` prints this.
    assert hostlist.expand("a[1-2]b[3-4]c[5-6]") == [
        "a1b3c5", "a1b3c6", "a2b3c5", "a2b3c6", "a1b4c5", "a1b4c6", "a2b4c5", "a2b4c6"]
    four = hostlist.expand("a[1-2]b[1-2]c[1-2]d[1-2]")
    assert four[:6] == ["a1b1c1d1", "a1b1c1d2", "a2b1c1d1", "a2b1c1d2", "a1b2c1d1", "a1b2c1d2"]
    assert four[8] == "a1b1c2d1" and len(four) == 16


def test_expand_rejects_more_than_65536_hosts_in_one_range_as_slurm_does():
    assert len(hostlist.expand("n[1-65536]")) == hostlist.SLURM_MAX_RANGE == 65536
    with pytest.raises(ValueError, match="65536"):
        hostlist.expand("n[0-65536]")  # 65,537 hosts: scontrol says "Too many hosts in range"
    with pytest.raises(ValueError, match="65536"):
        hostlist.expand("n[1-70000]y[1]")
    # count() and expand() agree on what Slurm refuses
    with pytest.raises(ValueError):
        hostlist.count("n[0-65536]")


def test_compress_is_shortest_when_zero_padding_is_mixed():
    # n1, n2 and n01, n02 are four hosts; one run per padding style is shorter than
    # alternating single names (n[01,1,02,2]).
    assert hostlist.compress(["n1", "n01", "n2", "n02"]) == "n[01-02,1-2]"
    assert hostlist.compress(["n9", "n09", "n010", "n10", "n11"]) == "n[09,9-11,010]"
    assert hostlist.compress(["n098", "n099", "n100", "n101"]) == "n[098-101]"


@settings(max_examples=300, deadline=None)
@given(st.lists(_name, max_size=60))
def test_expand_of_compress_is_sorted_unique_names(names):
    expr = hostlist.compress(names) if names else ""
    got = hostlist.expand(expr) if expr else []
    assert sorted(got) == sorted(set(names))  # each name once, nothing added
    by_value = {}
    for n in set(names):
        p, v, _ = hostlist._split_name(n)
        by_value.setdefault((p, v), set()).add(n)
    if all(len(s) == 1 for s in by_value.values()):
        # one spelling per number: natural order, as before
        assert got == sorted(set(names), key=hostlist.sort_key)
