"""Drain reasons: namespaced, one clean line, bounded, and recognisable as ours later."""
from __future__ import annotations

import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_gpu.slurm import reason as R
from slurm_gpu.slurm.reason import PREFIX, auto_resumable, format_reason, is_manual, is_ours, reason_check, reason_context

HOSTILE = [
    "line one\nline two\r\nline three",
    'quote " and \' and `backtick`',
    "semi; rm -rf / ; echo",
    "$(touch /tmp/pwned)",
    "`touch /tmp/pwned`",
    "tab\there\x0bvt\x0cff",
    "nul\x00byte and esc\x1b[31mred\x1b[0m and del\x7f",
    "c1 control \x85 next line, \u2028 line sep, \u2029 para sep",
    "bidi \u202e override \u200b zero width \ufeff bom",
    "lone surrogate \udcff from surrogateescape",
    "State=RESUME NodeName=gpu02 Reason=",
    "]] [[ brackets [x] [root@2024-01-01T00:00:00]",
]


@pytest.mark.parametrize("text", HOSTILE)
def test_hostile_fault_becomes_one_clean_line(text):
    r = format_reason(text, "healthcheck")
    assert r.startswith(PREFIX + " ")
    assert r.endswith(" [healthcheck]")
    assert all(unicodedata.category(c) not in ("Cc", "Cf", "Zl", "Zp", "Cs") for c in r), repr(r)
    assert "  " not in r
    r.encode("utf-8")  # no lone surrogates: it must survive exec() argv encoding


def test_shell_metacharacters_are_kept_verbatim_not_escaped():
    # No shell ever sees the reason (one argv element), so it is not mangled either.
    assert format_reason("$(touch /tmp/x); `id` \"q\"", "prolog job 7") == \
        'slurm-gpu: $(touch /tmp/x); `id` "q" [prolog job 7]'


def test_newlines_and_runs_of_whitespace_collapse_to_single_spaces():
    assert format_reason("  GPU 3\n\n uncorrectable   ECC\terrors: 2 ", "") == "slurm-gpu: GPU 3 uncorrectable ECC errors: 2"


def test_ten_kilobyte_fault_is_cut_with_ellipsis_and_keeps_context():
    r = format_reason("x" * 10240, "prolog job 4711")
    assert len(r) == 256
    assert r.endswith("\u2026 [prolog job 4711]")


def test_long_context_is_shortened_only_when_the_fault_would_lose_too_much():
    r = format_reason("GPU 3 lost", "c" * 1000, max_len=80)
    assert len(r) <= 80
    assert r.startswith("slurm-gpu: GPU 3 lost [")
    assert r.endswith("\u2026]")


def test_tiny_max_len_still_gives_a_prefixed_reason():
    r = format_reason("something long", "ctx", max_len=5)
    assert r.startswith(PREFIX)


def test_empty_fault_says_unspecified():
    assert format_reason("", "healthcheck") == "slurm-gpu: unspecified fault [healthcheck]"
    assert format_reason("\n\t ", "") == "slurm-gpu: unspecified fault"


def test_non_string_input_never_raises():
    class Evil:
        def __str__(self):
            raise RuntimeError("boom")

    assert format_reason(Evil(), None).startswith(PREFIX)  # type: ignore[arg-type]
    assert format_reason(12345, 7) == "slurm-gpu: 12345 [7]"  # type: ignore[arg-type]
    assert format_reason(None) == "slurm-gpu: unspecified fault"  # type: ignore[arg-type]


def test_brackets_in_context_cannot_forge_another_context():
    r = format_reason("fault", "manual] [x")
    assert r.endswith("[manual) (x]") and not is_ours(r) and reason_context(r) == ""
    forged = format_reason("fault", "healthcheck] [prolog job 7")
    assert not is_ours(forged) and not auto_resumable(forged)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=2000), st.text(max_size=300), st.integers(min_value=16, max_value=600))
def test_format_reason_is_bounded_single_line_and_ours(fault, context, max_len):
    r = format_reason(fault, context, max_len)
    assert len(r) <= max_len
    assert "\n" not in r and "\r" not in r
    assert r.startswith(PREFIX)
    r.encode("utf-8")
    if max_len >= 64:  # room for the context: a reason with one of our contexts is ours, whatever the fault says
        assert is_ours(format_reason(fault, "healthcheck", max_len, check="xid"))


@pytest.mark.parametrize("reason", [
    "slurm-gpu: hold for vendor ticket 4711, do not resume",
    "slurm-gpu: hold for vendor ticket 4711 [do not resume]",
    "slurm-gpu: GPU 0 lost [healthcheck by bob]",
    "slurm-gpu: GPU 0 lost [prolog job]",
    "slurm-gpu: GPU 0 lost [remediate: Reset now]",
    "slurm-gpu: GPU 0 lost [healthcheck] please keep",
    "slurm-gpu: GPU 0 lost [healthcheck; check xid; really]",
])
def test_an_admins_look_alike_reason_is_never_ours(reason):
    """Issue 35 row 5: ownership comes from our exact contexts, never from the prefix."""
    assert not is_ours(reason) and not auto_resumable(reason) and not is_manual(reason)


@pytest.mark.parametrize("reason", [
    "slurm-gpu: GPU 0 lost [healthcheck]", "slurm-gpu: GPU 0 lost [healthcheck; check xid]",
    "slurm-gpu: x [prolog job 4711; check ecc_uncorrectable]", "slurm-gpu: x [epilog job 12]",
    "slurm-gpu: x [drain --unhealthy; check responsive]", "slurm-gpu: x [remediate: reset]",
    "slurm-gpu: RMA: GPU 1654 x [remediate]", "slurm-gpu: x [remediate: reboot; check reboot] : reboot issued",
    "slurm-gpu: x [remediate: verify after reboot]",
])
def test_every_context_we_write_is_ours(reason):
    assert is_ours(reason) and not is_manual(reason)


def test_is_ours_recognises_only_our_prefix():
    assert is_ours("slurm-gpu: GPU 0 lost [healthcheck]")
    assert is_ours("  slurm-gpu: leading space [healthcheck]")
    assert not is_ours("slurm-gpu: no context")
    assert not is_ours("maintenance")
    assert not is_ours("Prolog error")
    assert not is_ours("Not responding")
    assert not is_ours("Reboot ASAP")
    assert not is_ours("slurm-gpu-other: not us")
    assert not is_ours("the slurm-gpu: prefix elsewhere")
    assert not is_ours("")
    assert not is_ours(None)


def test_manual_drains_are_ours_but_not_auto_resumable():
    manual = format_reason("GPU 3 replaced, burn-in pending", f"{R.MANUAL} by alice")
    auto = format_reason("GPU 3 uncorrectable ECC errors: 2", "healthcheck")
    prolog = format_reason("GPU 1 not responding", "prolog job 4711")
    assert is_manual(manual) and not auto_resumable(manual)
    assert auto_resumable(auto) and not is_manual(auto)
    assert auto_resumable(prolog)
    assert not auto_resumable("maintenance")
    assert reason_context(prolog) == "prolog job 4711"
    assert reason_context("slurm-gpu: no context") == ""


def test_slurm_appending_reboot_issued_and_complete_to_our_reason_keeps_its_check_and_owner():
    """slurmctld appends ' : reboot issued' and ' : reboot complete' to the reason of a node it
    reboots (node_mgr.c set_node_reason; seen on the testbed): the reason must still name its check
    (the reboot breaker counts by it) and stay remediate's (healthcheck must not lift it)."""
    ours = format_reason("GPU 2 pending row remap: needs a GPU reset", "remediate: reboot", check="reboot")
    for slurm_said in (" : reboot issued", " : reboot issued : reboot complete", " : Not responding"):
        reason = ours + slurm_said
        assert reason_context(reason) == "remediate: reboot; check reboot", reason
        assert reason_check(reason) == "reboot"
        assert not auto_resumable(reason)
    manual = format_reason("bad cable", f"{R.MANUAL} by alice") + " : reboot issued"
    assert is_manual(manual)


def test_the_rma_reason_is_written_and_read_in_one_place_and_an_admins_look_alike_is_not_one():
    """remediate writes its RMA drain with rma_reason and every reader asks is_rma: before, three
    parsers of the text existed, and owner() called an RMA drain 'remediate' (its context was read first)."""
    rma = R.rma_reason("1650223041234", "row remapping failure")
    assert rma.startswith("slurm-gpu: RMA: GPU 1650223041234 ") and rma.endswith("[remediate]")
    assert R.is_rma(rma) and R.owner(rma) == "an RMA" and not auto_resumable(rma)
    assert R.is_rma(rma + " : reboot issued")
    for look_alike in ("slurm-gpu: RMA: GPU 1 waiting for the vendor",  # typed by an admin, no context of ours
                       format_reason("RMA: GPU 1 ticket 4711", f"{R.MANUAL} by alice"),
                       format_reason("GPU 1 RMA: not the fault's start", "remediate"),
                       "RMA: GPU 1 [remediate]"):
        assert not R.is_rma(look_alike), look_alike
