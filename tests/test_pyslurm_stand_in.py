"""The pyslurm stand-in (tests/fake_pyslurm) returns what real pyslurm 25.11.2 returned on Slurm
25.11.7 (tests/data/pyslurm-25.11.2.json, recorded on a real two-node cluster): the same
attributes, the same shapes, the same values for the same cluster."""
import json
import sys
from pathlib import Path

import pytest

RECORDED = json.loads((Path(__file__).parent / "data" / "pyslurm-25.11.2.json").read_text())
FAKE = Path(__file__).resolve().parent / "fake_pyslurm"
NODE_ATTRS = ("name", "state", "reason", "reason_user", "reason_time", "configured_gres", "allocated_gres",
              "allocated_tres", "partitions")


@pytest.fixture
def ps(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(FAKE))
    sys.modules.pop("pyslurm", None)
    import pyslurm
    pyslurm._reset(str(tmp_path / "state.json"))
    for name in ("gpu01", "gpu02"):  # the recorded cluster: Gres=gpu:h100:2, 2 CPUs per node
        pyslurm._add_node(name, gres={"gpu:h100": 2}, cpus=2)
    yield pyslurm
    sys.modules.pop("pyslurm", None)


def plain(v):
    """An object as the recording shows it: TrackableResources -> {'__type__', 'to_dict'} (counts only)."""
    if hasattr(v, "to_dict") and not isinstance(v, dict):
        return {k: (x.count if hasattr(x, "count") else x) for k, x in v.to_dict(flatten_limits=True).items()}
    return v


def recorded_counts(rec):
    return {k: (x["to_dict"]["count"] if isinstance(x, dict) else x) for k, x in rec["to_dict"].items()}


def node_facts(n):
    return {a: getattr(n, a) for a in NODE_ATTRS}


def test_pyslurm_stand_in_nodes_load_gives_the_recorded_nodes_while_a_job_runs(ps):
    ps._add_job(1, node="gpu01", gpus=[0], start_time=1796143279)
    got = {name: node_facts(n) for name, n in ps.Nodes.load().items()}
    want = {name: {a: rec[a] for a in NODE_ATTRS} for name, rec in RECORDED["Nodes.load() while job 1 runs"].items()}
    assert got == want


def test_pyslurm_stand_in_single_node_load_is_stale_like_slurm_25_11(ps):
    ps._add_job(1, node="gpu01", gpus=[0], start_time=1796143279)
    ps.Nodes.load()
    assert node_facts(ps.Node.load("gpu01")) == {a: RECORDED["Node.load('gpu01') while job 1 runs"][a] for a in NODE_ATTRS}
    ps._end_job(1, "CANCELLED")
    stale = node_facts(ps.Node.load("gpu01"))
    assert stale == {a: RECORDED["Node.load('gpu01') after job 1 ended"][a] for a in NODE_ATTRS}
    assert stale["state"] == "MIXED" and stale["allocated_gres"] == {"gpu": 1, "gpu:h100": 1}
    assert node_facts(ps.Nodes.load()["gpu01"]) == {a: RECORDED["Nodes.load() after job 1 ended"]["gpu01"][a]
                                                   for a in NODE_ATTRS}


def test_pyslurm_stand_in_job_load_gives_the_recorded_job(ps):
    rec = RECORDED["Job.load(1) while it runs"]
    ps._add_job(1, node="gpu01", gpus=[0], user_name="sgtest", account="physics", partition="gpu",
                start_time=rec["start_time"])
    j = ps.Job.load(1)
    for a in ("user_name", "account", "partition", "state", "allocated_nodes", "gres_per_node", "time_limit",
              "start_time", "end_time"):
        assert getattr(j, a) == rec[a], a
    layout = j.get_resource_layout_per_node()
    assert layout["gpu01"]["gres"] == rec["get_resource_layout_per_node()"]["gpu01"]["gres"]
    assert set(layout["gpu01"]) == set(rec["get_resource_layout_per_node()"]["gpu01"])
    assert plain(j.allocated_tres) == recorded_counts(rec["allocated_tres"])


def test_pyslurm_stand_in_db_job_gives_the_recorded_tres(ps):
    rec = RECORDED["db.Job.load(2)"]
    ps._add_job(2, live=False, node="gpu02", gpus=[0, 1], user_name="sgtest", account="physics", partition="gpu",
                state="COMPLETED", start_time=rec["start_time"], end_time=rec["end_time"])
    d = ps.db.Job.load(2)
    for a in ("user_name", "account", "partition", "state", "nodelist", "time_limit", "start_time", "end_time"):
        assert getattr(d, a) == rec[a], a
    assert plain(d.allocated_tres) == recorded_counts(rec["allocated_tres"])


@pytest.mark.parametrize("call,key", [(lambda ps: ps.Node.load("nope"), "Node.load(nope)"),
                                      (lambda ps: ps.Job.load(999999), "Job.load(999999)"),
                                      (lambda ps: ps.db.Job.load(999999), "db.Job.load(999999)")])
def test_pyslurm_stand_in_errors_are_the_recorded_ones(ps, call, key):
    with pytest.raises(ps.RPCError) as e:
        call(ps)
    assert (type(e.value).__name__, e.value.msg, e.value.errno) == tuple(RECORDED["errors"][key][k]
                                                                        for k in ("__raises__", "msg", "errno"))
