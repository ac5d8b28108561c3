"""The one drain decision (slurm_gpu/policy/drain.py) and the shared helpers that replaced copies:
the index-range parser, the deadline runner and the Jinja environment (issue 11, "One home per rule")."""
from __future__ import annotations

import threading
import time
import types

import pytest

from slurm_gpu.policy.drain import DRAIN, KEEP, REDRAIN, decide_drain
from slurm_gpu.slurm.model import NodeInfo, split_state
from slurm_gpu.slurm.reason import format_reason

NEW = format_reason("GPU 2 uncorrectable ECC errors: 2", "healthcheck")
OURS = format_reason("GPU 1 fell off the bus", "prolog job 7")
MANUAL = format_reason("RMA opened", "manual by alice")


def info(state: str, reason: str = "") -> NodeInfo:
    return NodeInfo("gpu01", state, split_state(state), reason, "alice" if reason else "", None, "gpu:h100:4", "", 4, 0)


# node state, existing reason, automatic action, manual action
TABLE = [
    ("IDLE", "", DRAIN, DRAIN),
    ("MIXED", "", DRAIN, DRAIN),
    ("IDLE+DRAIN", "maintenance", KEEP, KEEP),
    ("MIXED+DRAIN", "Prolog error", KEEP, KEEP),
    ("DOWN+DRAIN", "power work", KEEP, KEEP),
    ("IDLE+DRAIN", OURS, KEEP, REDRAIN),
    ("DOWN+DRAIN", OURS, KEEP, REDRAIN),
    ("IDLE+DRAIN", MANUAL, KEEP, REDRAIN),
    ("DOWN", "Not responding", KEEP, DRAIN),
    ("DOWN", OURS, KEEP, REDRAIN),
]


@pytest.mark.parametrize("state,existing,auto,manual", TABLE)
def test_drain_decision_table(state, existing, auto, manual):
    node = info(state, existing)
    a = decide_drain(node, NEW)
    m = decide_drain(node, NEW, manual=True)
    assert (a.action, m.action) == (auto, manual)
    assert a.reason == (NEW if auto != KEEP else existing)
    assert m.reason == (NEW if manual != KEEP else existing)


def test_automatic_drain_never_touches_another_ones_reason():
    d = decide_drain(info("IDLE+DRAIN", "maintenance"), NEW)
    assert d.action == KEEP and d.reason == "maintenance" and d.whose == "other"


def test_automatic_drain_keeps_the_first_reason_of_our_own():
    # The epilog after a failed prolog sees the same fault: the prolog's reason is the more precise.
    d = decide_drain(info("IDLE+DRAIN", OURS), NEW)
    assert d.action == KEEP and d.reason == OURS and d.whose == "slurm-gpu"


def test_automatic_drain_leaves_a_down_node_to_whoever_downed_it():
    # The hooks used to drain a DOWN node (overwriting Slurm's or an admin's reason); healthcheck did not.
    assert decide_drain(info("DOWN", "Not responding"), NEW).action == KEEP


def test_manual_drain_replaces_our_earlier_reason():
    d = decide_drain(info("IDLE+DRAIN", OURS), MANUAL, manual=True)
    assert d.action == REDRAIN and d.reason == MANUAL


def test_drain_decision_takes_any_node_like_object():
    # The hooks' test doubles (and pyslurm objects) carry only some of NodeInfo's fields.
    assert decide_drain(types.SimpleNamespace(drained=False), NEW).action == DRAIN
    assert decide_drain(types.SimpleNamespace(drained=True, reason=None), NEW) == (KEEP, "", "other")


# ------------------------------------------------------------------ healthcheck uses the decision

class _Backend:
    timeout_s = 1.0

    def __init__(self, node):
        self._node, self.actions = node, []

    def node(self, name):
        return self._node

    def drain(self, name, reason):
        self.actions.append(("drain", name, reason))

    def resume(self, name):
        self.actions.append(("resume", name))


class _R:
    def __init__(self, status, message="ok"):
        self.status, self.message, self.check, self.gpu_index, self.gpu_uuid, self.hint = status, message, "x", 0, "", ""


def test_healthcheck_fail_on_down_node_keeps_slurms_reason():
    from slurm_gpu.hooks.healthcheck import node_health_cycle
    b = _Backend(info("DOWN", "Not responding"))
    out = node_health_cycle(b, "gpu01", lambda i: [_R("FAIL", "GPU 0 lost")])
    assert b.actions == [] and out.action == "kept-drained" and out.reason == "Not responding"


def test_healthcheck_fail_on_our_own_drain_keeps_the_first_reason():
    from slurm_gpu.hooks.healthcheck import node_health_cycle
    b = _Backend(info("IDLE+DRAIN", OURS))
    out = node_health_cycle(b, "gpu01", lambda i: [_R("FAIL", "GPU 0 lost")])
    assert b.actions == [] and out.action == "kept-drained" and out.reason == OURS and "by slurm-gpu" in out.message


# ------------------------------------------------------------------ one index-range parser

def test_index_ranges_have_one_parser():
    from slurm_gpu.gres.inventory import parse_cpulist
    from slurm_gpu.slurm import hostlist
    from slurm_gpu.slurm.jobenv import parse_job_gpus
    assert hostlist.parse_index_ranges("0-3,6") == parse_job_gpus("0-3,6") == parse_cpulist("0-3,6") == (0, 1, 2, 3, 6)
    assert hostlist.expand("gpu[0-3,6]") == [f"gpu{i}" for i in (0, 1, 2, 3, 6)]
    assert hostlist.parse_index_ranges("6,0-1,1") == (6, 0, 1)  # order of appearance, each once
    with pytest.raises(hostlist.RangeError) as e:
        hostlist.parse_index_ranges("0-x")
    assert e.value.kind == "syntax" and e.value.item == "0-x"


def test_cpulist_rejects_non_ascii_digits_like_job_gpus():
    # str.isdigit() took Arabic-Indic digits; SLURM_JOB_GPUS already refused them.
    from slurm_gpu.gres.inventory import parse_cpulist
    with pytest.raises(ValueError, match="bad CPU list item"):
        parse_cpulist("\u0663")
    with pytest.raises(ValueError, match="runs backwards"):
        parse_cpulist("3-1")


def test_index_range_limits_refuse_huge_numbers_without_int():
    from slurm_gpu.slurm.hostlist import RangeError, parse_index_ranges
    with pytest.raises(RangeError) as e:
        parse_index_ranges("1" * 10_000, max_value=4095)
    assert e.value.kind == "too-large"
    with pytest.raises(RangeError) as e:
        parse_index_ranges("0-2000", max_span=1024)
    assert e.value.kind == "too-wide"


# ------------------------------------------------------------------ one deadline runner

def test_deadline_runner_abandons_a_hung_call():
    from slurm_gpu.gpu.deadline import DeadlineExceeded, call_with_deadline, run_with_deadline
    release = threading.Event()
    t0 = time.monotonic()
    assert call_with_deadline(release.wait, 0.1, "test-hang") == (False, None, None)
    with pytest.raises(DeadlineExceeded, match="test-hang timed out"):
        run_with_deadline(release.wait, 0.1, "test-hang")
    release.set()
    assert time.monotonic() - t0 < 5


def test_deadline_runner_hands_back_value_and_error():
    from slurm_gpu.gpu.deadline import call_with_deadline, run_with_deadline
    assert run_with_deadline(lambda: 42, 5, "ok") == 42
    boom = KeyError("x")

    def fail():
        raise boom
    assert call_with_deadline(fail, 5, "fail") == (True, None, boom)
    with pytest.raises(KeyError):
        run_with_deadline(fail, 5, "fail")


def test_nvml_timeout_still_names_the_nvml_call():
    from slurm_gpu.gpu import nvml
    release = threading.Event()
    with pytest.raises(TimeoutError, match="NVML call nvmlInit timed out after 0.1s"):
        nvml._run_with_deadline(release.wait, 0.1, "nvmlInit")
    release.set()


# ------------------------------------------------------------------ one Jinja environment

def test_gres_conf_and_html_report_share_one_jinja_environment_factory():
    from slurm_gpu.gres import generate
    from slurm_gpu.render import template_env
    from slurm_gpu.report import html
    assert generate._template_env() is template_env()
    assert html._env() is template_env(html=True)
    assert html._env().autoescape and not generate._template_env().autoescape
    assert generate._template_env().get_template("gres.conf.j2") is not None
