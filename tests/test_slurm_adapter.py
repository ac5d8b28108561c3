"""The Slurm adapter: parsing what Slurm prints, how commands are run, backend selection,
the pyslurm backend (against the in-memory stand-in) and the healthcheck decision flow.

Real Slurm is exercised in tests/integration/test_admin_commands.py; here a stand-in
`scontrol` (a real executable that logs its argv and environment) pins down how we call it.
"""
from __future__ import annotations

import json
import stat
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from slurm_gpu.config import defaults
from slurm_gpu.errors import ExitCode, NvmlUnavailable, SlurmError
from slurm_gpu.hooks.healthcheck import node_health_cycle
from slurm_gpu.slurm import backend as slurm_backend
from slurm_gpu.slurm import model as slurm
from slurm_gpu.slurm.cli_backend import CliBackend
from slurm_gpu.slurm.cli_text import parse_show_line, split_records
from slurm_gpu.slurm.conf import parse_gres
from slurm_gpu.slurm.model import NodeInfo, gpu_count, split_state, tres_gpu_count
from slurm_gpu.slurm.reason import format_reason

FAKE_PYSLURM = Path(__file__).resolve().parent / "fake_pyslurm"

# Captured from Slurm 22.05.8 (`scontrol -d -o show node`, SLURM_TIME_FORMAT=standard).
LINE_IDLE = ("NodeName=gpu01 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=4 CPUTot=4 CPULoad=0.53 "
             "AvailableFeatures=(null) ActiveFeatures=(null) Gres=gpu:h100:4 GresDrain=N/A GresUsed=gpu:h100:0(IDX:N/A) "
             "NodeAddr=127.0.0.1 NodeHostName=vm Port=16901 Version=22.05.8 OS=Linux 6.18.44-fc-v657 #1 SMP "
             "PREEMPT_DYNAMIC @0  RealMemory=1000 AllocMem=0 FreeMem=22966 Sockets=4 Boards=1 State=IDLE "
             "ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=gpu  "
             "BootTime=2026-11-29T19:56:55 SlurmdStartTime=2026-11-29T20:08:02 LastBusyTime=2026-11-29T20:08:02 "
             "CfgTRES=cpu=4,mem=1000M,billing=4 AllocTRES= CapWatts=n/a CurrentWatts=0 AveWatts=0 "
             "ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s")
LINE_MIXED = LINE_IDLE.replace("NodeName=gpu01", "NodeName=gpu02").replace(
    "GresUsed=gpu:h100:0(IDX:N/A)", "GresUsed=gpu:h100:2(IDX:0-1)").replace("State=IDLE", "State=MIXED")
HOSTILE_REASON = 'slurm-gpu: x=y "q" ; $(touch /tmp/p) [a@2020-01-01T00:00:00] B=c [healthcheck]'
LINE_DRAINED = LINE_IDLE.replace("State=IDLE", "State=IDLE+DRAIN") + \
    f" Reason={HOSTILE_REASON} [root@2026-11-29T20:08:08]"


# ------------------------------------------------------------------ parsing

@pytest.mark.parametrize("gres,expected", [
    ("gpu:h100:4(S:0-1)", [("gpu", "h100", 4)]),
    ("gpu:h100:2(IDX:0-1)", [("gpu", "h100", 2)]),
    ("gpu:h100:2(IDX:0,2)", [("gpu", "h100", 2)]),
    ("gpu:4", [("gpu", "", 4)]),
    ("gpu", [("gpu", "", 1)]),
    ("gpu:a100:2,gpu:v100:1(S:1),mps:100K", [("gpu", "a100", 2), ("gpu", "v100", 1), ("mps", "", 102400)]),
    ("gpu:h100:0(IDX:N/A)", [("gpu", "h100", 0)]),
    ("gres/gpu:h100=4", [("gpu", "h100", 4)]),
    ("(null)", []),
    ("", []),
    (None, []),
])
def test_parse_gres_reads_every_spelling_slurm_uses(gres, expected):
    assert parse_gres(gres) == expected


def test_gpu_count_ignores_other_gres_and_sums_types():
    assert gpu_count("gpu:a100:2,gpu:v100:1,shard:8,mps:200") == 3
    assert gpu_count("gpu:h100:4(S:0-1)") == 4


def test_tres_gpu_count_prefers_untyped_total():
    assert tres_gpu_count("cpu=4,mem=1000M,gres/gpu=2,gres/gpu:h100=2") == 2
    assert tres_gpu_count("cpu=4,gres/gpu:h100=1,gres/gpu:a100=2") == 3
    assert tres_gpu_count("cpu=1,node=1") is None
    assert tres_gpu_count("") is None


def test_split_state_normalises_flags():
    assert split_state("IDLE+DRAIN") == {"IDLE", "DRAIN"}
    assert split_state("mixed+drain") == {"MIXED", "DRAIN"}
    assert "NOT_RESPONDING" in split_state("IDLE*")
    assert "DRAIN" in split_state("drained")


def test_show_line_with_spaces_in_values_parses():
    f = parse_show_line(LINE_MIXED)
    assert f["NodeName"] == "gpu02"
    assert f["OS"] == "Linux 6.18.44-fc-v657 #1 SMP PREEMPT_DYNAMIC @0"
    assert f["GresUsed"] == "gpu:h100:2(IDX:0-1)"
    assert f["State"] == "MIXED"


def test_reason_with_brackets_equals_and_fake_suffix_is_read_whole():
    from slurm_gpu.slurm.cli_text import node_from_fields
    info = node_from_fields(parse_show_line(LINE_DRAINED))
    assert info.reason == HOSTILE_REASON
    assert info.reason_user == "root"
    assert info.reason_time == time.mktime(time.strptime("2026-11-29T20:08:08", "%Y-%m-%dT%H:%M:%S"))
    assert info.drained_by_us and info.drain_owner == "slurm-gpu"
    assert info.gpus_configured == 4 and info.gpus_allocated == 0


def test_reason_followed_by_more_fields_stops_at_slurms_suffix():
    line = (LINE_IDLE.replace("State=IDLE", "State=DOWN+DRAIN")
            + " Reason=maintenance window [alice@2026-01-02T03:04:05] Comment=rack 7")
    f = parse_show_line(line)
    assert f["Reason"] == "maintenance window" and f["ReasonUser"] == "alice" and f["Comment"] == "rack 7"


def test_reason_holding_a_newline_is_glued_back_into_its_record():
    out = LINE_IDLE + "\n" + LINE_IDLE.replace("gpu01", "gpu03") + " Reason=first\nsecond [root@2026-01-01T00:00:00]\n"
    recs = split_records(out)
    assert len(recs) == 2
    assert parse_show_line(recs[1])["Reason"] == "first second"


# ------------------------------------------------------------------ the CLI backend, with a stand-in scontrol

def make_tool(bin_dir: Path, name: str, *, stdout: str = "", stderr: str = "", rc: int = 0, sleep_s: float = 0.0,
              by_args: Optional[Dict[str, Any]] = None) -> Path:
    """An executable that logs argv + env to <name>.calls and answers with canned output.
    by_args maps a substring of the joined argv to (stdout, stderr, rc)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    log = bin_dir / f"{name}.calls"
    script = bin_dir / name
    script.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import json, os, sys, time
        with open({str(log)!r}, "a") as f:
            f.write(json.dumps({{"argv": sys.argv[1:], "SLURM_CONF": os.environ.get("SLURM_CONF"),
                                 "SLURM_TIME_FORMAT": os.environ.get("SLURM_TIME_FORMAT")}}) + "\\n")
        time.sleep({sleep_s!r})
        out, err, rc = {stdout!r}, {stderr!r}, {rc!r}
        for key, answer in json.loads({json.dumps(by_args or {})!r}).items():
            if key in " ".join(sys.argv[1:]):
                out, err, rc = answer
                break
        sys.stdout.write(out); sys.stderr.write(err); sys.exit(rc)
        """))
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return script


def calls(bin_dir: Path, name: str = "scontrol") -> List[Dict[str, Any]]:
    p = bin_dir / f"{name}.calls"
    return [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []


def test_drain_passes_reason_as_one_argv_element_without_a_shell(tmp_path):
    make_tool(tmp_path, "scontrol")
    b = CliBackend(bin_dir=str(tmp_path), timeout_s=5)
    r = format_reason('GPU 3 "lost"; $(touch ' + str(tmp_path / "pwned") + ") `id`", "healthcheck")
    b.drain("gpu01", r)
    (c,) = calls(tmp_path)
    assert c["argv"] == ["update", "NodeName=gpu01", "State=DRAIN", f"Reason={r}"]
    assert not (tmp_path / "pwned").exists()


def test_resume_sends_state_resume(tmp_path):
    make_tool(tmp_path, "scontrol")
    CliBackend(bin_dir=str(tmp_path), timeout_s=5).resume("gpu07")
    assert calls(tmp_path)[0]["argv"] == ["update", "NodeName=gpu07", "State=RESUME"]


def test_environment_is_passed_through_with_iso_time_format(tmp_path):
    make_tool(tmp_path, "scontrol", stdout=LINE_IDLE + "\n")
    env = {"SLURM_CONF": "/etc/site/slurm.conf", "SLURM_TIME_FORMAT": "relative"}
    info = CliBackend(bin_dir=str(tmp_path), timeout_s=5, env=env).node("gpu01")
    (c,) = calls(tmp_path)
    assert c["argv"] == ["-d", "-o", "show", "node", "gpu01"]
    assert c["SLURM_CONF"] == "/etc/site/slurm.conf" and c["SLURM_TIME_FORMAT"] == "standard"
    assert info.name == "gpu01" and info.state == "IDLE" and not info.drained


def test_binaries_are_found_without_path_in_the_fallback_dirs(tmp_path, monkeypatch):
    import slurm_gpu.slurm.cli_backend as cb
    make_tool(tmp_path / "opt", "scontrol")
    monkeypatch.setattr(cb, "FALLBACK_DIRS", ("/nonexistent", str(tmp_path / "opt")))
    b = CliBackend(env={"SLURM_CONF": "/x"}, timeout_s=5)  # no PATH, like a hook
    assert b.find("scontrol") == str(tmp_path / "opt" / "scontrol")


def test_slurm_bin_dir_wins_over_path(tmp_path):
    make_tool(tmp_path / "site", "scontrol")
    make_tool(tmp_path / "path", "scontrol")
    b = CliBackend(bin_dir=str(tmp_path / "site"), env={"PATH": str(tmp_path / "path")}, timeout_s=5)
    assert b.find("scontrol") == str(tmp_path / "site" / "scontrol")


def test_missing_scontrol_is_a_clear_error(tmp_path, monkeypatch):
    import slurm_gpu.slurm.cli_backend as cb
    monkeypatch.setattr(cb, "FALLBACK_DIRS", (str(tmp_path / "none"),))
    with pytest.raises(SlurmError) as e:
        CliBackend(bin_dir=str(tmp_path / "empty"), env={}, timeout_s=5).node("gpu01")
    assert "scontrol not found" in e.value.message and "slurm_bin_dir" in e.value.hint


def test_unknown_node_carries_slurms_text(tmp_path):
    make_tool(tmp_path, "scontrol", stdout="Node nope not found\n", rc=1)
    with pytest.raises(SlurmError) as e:
        CliBackend(bin_dir=str(tmp_path), timeout_s=5).node("nope")
    assert e.value.message == "unknown node 'nope': Node nope not found"
    assert "sinfo -N" in e.value.hint


def test_unreachable_slurmctld_says_so_with_ping_hint(tmp_path):
    make_tool(tmp_path, "scontrol", stderr="slurm_update error: Unable to contact slurm controller (connect failure)\n", rc=1)
    with pytest.raises(SlurmError) as e:
        CliBackend(bin_dir=str(tmp_path), timeout_s=5, env={"SLURM_CONF": "/c/slurm.conf"}).drain("gpu01", "slurm-gpu: x")
    assert e.value.message.startswith("slurmctld not reachable: slurm_update error: Unable to contact slurm controller")
    assert "scontrol ping" in e.value.hint and "/c/slurm.conf" in e.value.hint


SLURMDBD_DOWN = ("sacct: error: _open_persist_conn: failed to open persistent connection to host:127.0.0.1:17236: "
                 "Connection refused\nsacct: error: Sending PersistInit msg: Connection refused\n"
                 "sacct: error: Problem talking to the database: Connection refused\n")  # 22.05, seen in CI


def test_unreachable_slurmdbd_is_not_called_an_unreachable_slurmctld(tmp_path):
    """sacct talks to slurmdbd: its "connection refused" sent admins to `scontrol ping`, which answered."""
    make_tool(tmp_path, "scontrol", stderr="slurm_load_jobs error: Invalid job id specified\n", rc=1)
    make_tool(tmp_path, "sacct", stderr=SLURMDBD_DOWN, rc=1)
    with pytest.raises(SlurmError) as e:
        CliBackend(bin_dir=str(tmp_path), timeout_s=5, env={"SLURM_CONF": "/c/slurm.conf"}).job(42)
    assert e.value.message.startswith("slurmdbd not reachable: sacct: error: _open_persist_conn"), e.value.message
    assert "slurmdbd" in e.value.hint and "sacctmgr show cluster" in e.value.hint and "scontrol ping" not in e.value.hint
    assert slurm.ends_batch(e.value)


def test_hanging_scontrol_is_cut_off_at_the_timeout(tmp_path):
    make_tool(tmp_path, "scontrol", sleep_s=30)
    t0 = time.monotonic()
    with pytest.raises(SlurmError) as e:
        CliBackend(bin_dir=str(tmp_path), timeout_s=1).node("gpu01")
    assert time.monotonic() - t0 < 5
    assert "did not answer within 1 s" in e.value.message


def test_node_names_that_could_smuggle_arguments_are_rejected(tmp_path):
    make_tool(tmp_path, "scontrol")
    b = CliBackend(bin_dir=str(tmp_path), timeout_s=5)
    for bad in ("gpu01 State=RESUME", "gpu01\nx", "", "-o", "a=b"):
        with pytest.raises(SlurmError):
            b.drain(bad, "slurm-gpu: x")
    assert calls(tmp_path) == []


def test_several_nodes_come_from_one_call_in_the_order_asked(tmp_path):
    make_tool(tmp_path, "scontrol", stdout=LINE_IDLE + "\n" + LINE_MIXED + "\n")
    b = CliBackend(bin_dir=str(tmp_path), timeout_s=5)
    infos = b.nodes(["gpu02", "gpu01"])
    assert [i.name for i in infos] == ["gpu02", "gpu01"]
    assert infos[0].gpus_allocated == 2
    assert calls(tmp_path)[0]["argv"] == ["-d", "-o", "show", "node"]
    with pytest.raises(SlurmError, match="unknown node gpu09"):
        b.nodes(["gpu01", "gpu09"])


JOB_LINE = ("JobId=42 JobName=wrap UserId=alice(1001) GroupId=alice(1001) MCS_label=N/A Account=physics QOS=normal "
            "JobState=RUNNING Reason=None Partition=gpu NodeList=gpu02 StartTime=2026-11-29T20:08:13 EndTime=Unknown "
            "AllocTRES=cpu=1,node=1,gres/gpu=2 TresPerNode=gres:gpu:2")


@pytest.mark.parametrize("tres_per_node", ["gres:gpu:2", "gres/gpu:2"], ids=["22.05", "25.11"])
def test_job_facts_from_slurmctld_while_the_job_lives(tmp_path, tres_per_node):
    make_tool(tmp_path, "scontrol", stdout=JOB_LINE.replace("gres:gpu:2", tres_per_node) + "\n")
    j = CliBackend(bin_dir=str(tmp_path), timeout_s=5).job(42)
    assert j["user"] == "alice" and j["account"] == "physics" and j["partition"] == "gpu"
    assert j["state"] == "RUNNING" and j["nodes"] == "gpu02" and j["gres"] == "gpu:2"
    assert j["end_time"] is None and j["start_time"] and j["source"] == "slurmctld"


def test_job_facts_fall_back_to_sacct_json_then_parseable(tmp_path):
    make_tool(tmp_path, "scontrol", stderr="slurm_load_jobs error: Invalid job id specified\n", rc=1)
    sacct_json = {"jobs": [{"job_id": 42, "user": "alice", "account": "physics", "partition": "gpu",
                            "state": {"current": "COMPLETED"}, "nodes": "gpu01",
                            "time": {"start": 1700000000, "end": 1700000600},
                            "tres": {"allocated": [{"type": "cpu", "name": "", "count": 1},
                                                   {"type": "gres", "name": "gpu", "count": 2}]}}]}
    make_tool(tmp_path, "sacct", stdout=json.dumps(sacct_json))
    j = CliBackend(bin_dir=str(tmp_path), timeout_s=5).job(42)
    assert (j["user"], j["state"], j["gres"], j["end_time"], j["source"]) == \
        ("alice", "COMPLETED", "gpu:2", 1700000600.0, "slurmdbd")

    # A sacct without --json (or with a schema we do not know) -> sacct -P.
    (tmp_path / "sacct.calls").unlink()
    make_tool(tmp_path, "sacct", by_args={
        "--json": ["", "sacct: unrecognized option '--json'\n", 1],
        "-P": ["42|bob|chem|gpu|CANCELLED by 0|gpu01|cpu=1,gres/gpu=1,node=1|2026-01-01T00:00:00|2026-01-01T01:00:00\n", "", 0],
    })
    j = CliBackend(bin_dir=str(tmp_path), timeout_s=5).job(42)
    assert (j["user"], j["account"], j["state"], j["gres"]) == ("bob", "chem", "CANCELLED", "gpu:1")
    assert [c["argv"][0] for c in calls(tmp_path, "sacct")] == ["--json", "-X"]


# ------------------------------------------------------------------ backend selection

@pytest.fixture
def fake_pyslurm(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(FAKE_PYSLURM))
    sys.modules.pop("pyslurm", None)
    import pyslurm
    pyslurm._reset(str(tmp_path / "fake-slurmctld.json"))
    yield pyslurm
    sys.modules.pop("pyslurm", None)


def _cfg(tmp_path, backend: str, version_line: str):
    make_tool(tmp_path, "scontrol", stdout=version_line + "\n")
    return defaults().replace("", slurm_backend=backend, slurm_bin_dir=str(tmp_path), slurm_timeout_s=5.0)


def test_auto_uses_pyslurm_when_it_matches_the_running_slurm(tmp_path, fake_pyslurm):
    b = slurm_backend.get_backend(_cfg(tmp_path, "auto", "slurm 25.11.2"))
    assert b.name == "pyslurm" and "matches Slurm 25.11" in b.why


@pytest.mark.parametrize("pyslurm_version,slurm_version", [("25.11.1", "slurm 25.11.7"), ("26.5.0", "slurm 26.05.1")])
def test_auto_keeps_cli_where_pyslurm_is_not_verified_against_it(tmp_path, fake_pyslurm, monkeypatch,
                                                                 pyslurm_version, slurm_version):
    monkeypatch.setattr(fake_pyslurm, "__version__", pyslurm_version)
    b = slurm_backend.get_backend(_cfg(tmp_path, "auto", slurm_version))
    assert b.name == "cli" and "is not verified against the command-line tools" in b.why
    assert slurm_backend.get_backend(_cfg(tmp_path, "pyslurm", slurm_version)).name == "pyslurm"


def test_auto_falls_back_to_cli_on_version_mismatch(tmp_path, fake_pyslurm):
    b = slurm_backend.get_backend(_cfg(tmp_path, "auto", "slurm-wlm 22.05.8"))
    assert b.name == "cli" and "for Slurm 25.11, running Slurm is 22.05" in b.why


def test_auto_falls_back_to_cli_when_pyslurm_is_missing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyslurm", None)  # import pyslurm -> ImportError
    b = slurm_backend.get_backend(_cfg(tmp_path, "auto", "slurm 25.11.2"))
    assert b.name == "cli" and "not importable" in b.why
    assert calls(tmp_path) == []  # no version probe without pyslurm: the hook path stays cheap


def test_explicit_pyslurm_mismatch_is_an_error_not_a_silent_switch(tmp_path, fake_pyslurm):
    with pytest.raises(SlurmError) as e:
        slurm_backend.get_backend(_cfg(tmp_path, "pyslurm", "slurm 24.11.1"))
    assert "pyslurm 25.11.2 is for Slurm 25.11, running Slurm is 24.11" in e.value.message


def test_explicit_pyslurm_missing_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyslurm", None)
    with pytest.raises(SlurmError, match="cannot be imported"):
        slurm_backend.get_backend(_cfg(tmp_path, "pyslurm", "slurm 25.11.2"))


def test_explicit_cli_never_imports_pyslurm(tmp_path, fake_pyslurm):
    sys.modules.pop("pyslurm", None)
    b = slurm_backend.get_backend(_cfg(tmp_path, "cli", "slurm 25.11.2"))
    assert b.name == "cli" and "pyslurm" not in sys.modules


def test_version_text_parsing():
    assert slurm_backend.slurm_major_minor("slurm 22.05.8") == (22, 5)
    assert slurm_backend.slurm_major_minor("25.5.0") == (25, 5)
    assert slurm_backend.slurm_major_minor("slurm-wlm 24.11.5") == (24, 11)
    assert slurm_backend.slurm_major_minor("garbage") is None


# ------------------------------------------------------------------ pyslurm backend (stand-in)

def test_pyslurm_backend_reads_nodes_like_the_cli_backend(fake_pyslurm):
    from slurm_gpu.slurm.pyslurm_backend import PyslurmBackend
    fake_pyslurm._add_node("gpu01", gres={"gpu:h100": 4})
    fake_pyslurm._add_job(7, node="gpu01", gpus=[0, 1], start_time=1700000000)
    fake_pyslurm._add_node("gpu02", flags=["DRAIN"], reason="maintenance", reason_user="alice", reason_time=1700000000)
    b = PyslurmBackend(fake_pyslurm, timeout_s=5)
    n1, n2 = b.nodes(["gpu01", "gpu02"])
    assert (n1.state, n1.gres, n1.gres_used, n1.gpus_configured, n1.gpus_allocated) == \
        ("MIXED", "gpu:h100:4", "gpu:h100:2(IDX:0-1)", 4, 2)
    assert n2.drained and not n2.drained_by_us and n2.reason_user == "alice" and n2.reason_time == 1700000000.0
    assert n2.gres_used == "gpu:h100:0(IDX:N/A)" and n2.partitions == ("gpu",)
    assert [n.name for n in b.nodes()] == ["gpu01", "gpu02"]


def test_pyslurm_node_allocation_is_current_while_a_job_runs_and_after_it_ends(fake_pyslurm):
    # Slurm 25.11 does not refresh a node's allocation for a single-node load (pyslurm.Node.load):
    # read from it, a busy node looked idle and an idle one busy (issue 22, item 1).
    from slurm_gpu.slurm.pyslurm_backend import PyslurmBackend
    fake_pyslurm._add_node("gpu01", gres={"gpu:h100": 2})
    b = PyslurmBackend(fake_pyslurm, timeout_s=5)
    fake_pyslurm._add_job(7, node="gpu01", gpus=[0], start_time=1700000000)
    n = b.node("gpu01")
    assert (n.state, n.gpus_allocated, n.gres_used) == ("MIXED", 1, "gpu:h100:1(IDX:0)")
    fake_pyslurm._end_job(7)
    n = b.node("gpu01")
    assert (n.state, n.gpus_allocated, n.gres_used) == ("IDLE", 0, "gpu:h100:0(IDX:N/A)")


@pytest.mark.parametrize("tres_gres", [True, False], ids=["AccountingStorageTRES=gres/gpu,gres/gpu:h100", "no gres TRES"])
def test_pyslurm_gpus_allocated_are_counted_once_from_gres_with_indices(fake_pyslurm, tres_gres):
    # Real pyslurm's Node.allocated_gres is the node's allocated TRES: {"gpu": 1, "gpu:h100": 1} for ONE
    # GPU (counted twice), or {} without gres/gpu in AccountingStorageTRES (issue 22, item 2).
    from slurm_gpu.slurm.pyslurm_backend import PyslurmBackend
    fake_pyslurm._set_controller(tres_gres=tres_gres)
    for name in ("gpu01", "gpu02"):
        fake_pyslurm._add_node(name, gres={"gpu:h100": 2})
    fake_pyslurm._add_job(7, node="gpu01", gpus=[1], start_time=1700000000)
    b = PyslurmBackend(fake_pyslurm, timeout_s=5)
    n1, n2 = b.nodes(["gpu01", "gpu02"])
    assert (n1.gpus_allocated, n1.gres_used) == (1, "gpu:h100:1(IDX:1)")
    assert (n2.gpus_allocated, n2.gres_used) == (0, "gpu:h100:0(IDX:N/A)")


def test_pyslurm_backend_drains_and_resumes(fake_pyslurm):
    from slurm_gpu.slurm.pyslurm_backend import PyslurmBackend
    fake_pyslurm._add_node("gpu01")
    b = PyslurmBackend(fake_pyslurm, timeout_s=5)
    r = format_reason("GPU 2 lost", "healthcheck")
    b.drain("gpu01", r)
    n = b.node("gpu01")
    assert n.state == "IDLE+DRAIN" and n.reason == r and n.drained_by_us
    b.resume("gpu01")
    assert b.node("gpu01").state == "IDLE" and not b.node("gpu01").drained


def test_pyslurm_backend_errors_are_slurm_errors(fake_pyslurm):
    from slurm_gpu.slurm.pyslurm_backend import PyslurmBackend
    b = PyslurmBackend(fake_pyslurm, timeout_s=5)
    with pytest.raises(SlurmError, match="unknown node 'nope': Node 'nope' does not exist"):
        b.node("nope")
    fake_pyslurm._add_node("gpu01")
    fake_pyslurm._set_controller(up=False)
    with pytest.raises(SlurmError, match="^slurmctld not reachable: Unable to contact slurm controller"):
        b.drain("gpu01", "slurm-gpu: x")


def test_pyslurm_deadline_holds_while_the_hung_rpc_holds_the_interpreter_lock(fake_pyslurm):
    # pyslurm's RPCs keep the interpreter lock for the whole C call: a deadline thread never ran
    # before the call returned (slurmctld SIGSTOPped: 5.1 s for a 2 s deadline; issue 22, item 3).
    from slurm_gpu.slurm.pyslurm_backend import PyslurmBackend
    fake_pyslurm._add_node("gpu01")
    fake_pyslurm._set_controller(hang_s=5)
    t0 = time.monotonic()
    with pytest.raises(SlurmError, match="did not answer within 0.5 s"):
        PyslurmBackend(fake_pyslurm, timeout_s=0.5).node("gpu01")
    assert time.monotonic() - t0 < 2


def test_pyslurm_job_gives_the_fields_the_cli_backend_gives(fake_pyslurm):
    # Before: tres always '', gres '' from slurmdbd, end_time = start + 365 days for a running job
    # without a time limit (slurmctld's placeholder; scontrol says EndTime=Unknown), no 'final'.
    from slurm_gpu.slurm.pyslurm_backend import PyslurmBackend
    now = int(time.time())
    fake_pyslurm._add_node("gpu01")
    fake_pyslurm._add_job(7, node="gpu01", gpus=[0], user_name="alice", account="physics", partition="gpu",
                          start_time=now - 60)
    fake_pyslurm._add_job(8, live=False, node="gpu02", gpus=[0, 1], user_name="bob", account="chem", partition="gpu",
                          state="COMPLETED", start_time=1700000000, end_time=1700000100)
    b = PyslurmBackend(fake_pyslurm, timeout_s=5)
    j7, j8 = b.job(7), b.job(8)
    assert j7 == {"job_id": 7, "user": "alice", "account": "physics", "partition": "gpu", "state": "RUNNING",
                  "nodes": "gpu01", "gres": "gpu:1", "tres": "cpu=1,node=1,billing=1,gres/gpu=1,gres/gpu:h100=1",
                  "start_time": float(now - 60), "end_time": None, "source": "slurmctld", "final": False}
    assert j8 == {"job_id": 8, "user": "bob", "account": "chem", "partition": "gpu", "state": "COMPLETED",
                  "nodes": "gpu02", "gres": "gpu:2", "tres": "cpu=1,node=1,billing=1,gres/gpu=2,gres/gpu:h100=2",
                  "start_time": 1700000000.0, "end_time": 1700000100.0, "source": "slurmdbd", "final": True}
    with pytest.raises(SlurmError, match="unknown job 9"):
        b.job(9)


def test_pyslurm_job_without_accounting_is_an_unknown_job_like_the_cli_says(fake_pyslurm):
    from slurm_gpu.slurm.pyslurm_backend import PyslurmBackend
    fake_pyslurm._set_controller(slurmdbd=False)
    with pytest.raises(SlurmError, match="^unknown job 9: slurmctld no longer knows it and Failed to open") as e:
        PyslurmBackend(fake_pyslurm, timeout_s=5).job(9)
    assert "AccountingStorageType=accounting_storage/slurmdbd" in e.value.hint


# ------------------------------------------------------------------ healthcheck decisions

class MemBackend(slurm.SlurmBackend):
    """In-memory Slurm for decision tests: records drains and resumes."""

    name = "mem"
    timeout_s = 1.0

    def __init__(self, **nodes: NodeInfo):
        self._nodes = dict(nodes)
        self.actions: List[tuple] = []

    def node(self, name):
        if name not in self._nodes:
            raise SlurmError(f"unknown node {name!r}", "")
        return self._nodes[name]

    def nodes(self, names=None):
        return [self.node(n) for n in (names or self._nodes)]

    def drain(self, name, reason):
        self.actions.append(("drain", name, reason))

    def resume(self, name):
        self.actions.append(("resume", name))

    def job(self, job_id):
        raise SlurmError("no jobs here", "")


def node(state="IDLE", reason="", user="", gpus=4) -> NodeInfo:
    return NodeInfo("gpu01", state, split_state(state), reason, user, 1700000000.0 if reason else None,
                    f"gpu:h100:{gpus}", "", gpus, 0)


class R:
    def __init__(self, status, message="ok", check="x", gpu_index=0):
        self.status, self.message, self.check, self.gpu_index = status, message, check, gpu_index
        self.gpu_uuid, self.hint = "", ""


FAIL = [R("PASS"), R("FAIL", "GPU 2 (GPU-ab12) uncorrectable ECC errors: 2", "ecc_uncorrectable", 2)]
HEALTHY = [R("PASS"), R("WARN", "persistence mode off", "persistence_mode")]


def test_healthcheck_drains_a_healthy_looking_node_on_fail():
    b = MemBackend(gpu01=node())
    out = node_health_cycle(b, "gpu01", lambda info: FAIL)
    assert b.actions == [("drain", "gpu01",
                          "slurm-gpu: GPU 2 (GPU-ab12) uncorrectable ECC errors: 2 [healthcheck; check ecc_uncorrectable]")]
    assert out.action == "drained" and out.exit_code == ExitCode.UNHEALTHY


def test_healthcheck_never_overwrites_an_admins_drain_on_fail():
    b = MemBackend(gpu01=node("IDLE+DRAIN", "maintenance", "alice"))
    out = node_health_cycle(b, "gpu01", lambda info: FAIL)
    assert b.actions == [] and out.action == "kept-drained" and "alice" in out.message


def test_healthcheck_resumes_its_own_drain_when_healthy_again():
    r = format_reason("GPU 2 lost", "healthcheck")
    b = MemBackend(gpu01=node("IDLE+DRAIN", r, "root"))
    out = node_health_cycle(b, "gpu01", lambda info: HEALTHY)
    assert b.actions == [("resume", "gpu01")] and out.action == "resumed" and out.exit_code == 0


def test_healthcheck_resumes_a_prolog_drain_when_healthy_again():
    b = MemBackend(gpu01=node("MIXED+DRAIN", format_reason("GPU 1 not responding", "prolog job 4711")))
    assert node_health_cycle(b, "gpu01", lambda info: HEALTHY).action == "resumed"


def test_healthcheck_never_resumes_an_admins_drain_even_when_healthy():
    for reason in ("maintenance", "Prolog error", "Reboot ASAP", "Not responding"):
        b = MemBackend(gpu01=node("IDLE+DRAIN", reason, "alice"))
        out = node_health_cycle(b, "gpu01", lambda info: HEALTHY)
        assert b.actions == [] and out.action == "left-alone", reason


def test_healthcheck_leaves_a_manual_slurm_gpu_drain_to_the_admin():
    b = MemBackend(gpu01=node("IDLE+DRAIN", format_reason("GPU swap", "manual by alice")))
    out = node_health_cycle(b, "gpu01", lambda info: HEALTHY)
    assert b.actions == [] and out.action == "kept-drained" and "slurm-gpu resume gpu01" in out.message


def test_drain_unhealthy_mode_never_resumes():
    b = MemBackend(gpu01=node("IDLE+DRAIN", format_reason("GPU 2 lost", "healthcheck")))
    out = node_health_cycle(b, "gpu01", lambda info: HEALTHY, allow_resume=False)
    assert b.actions == [] and out.action == "kept-drained"


def test_dry_run_changes_nothing():
    b = MemBackend(gpu01=node())
    assert node_health_cycle(b, "gpu01", lambda info: FAIL, dry_run=True).action == "would-drain"
    b2 = MemBackend(gpu01=node("IDLE+DRAIN", format_reason("x", "healthcheck")))
    assert node_health_cycle(b2, "gpu01", lambda info: HEALTHY, dry_run=True).action == "would-resume"
    assert b.actions == [] and b2.actions == []


def test_check_overrunning_the_deadline_changes_nothing():
    b = MemBackend(gpu01=node())

    def stuck(info):
        time.sleep(10)
        return FAIL

    t0 = time.monotonic()
    out = node_health_cycle(b, "gpu01", stuck, deadline_s=1.5)
    assert time.monotonic() - t0 < 1.5
    assert out.action == "timeout" and out.exit_code != 0 and b.actions == []


def test_checker_gets_the_node_so_it_can_expect_the_configured_gpu_count():
    seen = []
    node_health_cycle(MemBackend(gpu01=node(gpus=8)), "gpu01", lambda info: seen.append(info.gpus_configured) or HEALTHY)
    assert seen == [8]


def test_no_driver_on_a_node_with_gpus_configured_drains_it():
    def no_driver(info):
        raise NvmlUnavailable("NVML Shared Library Not Found", "install the driver")

    b = MemBackend(gpu01=node(gpus=4))
    out = node_health_cycle(b, "gpu01", no_driver)
    assert out.action == "drained" and "NVIDIA driver unusable (4 GPUs configured)" in b.actions[0][2]
    b2 = MemBackend(gpu01=node(gpus=0))
    assert node_health_cycle(b2, "gpu01", no_driver).action == "none" and b2.actions == []


def test_a_bug_in_the_checker_changes_nothing():
    def buggy(info):
        raise KeyError("oops")

    b = MemBackend(gpu01=node())
    out = node_health_cycle(b, "gpu01", buggy)
    assert out.action == "error" and b.actions == [] and "KeyError" in out.message


def test_unknown_node_is_a_slurm_error():
    with pytest.raises(SlurmError):
        node_health_cycle(MemBackend(), "gpu99", lambda info: HEALTHY)


# ------------------------------------------------------------------ command line: usage errors need no Slurm

@pytest.mark.parametrize("args,needle", [
    (["drain", "gpu01"], "a drain needs a reason"),
    (["drain", "gpu01", "--reason", " \n\t"], "a drain needs a reason"),
    (["drain", "--reason", "x"], "no node given"),
    (["drain", "--unhealthy", "gpu01"], "--unhealthy checks this node"),
    (["drain", "gpu01", "--node", "gpu02", "--reason", "x"], "--node-name is for --unhealthy"),
    (["resume", "gpu[01-"], "invalid node list 'gpu[01-'"),
])
def test_usage_errors_are_one_line_with_a_hint_and_exit_2(args, needle, tmp_path):
    from click.testing import CliRunner

    from slurm_gpu.cli import main
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'slurm_backend = "cli"\nslurm_bin_dir = "{tmp_path}"\n[log]\nsyslog = false\n'
                   f'[store]\ndatabase = "{tmp_path}/usage.db"\nspool_dir = "{tmp_path}/spool"\n')
    make_tool(tmp_path, "scontrol")
    r = CliRunner().invoke(main, ["--config", str(cfg), *args])
    assert r.exit_code == 2, r.output
    assert f"slurm-gpu: error: {needle}" in r.output and "hint:" in r.output
    assert calls(tmp_path) == []  # nothing reached Slurm


# ------------------------------------------------------------------ many nodes: a cap, one read, one update

REPO = Path(__file__).resolve().parents[1]


def make_slurm(bin_dir: Path, nodes: Dict[str, Dict[str, Any]], *, before_update: Optional[Dict[str, Any]] = None) -> Path:
    """A stateful stand-in `scontrol` that behaves like Slurm 22.05.8 as observed on the testbed:

    * ``-d -o show node [HOSTLIST]``: one line per known node; ``Node X not found`` (stdout) per
      unknown name and exit 1 when there was one.
    * ``update NodeName=HOSTLIST State=DRAIN Reason=R`` / ``State=RESUME``: applied to every node
      it can be applied to; an unknown name or a RESUME of a node that is not drained fails the
      call (exit 1, ``slurm_update error: Invalid node name|state specified``) without undoing the rest.

    nodes: name -> {"state": "IDLE", "reason": "..."}.  before_update: name -> new record (None
    removes the node), applied once just before the first update (another admin racing us).
    Every call is logged like make_tool's.  State lives in <bin_dir>/slurm.json.
    """
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "slurm.json").write_text(json.dumps({"nodes": nodes, "before_update": before_update or {}}))
    log = bin_dir / "scontrol.calls"
    script = bin_dir / "scontrol"
    script.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import json, sys
        sys.path.insert(0, {str(REPO)!r})
        from slurm_gpu.slurm.hostlist import expand
        STATE = {str(bin_dir / "slurm.json")!r}
        LINE = {LINE_IDLE!r}
        argv = sys.argv[1:]
        with open({str(log)!r}, "a") as f:
            f.write(json.dumps({{"argv": argv}}) + "\\n")
        with open(STATE) as f:
            st = json.load(f)
        nodes = st["nodes"]

        def line(name, rec):
            out = LINE.replace("NodeName=gpu01", "NodeName=" + name).replace("State=IDLE", "State=" + rec["state"])
            if rec.get("reason"):
                out += " Reason=" + rec["reason"] + " [" + rec.get("user", "root") + "@2026-11-29T20:08:08]"
            return out

        if argv[:4] == ["-d", "-o", "show", "node"]:
            names = expand(argv[4]) if len(argv) > 4 else list(nodes)
            rc = 0
            for n in names:
                if n in nodes:
                    print(line(n, nodes[n]))
                else:
                    print("Node %s not found" % n)
                    rc = 1
            sys.exit(rc)
        if argv[:1] == ["update"]:
            kv = dict(a.split("=", 1) for a in argv[1:])
            for n, rec in st.pop("before_update", {{}}).items():
                if rec is None:
                    nodes.pop(n, None)
                else:
                    nodes[n] = rec
            err = ""
            for n in expand(kv["NodeName"]):
                rec = nodes.get(n)
                if rec is None:
                    err = err or "Invalid node name specified"
                    continue
                flags = rec["state"].split("+")
                if kv["State"] == "DRAIN":
                    if "DRAIN" not in flags:
                        flags.append("DRAIN")
                    rec["reason"] = kv["Reason"]
                elif kv["State"] == "RESUME":
                    if "DRAIN" not in flags and flags[0] != "DOWN":
                        err = err or "Invalid node state specified"
                        continue
                    flags = ["IDLE"] + [x for x in flags[1:] if x != "DRAIN"]
                    rec.pop("reason", None)
                rec["state"] = "+".join(flags)
            with open(STATE, "w") as f:
                json.dump(st, f)
            if err:
                sys.stderr.write("slurm_update error: " + err + "\\n")
                sys.exit(1)
            sys.exit(0)
        sys.stderr.write("fake scontrol: unexpected arguments %r\\n" % argv)
        sys.exit(2)
        """))
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return script


def slurm_state(bin_dir: Path) -> Dict[str, Dict[str, Any]]:
    return json.loads((bin_dir / "slurm.json").read_text())["nodes"]


def run_admin(tmp_path: Path, *args: str, extra_config: str = ""):
    from click.testing import CliRunner

    from slurm_gpu.cli import main
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'slurm_backend = "cli"\nslurm_bin_dir = "{tmp_path}"\n{extra_config}[log]\nsyslog = false\n'
                   f'[store]\ndatabase = "{tmp_path}/usage.db"\nspool_dir = "{tmp_path}/spool"\n')
    try:
        runner = CliRunner(mix_stderr=False)  # click < 8.2: stderr apart only when asked
    except TypeError:
        runner = CliRunner()  # click >= 8.2: result.stderr always apart
    return runner.invoke(main, ["--config", str(cfg), *args])


OURS = format_reason("GPU 2 lost", "healthcheck")


def test_drain_of_huge_hostlist_is_refused_before_contacting_slurm(tmp_path):
    make_tool(tmp_path, "scontrol")
    t0 = time.monotonic()
    r = run_admin(tmp_path, "drain", "gpu[1-100000]", "--reason", "rack work")
    assert time.monotonic() - t0 < 5
    assert r.exit_code == 2, r.output
    err = r.stderr.splitlines()
    assert err[0].startswith("slurm-gpu: error: invalid node list 'gpu[1-100000]': ") and "65536" in err[0]
    assert err[1].startswith("hint: ") and len(err) == 2
    assert calls(tmp_path) == []


def test_drain_beyond_the_node_cap_is_refused_with_a_hint_how_to_raise_it(tmp_path):
    make_tool(tmp_path, "scontrol")
    r = run_admin(tmp_path, "drain", "gpu[0001-2000]", "gpu[3000-3024]", "--reason", "rack work")
    assert r.exit_code == 2, r.output
    err = r.stderr.splitlines()
    assert len(err) == 2 and r.stdout == ""
    assert err[0] == ("slurm-gpu: error: gpu[0001-2000] gpu[3000-3024] names 2025 nodes; "
                      "one drain may change at most 1024 (slurm_max_nodes)")
    assert err[1].startswith("hint: ") and "--max-nodes 2025" in err[1] and "slurm_max_nodes = 2025" in err[1]
    r = run_admin(tmp_path, "resume", "gpu[1-20]", extra_config="slurm_max_nodes = 16\n")
    assert r.exit_code == 2 and "names 20 nodes; one resume may change at most 16" in r.stderr
    assert calls(tmp_path) == []


def test_max_nodes_flag_raises_the_cap_for_one_run(tmp_path):
    make_slurm(tmp_path, {f"gpu{i:02d}": {"state": "IDLE"} for i in range(1, 21)})
    r = run_admin(tmp_path, "drain", "gpu[01-20]", "--reason", "x", extra_config="slurm_max_nodes = 16\n")
    assert r.exit_code == 2 and calls(tmp_path) == []
    r = run_admin(tmp_path, "drain", "gpu[01-20]", "--reason", "x", "--max-nodes", "20",
                  extra_config="slurm_max_nodes = 16\n")
    assert r.exit_code == 0, r.output
    assert r.stdout.count(": drained: ") == 20


def test_drain_many_nodes_uses_one_scontrol_update(tmp_path):
    nodes = {f"gpu{i:03d}": {"state": "IDLE"} for i in range(1, 201)}
    nodes["gpu007"] = {"state": "IDLE+DRAIN", "reason": "maintenance", "user": "alice"}
    nodes["gpu008"] = {"state": "MIXED+DRAIN", "reason": OURS}
    make_slurm(tmp_path, nodes)
    r = run_admin(tmp_path, "drain", "gpu[001-200]", "--reason", "rack 7 power work")
    assert r.exit_code == 0, (r.stdout, r.stderr)
    argvs = [c["argv"] for c in calls(tmp_path)]
    assert argvs[0] == ["-d", "-o", "show", "node", "gpu[001-200]"]
    (update,) = argvs[1:]
    assert update[:3] == ["update", "NodeName=gpu[001-006,008-200]", "State=DRAIN"]
    assert update[3].startswith("Reason=slurm-gpu: rack 7 power work [manual by ")
    out = r.stdout.splitlines()
    assert out[0].startswith("gpu001: drained: slurm-gpu: rack 7 power work [manual by ")
    assert out[6] == "gpu007: already IDLE+DRAIN by alice since " + out[6].split(" since ")[1]
    assert out[6].endswith("'maintenance' - not ours, reason left as is")
    assert out[7].startswith("gpu008: re-drained: ")
    assert len(out) == 201 and out[200] == "summary: 200 nodes: 199 drained, 1 left alone (drained by someone else)"
    st = slurm_state(tmp_path)
    assert st["gpu007"]["reason"] == "maintenance"
    assert all(st[n]["reason"].startswith("slurm-gpu: rack 7") for n in st if n != "gpu007")


def test_resume_many_nodes_uses_one_scontrol_update(tmp_path):
    nodes = {f"gpu{i:02d}": {"state": "IDLE+DRAIN", "reason": OURS} for i in range(1, 41)}
    nodes["gpu03"] = {"state": "IDLE"}
    nodes["gpu04"] = {"state": "DOWN+DRAIN", "reason": "Not responding", "user": "slurm"}
    make_slurm(tmp_path, nodes)
    r = run_admin(tmp_path, "resume", "gpu[01-40]")
    assert r.exit_code == 6, (r.stdout, r.stderr)
    argvs = [c["argv"] for c in calls(tmp_path)]
    assert argvs == [["-d", "-o", "show", "node", "gpu[01-40]"],
                     ["update", "NodeName=gpu[01-02,05-40]", "State=RESUME"]]
    assert "gpu03: not drained (IDLE), nothing to do" in r.stdout
    assert r.stderr.startswith("gpu04: refused: DOWN+DRAIN by slurm since ")
    assert r.stdout.count(": resumed (was IDLE+DRAIN: slurm-gpu: GPU 2 lost [healthcheck])") == 38
    assert r.stdout.splitlines()[-1] == "summary: 40 nodes: 38 resumed, 1 not drained, 1 refused (not drained by slurm-gpu)"
    st = slurm_state(tmp_path)
    assert st["gpu04"]["state"] == "DOWN+DRAIN" and sum(s["state"] == "IDLE" for s in st.values()) == 39

    # --force takes the refused one too, still in one update
    (tmp_path / "scontrol.calls").unlink()
    r = run_admin(tmp_path, "resume", "gpu[01-40]", "--force")
    assert r.exit_code == 0, r.stderr
    assert [c["argv"] for c in calls(tmp_path)][1] == ["update", "NodeName=gpu04", "State=RESUME"]


def test_unknown_nodes_are_reported_from_the_one_read_and_left_out_of_the_update(tmp_path):
    make_slurm(tmp_path, {"gpu01": {"state": "IDLE"}, "gpu02": {"state": "IDLE"}})
    r = run_admin(tmp_path, "drain", "nope", "gpu[01-02]", "--reason", "x")
    assert r.exit_code == 4
    assert "slurm-gpu: error: unknown node 'nope': Node nope not found" in r.stderr and "hint:" in r.stderr
    argvs = [c["argv"] for c in calls(tmp_path)]
    assert argvs[0] == ["-d", "-o", "show", "node", "gpu[01-02],nope"]
    assert argvs[1][:2] == ["update", "NodeName=gpu[01-02]"] and len(argvs) == 2
    assert r.stdout.splitlines()[-1] == "summary: 3 nodes: 2 drained, 1 failed"


def test_a_node_that_changes_under_a_batch_resume_is_settled_one_by_one(tmp_path):
    """Between our read and our update another admin resumes gpu02 and deletes gpu03: Slurm fails
    the whole update (Invalid node state/name) but applies it to the rest.  We re-read once and
    retry nothing that already got there."""
    make_slurm(tmp_path, {n: {"state": "IDLE+DRAIN", "reason": OURS} for n in ("gpu01", "gpu02", "gpu03", "gpu04")},
               before_update={"gpu02": {"state": "IDLE"}, "gpu03": None})
    r = run_admin(tmp_path, "resume", "gpu[01-04]")
    assert r.exit_code == 4, (r.stdout, r.stderr)
    argvs = [c["argv"] for c in calls(tmp_path)]
    assert argvs == [["-d", "-o", "show", "node", "gpu[01-04]"],
                     ["update", "NodeName=gpu[01-04]", "State=RESUME"],
                     ["-d", "-o", "show", "node", "gpu[01-04]"]]
    assert "gpu01: resumed" in r.stdout and "gpu02: resumed" in r.stdout and "gpu04: resumed" in r.stdout
    assert "slurm-gpu: error: unknown node 'gpu03': Node gpu03 not found" in r.stderr


def test_a_drain_batch_that_slurm_half_applied_is_completed_node_by_node(tmp_path):
    b = CliBackend(bin_dir=str(tmp_path), timeout_s=5)
    make_slurm(tmp_path, {"gpu01": {"state": "IDLE"}, "gpu02": {"state": "IDLE"}},
               before_update={"gpu02": None})
    res = b.drain_many(["gpu01", "gpu02"], OURS)
    assert res.done == ["gpu01"] and list(res.failed) == ["gpu02"] and res.stopped is None
    assert res.failed["gpu02"].message == "unknown node 'gpu02': Node gpu02 not found"
    assert [c["argv"][0] for c in calls(tmp_path)] == ["update", "-d"]


def test_unreachable_slurmctld_stops_the_batch_with_one_error(tmp_path):
    make_tool(tmp_path, "scontrol", stderr="slurm_load_node error: Unable to contact slurm controller (connect failure)\n", rc=1)
    r = run_admin(tmp_path, "drain", "gpu[01-50]", "--reason", "x")
    assert r.exit_code == 4
    assert r.stderr.count("slurm-gpu: error: slurmctld not reachable") == 1
    assert len(calls(tmp_path)) == 1


def test_hostlist_batches_keep_every_argument_short_and_every_range_within_slurms_limit():
    from slurm_gpu.slurm.hostlist import compress, expand
    from slurm_gpu.slurm.model import hostlist_batches
    names = [f"n{i}" for i in range(1, 70001)]
    batches = hostlist_batches(names)
    assert [len(b) for b in batches] == [65536, 70000 - 65536]
    scattered = [f"rack{i}-node{j}" for i in range(300) for j in range(0, 40, 3)]
    batches = hostlist_batches(scattered, max_chars=4096)
    assert len(batches) > 1 and all(len(compress(b)) <= 4096 for b in batches)
    assert sorted(n for b in batches for n in expand(compress(b))) == sorted(scattered)


def test_pyslurm_backend_drains_and_resumes_many_nodes_in_one_rpc(fake_pyslurm):
    from slurm_gpu.slurm.pyslurm_backend import PyslurmBackend
    for i in range(1, 11):
        fake_pyslurm._add_node(f"gpu{i:02d}")
    b = PyslurmBackend(fake_pyslurm, timeout_s=5)
    names = [f"gpu{i:02d}" for i in range(1, 11)]
    look = b.lookup_nodes(names + ["nope"])
    assert list(look.found) == names and list(look.failed) == ["nope"]
    assert "Node 'nope' does not exist" in look.failed["nope"].message
    fake_pyslurm._clear_calls()
    res = b.drain_many(names, OURS)
    assert res.done == names and not res.failed and res.requests == 1
    assert [c.split(" ")[0] for c in fake_pyslurm._calls()] == ["Nodes.modify"]
    assert all(i.drained_by_us for i in b.nodes(names))
    fake_pyslurm._clear_calls()
    res = b.resume_many(names)
    assert res.done == names and [c.split(" ")[0] for c in fake_pyslurm._calls()] == ["Nodes.modify"]
    assert not any(i.drained for i in b.nodes(names))


def test_pyslurm_batch_with_a_vanished_node_is_settled_one_by_one(fake_pyslurm):
    from slurm_gpu.slurm.pyslurm_backend import PyslurmBackend
    for n in ("gpu01", "gpu02", "gpu03"):
        fake_pyslurm._add_node(n, flags=["DRAIN"], reason=OURS)
    fake_pyslurm._add_node("gpu04")  # not drained: RESUME is an invalid state for it
    b = PyslurmBackend(fake_pyslurm, timeout_s=5)
    res = b.resume_many(["gpu01", "gpu02", "gpu03", "gpu04", "gone"])
    assert sorted(res.done) == ["gpu01", "gpu02", "gpu03", "gpu04"] and list(res.failed) == ["gone"]
    assert not any(i.drained for i in b.nodes(["gpu01", "gpu02", "gpu03"]))


def test_memory_backend_without_hostlist_updates_still_gets_the_batch_interface():
    b = MemBackend(gpu01=node(), gpu02=node())
    res = b.drain_many(["gpu01", "gpu02"], OURS)
    assert res.done == ["gpu01", "gpu02"] and res.requests == 2
    assert b.actions == [("drain", "gpu01", OURS), ("drain", "gpu02", OURS)]


@pytest.mark.parametrize("expr", ["gpu[001-064,066]", "n[8-10]", "a[1-2],b[7],login", "rack[1-2]-gpu[01-02]",
                                  "n[1-2]x", "node5", " gpu[1-2] ", "r[1-3]n[1-4096]", "gpu[1-65536]"])
def test_hostlist_size_counts_what_expand_gives_without_expanding(expr):
    from slurm_gpu.cli.admin import _hostlist_size
    from slurm_gpu.slurm.hostlist import expand
    assert _hostlist_size(expr) == len(expand(expr))


def test_dry_run_of_many_nodes_reads_once_and_changes_nothing(tmp_path):
    make_slurm(tmp_path, {f"gpu{i:02d}": {"state": "IDLE"} for i in range(1, 31)})
    r = run_admin(tmp_path, "drain", "gpu[01-30]", "--reason", "x", "--dry-run")
    assert r.exit_code == 0, r.stderr
    assert [c["argv"][0] for c in calls(tmp_path)] == ["-d"]
    assert r.stdout.count(": would drain (IDLE): ") == 30
    assert r.stdout.splitlines()[-1] == "summary (dry run): 30 nodes: 30 would be drained"
    assert not any("DRAIN" in n["state"] for n in slurm_state(tmp_path).values())


def test_a_batch_slurm_refuses_as_a_whole_is_not_retried_node_by_node(tmp_path):
    make_slurm(tmp_path, {f"gpu{i:02d}": {"state": "IDLE"} for i in range(1, 51)})
    (tmp_path / "scontrol").rename(tmp_path / "scontrol.real")
    wrapper = tmp_path / "scontrol"  # every update fails before touching anything; the rest is the stateful one
    wrapper.write_text("\n".join([
        f"#!{sys.executable}",
        "import os, sys",
        "if sys.argv[1:2] == ['update']:",
        f"    open({str(tmp_path / 'scontrol.calls')!r}, 'a').write('{{\"argv\": [\"update\"]}}' + chr(10))",
        "    sys.stderr.write('slurm_update error: Invalid argument' + chr(10))",
        "    sys.exit(1)",
        f"os.execv({str(tmp_path / 'scontrol.real')!r}, [sys.argv[0]] + sys.argv[1:])",
        ""]))
    wrapper.chmod(0o755)
    res = CliBackend(bin_dir=str(tmp_path), timeout_s=5).drain_many([f"gpu{i:02d}" for i in range(1, 51)], OURS)
    assert res.done == [] and len(res.failed) == 50 and res.requests == 1
    assert res.failed["gpu01"].message == "drain gpu[01-50] failed: slurm_update error: Invalid argument"
    assert [c["argv"][0] for c in calls(tmp_path)] == ["update", "-d"]
