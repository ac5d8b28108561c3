"""The verification job (issue 35, items 6 and 7): the battery's parsers against samples in the tools'
own formats (tests/data/verify/README.md says where each layout comes from), the battery with the
stand-in dcgmi and all_reduce_perf on the simulated GPUs, verify_node's flow against a fake Slurm that
runs the real batch script, and the command-line backend's arguments."""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest
import simgpu
from click.testing import CliRunner

from slurm_gpu import config
from slurm_gpu.cli import main
from slurm_gpu.errors import ConfigError, SlurmError
from slurm_gpu.hooks import battery as B
from slurm_gpu.remediation import remedy as R
from slurm_gpu.remediation import verifyjob as V
from slurm_gpu.slurm import model as slurm
from slurm_gpu.slurm.cli_backend import CliBackend

DATA = pathlib.Path(__file__).resolve().parent / "data" / "verify"
H100 = "NVIDIA H100 80GB HBM3"


def sample(name: str) -> str:
    return (DATA / name).read_text()


def by(tests: Sequence[B.Test], result: str) -> List[B.Test]:
    return [t for t in tests if t.result == result]


# ------------------------------------------------------------------------------------------ DCGM parser

def test_dcgm4_json_names_the_gpu_that_failed_memory_and_keeps_skips_and_other_entities():
    tests = B.parse_dcgm(sample("dcgm4_r2_fail.json"))
    fails = by(tests, B.FAIL)
    assert [(t.name, t.gpu_index) for t in fails] == [("memory", 1), ("diagnostic", None)]
    assert fails[0].detail == "Found 3 faulty memory elements on GPU 1 (DCGM error 52)" and not fails[0].tool_error
    assert "cuInit" in fails[1].detail  # a test summary failing with no entity to blame: node-wide
    assert [(t.name, t.gpu_index) for t in by(tests, B.SKIP)] == [("pcie", 1)]
    assert ("pcie (Switch 0)", None) in [(t.name, t.gpu_index) for t in by(tests, B.PASS)]
    assert next(t for t in tests if t.name == "memory" and t.gpu_index == 0).detail == "Allocated 82955185684 bytes (97%)"


def test_dcgm3_json_reads_deployment_quirks_and_per_gpu_results():
    tests = B.parse_dcgm(sample("dcgm3_r2_fail.json"))
    fails = by(tests, B.FAIL)
    assert [(t.name, t.gpu_index) for t in fails] == [("Page Retirement/Row Remap", 3), ("GPU Memory", 2)]
    assert fails[0].detail == "GPU 3 had memory errors and row remappings are pending (DCGM error 85)"
    assert "memory mismatch" in fails[1].detail
    assert next(t for t in tests if t.name == "GPU Memory" and t.gpu_index == 0).detail.startswith("Allocated")
    assert next(t for t in tests if t.name == "Denylist").gpu_index is None


def test_dcgm_runtime_error_is_a_tool_error_not_a_gpu_fault():
    (t,) = B.parse_dcgm(sample("dcgm4_runtime_error.json"))
    assert t.result == B.FAIL and t.tool_error and "unable to establish a connection" in t.detail


def test_dcgm_warn_status_passes_with_its_note_and_not_run_is_left_out():
    text = json.dumps({"DCGM Diagnostic": {"test_categories": [{"category": "Hardware", "tests": [{"name": "memory",
            "results": [{"entity_group": "GPU", "entity_group_id": 1, "entity_id": 0, "status": "Warn",
                         "warnings": [{"warning": "slow", "error_id": 50, "error_category": 1, "error_severity": 4}]},
                        {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 1, "status": "Not Run"}],
            "test_summary": {"status": "Pass"}}]}]}})
    (t,) = B.parse_dcgm(text)
    assert (t.result, t.gpu_index, t.detail) == (B.WARN, 0, "slow (DCGM error 50)")


@pytest.mark.parametrize("text", ["", "dcgmi: command failed", '{"something": "else"}', "[1, 2]"])
def test_dcgm_output_that_is_not_dcgm_json_is_refused(text):
    with pytest.raises(ValueError):
        B.parse_dcgm(text)


# ------------------------------------------------------------------------------------------ nccl-tests parser

def test_nccl_219_table_gives_the_largest_size_out_of_place_busbw_and_the_gpu_model():
    run = B.parse_nccl(sample("nccl_2.19_pass.txt"))
    assert [r.size_bytes for r in run.rows] == [8 << 20, 16 << 20, 32 << 20, 64 << 20, 128 << 20, 256 << 20]
    assert run.rows[-1].busbw_gbps == 338.44 and run.out_of_bounds == 0 and run.avg_busbw_gbps == 272.99
    assert run.models == [H100] * 4
    (t,) = B.judge_nccl(run, 0, {H100: 300.0})
    assert t.result == B.PASS and "338.44 GB/s" in t.detail and "floor 300 GB/s" in t.detail
    (t,) = B.judge_nccl(run, 0, {H100: 350.0})
    assert t.result == B.FAIL and not t.tool_error and "under the floor of 350 GB/s for NVIDIA H100 80GB HBM3" in t.detail
    (t,) = B.judge_nccl(run, 0, {"NVIDIA A100-SXM4-80GB": 1000.0})
    assert t.result == B.PASS and "no floor for NVIDIA H100" in t.detail  # a model not listed must only succeed


def test_nccl_wrong_values_fail_whatever_the_bandwidth():
    run = B.parse_nccl(sample("nccl_2.19_wrong.txt"))
    assert run.out_of_bounds == 12
    tests = B.judge_nccl(run, 7, {})
    assert [t.result for t in tests] == [B.FAIL] and "12 wrong values (first at 67108864 B)" in tests[0].detail
    assert not tests[0].tool_error


def test_nccl_per_iteration_columns_and_unchecked_values_are_read_by_the_header():
    run = B.parse_nccl(sample("nccl_2.19_periter.txt"))
    assert len(run.rows) == 6 and run.rows[-1].busbw_gbps == 338.44 and all(r.wrong == 0 for r in run.rows)


def test_nccl_213_layout_parses_too():
    run = B.parse_nccl(sample("nccl_2.13_pass.txt"))
    assert len(run.rows) == 6 and run.models == ["NVIDIA A100-SXM4-80GB"] * 4
    assert run.rows[-1].busbw_gbps == 178.13


def test_nccl_without_a_table_is_a_tool_error():
    text = "# nccl-tests version 2.19.6\n# Using devices\ngpu07: Test NCCL failure common.cu:1011 'unhandled system error'\n"
    (t,) = B.judge_nccl(B.parse_nccl(text), 3, {}, text)
    assert t.result == B.FAIL and t.tool_error and "unhandled system error" in t.detail


# ------------------------------------------------------------------------------------------ the battery on simulated GPUs

def settings(**kw: Any) -> B.Settings:
    base = dict(dcgmi=str(simgpu.STAND_IN_DCGMI),
                nccl_command=(str(simgpu.STAND_IN_ALL_REDUCE_PERF), "-b", "8M", "-e", "256M", "-f", "2", "-g", "{gpus}"),
                nccl_min_busbw_gbps=((H100, 300.0),), timeout_s=60.0)
    base.update(kw)
    return B.Settings(**base)


@pytest.fixture
def node(tmp_path, monkeypatch):
    """A simulated 4x H100 node whose state the stand-in tools read ($SIMNVML_STATE)."""
    state = simgpu.write_state(tmp_path / "gpus.state", simgpu.h100_sxm(4))
    monkeypatch.setenv("SIMNVML_STATE", str(state))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return state


def test_battery_passes_on_healthy_gpus(node):
    result = B.run_battery(settings(), 4)
    assert result["ok"] and not result["empty"], result
    tools = {t["tool"] for t in result["tests"] if t["result"] == B.PASS}
    assert tools == {B.DCGM, B.NCCL}
    assert {t["gpu_index"] for t in result["tests"] if t["tool"] == B.DCGM} == {0, 1, 2, 3}
    assert B.exit_code(result) == 0 and result["duration_s"] < 30


def test_battery_names_the_gpu_whose_dcgm_test_fails(node):
    simgpu.set_gpu(node, 2, diag_fail="memory")
    result = B.run_battery(settings(), 4)
    fails = [t for t in B.tests_of(result) if t.result == B.FAIL]
    assert not result["ok"] and [(t.tool, t.name, t.gpu_index) for t in fails] == [(B.DCGM, "memory", 2)]
    assert "faulty memory elements on GPU 2" in fails[0].detail and B.exit_code(result) == 1


def test_battery_reads_the_dcgm3_layout_of_the_stand_in(node):
    simgpu.set_node(node, dcgm_version="3.3.9")
    simgpu.set_gpu(node, 1, diag_fail="pcie")
    fails = by(B.tests_of(B.run_battery(settings(), 4)), B.FAIL)
    assert [(t.name, t.gpu_index) for t in fails] == [("PCIe", 1)]


def test_battery_fails_a_slow_interconnect_against_the_floor(node):
    simgpu.set_gpu(node, 3, nvlink_busbw_gbps=120)
    result = B.run_battery(settings(), 4)
    (t,) = by(B.tests_of(result), B.FAIL)
    assert (t.tool, t.gpu_index) == (B.NCCL, None) and "under the floor of 300 GB/s" in t.detail


def test_battery_with_nothing_to_run_fails_closed_with_the_hint(node, tmp_path):
    result = B.run_battery(settings(dcgmi=str(tmp_path / "no-dcgmi"), nccl_command=("no-such-all_reduce_perf",)), 4)
    assert result["empty"] and not result["ok"] and B.EMPTY_HINT in result["hint"]
    assert [t["result"] for t in result["tests"]] == [B.SKIP, B.SKIP]
    assert B.exit_code(result) == 1


def test_battery_site_commands_decide_by_exit_code(node, tmp_path):
    none = dict(dcgmi=str(tmp_path / "no-dcgmi"), nccl_command=())
    assert B.run_battery(settings(commands=(("true",),), **none), 4)["ok"]
    result = B.run_battery(settings(commands=(("true",), ("sh", "-c", "echo bad row >&2; exit 3")), **none), 4)
    (t,) = by(B.tests_of(result), B.FAIL)
    assert (t.tool, t.tool_error, t.detail) == (B.COMMAND, False, "exit 3: bad row")
    result = B.run_battery(settings(commands=((str(tmp_path / "missing"),),), **none), 4)
    (t,) = by(B.tests_of(result), B.FAIL)
    assert t.tool_error and "not found" in t.detail and not result["ok"]


def test_battery_deadline_kills_a_hung_tool_and_skips_what_is_left(node, tmp_path):
    hang = tmp_path / "hang"
    hang.write_text("#!/bin/sh\nsleep 30 &\nsleep 30\n")  # a child too: the whole session goes
    hang.chmod(0o755)
    t0 = time.monotonic()
    result = B.run_battery(settings(dcgmi=str(hang), timeout_s=1.5, commands=(("true",),)), 4)
    assert time.monotonic() - t0 < 10
    tests = B.tests_of(result)
    assert tests[0].tool == B.DCGM and tests[0].tool_error and "deadline" in tests[0].detail
    assert all(t.result == B.FAIL and t.tool_error for t in tests), tests  # nccl and the command never ran
    assert not result["ok"]


def test_battery_on_one_gpu_skips_nccl(node):
    result = B.run_battery(settings(), 1)
    assert next(t for t in result["tests"] if t["tool"] == B.NCCL)["result"] == B.SKIP
    assert result["ok"]


def test_gpus_from_env_prefers_the_job(tmp_path):
    (tmp_path / "nvidia0").write_text("")
    (tmp_path / "nvidia1").write_text("")
    (tmp_path / "nvidiactl").write_text("")
    assert B.gpus_from_env({"CUDA_VISIBLE_DEVICES": "0,1,2"}, str(tmp_path)) == 3
    assert B.gpus_from_env({"SLURM_GPUS_ON_NODE": "8"}, str(tmp_path)) == 8
    assert B.gpus_from_env({}, str(tmp_path)) == 2


def toml(v: Any) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml(x)}" for k, x in v.items()) + "}"
    return json.dumps(v)


def write_cfg(tmp_path: pathlib.Path, extra: str = "", **verify: Any) -> pathlib.Path:
    keys = dict(dcgmi=str(simgpu.STAND_IN_DCGMI),
                nccl_command=[str(simgpu.STAND_IN_ALL_REDUCE_PERF), "-b", "8M", "-e", "64M", "-f", "2", "-g", "{gpus}"],
                nccl_min_busbw_gbps={H100: 300.0}, start_timeout_s=5, timeout_s=20)
    keys.update(verify)
    body = (f'slurm_backend = "cli"\n[store]\ndatabase = "{tmp_path}/%n/usage.db"\nspool_dir = "{tmp_path}/spool"\n'
            f'[log]\nsyslog = false\n[verify]\n' + "".join(f"{k} = {toml(v)}\n" for k, v in keys.items()) + extra)
    p = tmp_path / "slurm-gpu.toml"
    p.write_text(body)
    os.chmod(p, 0o644)
    return p


def test_cli_battery_json_and_exit_codes(node, tmp_path):
    cfg = write_cfg(tmp_path)
    r = CliRunner().invoke(main, ["--config", str(cfg), "battery", "--json", "--gpus", "4"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["ok"] is True
    simgpu.set_gpu(node, 0, diag_fail="software")
    r = CliRunner().invoke(main, ["--config", str(cfg), "battery", "--gpus", "4"])
    assert r.exit_code == 1 and "FAIL" in r.stdout and "software" in r.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text("[verify]\ndcgm_level = 9\n")
    r = CliRunner().invoke(main, ["--config", str(bad), "battery"])
    assert r.exit_code == 2 and "verify.dcgm_level" in r.stderr


# ------------------------------------------------------------------------------------------ config

def test_verify_defaults_and_validation(tmp_path):
    d = config.defaults()
    assert d.get("verify", "enabled") is False and d.get("verify", "dcgm_level") == 2
    assert d.get("verify", "nccl_command")[-1] == "{gpus}" and d.get("verify", "commands") == []
    for text, needle in [("[verify]\nnccl_min_busbw_gbps = {x = -1}\n", "bus bandwidth in GB/s"),
                         ('[verify]\ncommands = ["true"]\n', "list of commands"),
                         ('[verify]\nnccl_command = [""]\n', "non-empty strings"),
                         ("[verify]\nstart_timeout_s = 1\n", ">= 5")]:
        p = tmp_path / "c.toml"
        p.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(needle)):
            config.load(str(p))


# ------------------------------------------------------------------------------------------ remedy map

@pytest.mark.parametrize("check", ["verify_dcgm", "verify_nccl", "verify_command"])
def test_verification_failures_map_to_a_reset_that_escalates(check):
    from slurm_gpu.policy.health import CheckResult
    r = R.remedy_for(CheckResult(check, "FAIL", 1, "GPU-x", "verification job failed"))
    assert r.action == R.RESET and R.ESCALATION[R.RESET] == R.REBOOT
    assert check in V.CHECKS.values()


# ------------------------------------------------------------------------------------------ verify_node, fake Slurm

class Job:
    def __init__(self, proc: Optional[subprocess.Popen], state: str):
        self.proc, self.state = proc, state


class FakeSlurm(slurm.SlurmBackend):
    """Reservations and jobs in memory; a submitted job runs its batch script here (the real
    `slurm-gpu battery`), unless `hold` keeps it PENDING or `hang` makes it run forever."""

    name = "fake"

    def __init__(self, node: str = "gpu01", *, hold: bool = False, hang: bool = False):
        self.calls: List[Tuple[str, Any]] = []
        self.reservations: Dict[str, Dict[str, str]] = {}
        self.jobs: Dict[int, Job] = {}
        self.hold, self.hang = hold, hang
        self.node_name = node
        self.next_id = 100

    def node(self, name: str) -> slurm.NodeInfo:
        return slurm.NodeInfo(name=name, state="IDLE", states=frozenset({"IDLE"}), partitions=("gpu", "debug"))

    def nodes(self, names=None):
        return [self.node(self.node_name)]

    def drain(self, name, reason):
        self.calls.append(("drain", reason))

    def resume(self, name):
        self.calls.append(("resume", name))

    def job(self, job_id):
        raise SlurmError("no")

    def create_reservation(self, name, node, duration_min, users, flags=("MAINT", "IGNORE_JOBS")):
        self.calls.append(("create_reservation", (name, node, duration_min, tuple(users), tuple(flags))))
        self.reservations[name] = {"ReservationName": name, "Nodes": node}

    def delete_reservation(self, name):
        self.calls.append(("delete_reservation", name))
        return self.reservations.pop(name, None) is not None

    def reservation(self, name):
        return self.reservations.get(name)

    def submit_batch(self, options, script):
        self.next_id += 1
        job_id = self.next_id
        self.calls.append(("submit_batch", (list(options), script)))
        opts = dict(o[2:].split("=", 1) for o in options if "=" in o)
        if self.hold:
            self.jobs[job_id] = Job(None, "PENDING")
        elif self.hang:
            self.jobs[job_id] = Job(subprocess.Popen(["sleep", "60"]), "RUNNING")
        else:
            out = open(opts["output"].replace("%j", str(job_id)), "w")
            err = open(opts["error"].replace("%j", str(job_id)), "w")
            env = dict(os.environ, SLURMD_NODENAME=self.node_name, SLURM_JOB_ID=str(job_id))
            self.jobs[job_id] = Job(subprocess.Popen([script], stdout=out, stderr=err, env=env, cwd=opts["chdir"]),
                                    "RUNNING")
        return job_id

    def job_state(self, job_id):
        job = self.jobs[job_id]
        if job.proc is not None and job.state == "RUNNING" and job.proc.poll() is not None:
            job.state = "COMPLETED" if job.proc.returncode == 0 else "FAILED"
        return job.state, self.node_name, "ReqNodeNotAvail" if job.state == "PENDING" else "None"

    def cancel_job(self, job_id):
        self.calls.append(("cancel_job", job_id))
        job = self.jobs[job_id]
        if job.proc is not None and job.proc.poll() is None:
            job.proc.kill()
            job.proc.wait()
        job.state = "CANCELLED"

    def cancel_reservation_jobs(self, name):
        self.calls.append(("cancel_reservation_jobs", name))

    def job_accounted(self, job_id):
        self.calls.append(("job_accounted", job_id))
        return self.job_state(job_id)[0] not in ("PENDING", "RUNNING") and job_id not in self.unaccounted

    unaccounted: set = set()

    def order(self) -> List[str]:
        """What was done (reads of the job's accounting left out: test_the_reservation_outlasts...)."""
        return [c[0] for c in self.calls if c[0] != "job_accounted"]


class Clock:
    """monotonic/sleep for flows that wait on a job that never moves."""

    def __init__(self):
        self.t = 1000.0

    def monotonic(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def verify(cfg_path: pathlib.Path, backend: FakeSlurm, gpus: int = 4, **kw: Any) -> V.VerifyResult:
    cfg = config.load(str(cfg_path))  # %n: SLURMD_NODENAME (the site fixture)
    # Real time, polled often: the battery runs for real; the waits around the job (a second before
    # it, slurmdbd's settling after it) are Slurm's business, not this module's.
    kw.setdefault("sleep", lambda s: time.sleep(min(s, 0.05)))
    return V.verify_node(cfg, backend, "gpu01", gpus, resume=kw.pop("resume", lambda: (backend.resume("gpu01"), True)[1]),
                         drain=lambda text: backend.drain("gpu01", text), **kw)


@pytest.fixture
def site(tmp_path, monkeypatch):
    state = simgpu.write_state(tmp_path / "gpu01.state", simgpu.h100_sxm(4, seed="gpu01"))
    monkeypatch.setenv("SIMNVML_STATE", str(tmp_path / "%n.state"))  # the stand-ins expand %n in the job
    monkeypatch.setenv("SLURMD_NODENAME", "gpu01")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return state


def test_verify_node_passes_resumes_and_removes_its_reservation(tmp_path, site):
    b = FakeSlurm()
    r = verify(write_cfg(tmp_path), b)
    assert r.ok and r.failures == [] and not r.empty and r.job_id == 101, r
    assert b.order() == ["create_reservation", "resume", "submit_batch", "cancel_reservation_jobs", "delete_reservation"]
    name, node, minutes, users, flags = b.calls[0][1]
    assert (name, node, flags) == ("slurm-gpu-verify-gpu01", "gpu01", ("MAINT", "IGNORE_JOBS")) and minutes >= 1
    options, script = b.calls[2][1]
    assert "--reservation=slurm-gpu-verify-gpu01" in options and "--nodelist=gpu01" in options
    assert "--exclusive" in options and "--gres=gpu:4" in options and "--partition=gpu,debug" in options
    assert "--job-name=slurm-gpu-verify" in options and any(o.startswith("--output=") and o.endswith("gpu01-%j.json")
                                                            for o in options)
    assert pathlib.Path(script).read_text().startswith(f"#!{sys.executable}\n")
    assert b.reservations == {} and "drain" not in b.order()
    assert r.battery_s is not None and r.battery_s <= r.elapsed_s
    assert (tmp_path / "gpu01" / "verify" / "gpu01-101.json").exists()


def test_verify_job_is_not_submitted_in_the_reservations_first_second(tmp_path, site):
    """sacct showed Reservation empty for a verification job that started in the second its reservation
    began (slurmdbd joins on resv.time_start < job.time_start): the submission waits out that second."""
    clock = Clock()
    b = FakeSlurm(hold=True)
    stamps = {}
    create, submit = b.create_reservation, b.submit_batch
    b.create_reservation = lambda *a, **k: (stamps.setdefault("created", clock.t), create(*a, **k))[1]
    b.submit_batch = lambda *a, **k: (stamps.setdefault("submitted", clock.t), submit(*a, **k))[1]
    verify(write_cfg(tmp_path, start_timeout_s=5), b, sleep=clock.sleep, monotonic=clock.monotonic)
    assert stamps["submitted"] - stamps["created"] >= 1.0, stamps


def test_the_reservation_outlasts_the_job_until_slurmdbd_holds_its_end(tmp_path, site):
    """CI on 22.05: sacct showed a verification job with no reservation.  Deleting a reservation clears
    it from every job slurmctld still holds; a job whose end had not reached slurmdbd yet was then
    recorded without it (id_resv 0).  The reservation goes once sacct shows the job's end."""
    b = FakeSlurm()
    answers = iter([False, False, True])
    seen = []

    def accounted(job_id):
        seen.append("job_accounted")
        return next(answers)
    b.job_accounted = accounted  # type: ignore[method-assign]
    delete = b.delete_reservation
    b.delete_reservation = lambda name: (seen.append("delete"), delete(name))[1]  # type: ignore
    assert verify(write_cfg(tmp_path), b).ok
    assert seen == ["job_accounted"] * 3 + ["delete"], seen


def test_a_job_slurmdbd_never_records_holds_the_reservation_for_a_bounded_time(tmp_path, site, monkeypatch):
    monkeypatch.setattr(V, "ACCOUNTING_WAIT_S", 1.0)
    b = FakeSlurm()
    b.job_accounted = lambda job_id: False  # type: ignore[method-assign]
    t0 = time.monotonic()
    r = verify(write_cfg(tmp_path), b)
    assert r.ok and b.reservations == {} and time.monotonic() - t0 < 30


def test_verify_node_drains_before_it_deletes_the_reservation_when_a_gpu_fails(tmp_path, site):
    simgpu.set_gpu(site, 3, diag_fail="memory")
    b = FakeSlurm()
    r = verify(write_cfg(tmp_path), b)
    assert not r.ok and [(f.gpu_index, f.tool, f.test) for f in r.failures] == [(3, "dcgm", "memory")]
    assert "GPU 3 dcgm memory" in r.detail and "\n" not in r.detail
    order = b.order()
    assert order.index("drain") < order.index("delete_reservation") and b.reservations == {}
    assert V.failure_checks(r) == [(3, "verify_dcgm", "memory: Found 1 faulty memory elements on GPU 3 (DCGM error 52)")]


def test_verify_node_with_an_empty_battery_fails_closed_without_blaming_a_gpu(tmp_path, site):
    b = FakeSlurm()
    r = verify(write_cfg(tmp_path, dcgmi="/nonexistent/dcgmi", nccl_command=["/nonexistent/all_reduce_perf"]), b)
    assert not r.ok and r.empty and r.failures == [] and B.EMPTY_HINT in r.detail
    assert b.order().index("drain") < b.order().index("delete_reservation")


def test_verify_node_cancels_a_job_the_node_does_not_start(tmp_path, site):
    b, clock = FakeSlurm(hold=True), Clock()
    r = verify(write_cfg(tmp_path, start_timeout_s=5), b, sleep=clock.sleep, monotonic=clock.monotonic)
    assert not r.ok and r.failures == [] and "did not start the verification job 101 within 5 s" in r.detail
    extra = V.RESERVATION_FIRST_SECOND_S + V.ACCOUNTING_SETTLE_S  # before the job, after it
    assert "PENDING, ReqNodeNotAvail" in r.detail and 5 <= r.elapsed_s <= 7 + extra
    order = b.order()
    assert order.index("cancel_job") < order.index("drain") < order.index("delete_reservation")


def test_verify_node_cancels_a_job_that_overruns(tmp_path, site):
    b, clock = FakeSlurm(hang=True), Clock()
    r = verify(write_cfg(tmp_path, timeout_s=10), b, sleep=clock.sleep, monotonic=clock.monotonic)
    assert not r.ok and "ran past verify.timeout_s (10 s)" in r.detail
    extra = V.RESERVATION_FIRST_SECOND_S + V.ACCOUNTING_SETTLE_S  # before the job, after it
    assert 10 + V.OVERRUN_GRACE_S <= r.elapsed_s <= 10 + V.OVERRUN_GRACE_S + 2 + extra
    assert "cancel_job" in b.order() and b.reservations == {}


def test_verify_node_leaves_a_node_whose_reason_changed(tmp_path, site):
    b = FakeSlurm()
    r = verify(write_cfg(tmp_path), b, resume=lambda: False)
    assert not r.ok and r.job_id is None and "reason changed" in r.detail
    assert b.order() == ["create_reservation", "cancel_reservation_jobs", "delete_reservation"]


def test_verify_node_deletes_a_stale_reservation_first(tmp_path, site):
    b = FakeSlurm()
    b.reservations["slurm-gpu-verify-gpu01"] = {"ReservationName": "slurm-gpu-verify-gpu01"}
    assert verify(write_cfg(tmp_path), b).ok
    assert b.order()[:3] == ["cancel_reservation_jobs", "delete_reservation", "create_reservation"]


def test_verify_node_drains_when_the_submission_fails(tmp_path, site):
    b = FakeSlurm()

    def refuse(options, script):
        raise SlurmError("sbatch failed: Requested node configuration is not available", "hint")
    b.submit_batch = refuse  # type: ignore[method-assign]
    r = verify(write_cfg(tmp_path), b)
    assert not r.ok and "Requested node configuration" in r.detail and r.job_id is None
    assert b.order() == ["create_reservation", "resume", "drain", "cancel_reservation_jobs", "delete_reservation"]


def test_verify_node_keeps_the_reservation_when_the_drain_fails(tmp_path, site):
    simgpu.set_gpu(site, 0, diag_fail="memory")
    b = FakeSlurm()
    cfg = config.load(str(write_cfg(tmp_path)))

    def drain(text):
        raise SlurmError("slurmctld not reachable: drain gpu01", "hint")
    with pytest.raises(SlurmError):
        V.verify_node(cfg, b, "gpu01", 4, resume=lambda: True, drain=drain)
    # the node is not drained: the reservation keeps other jobs off it, the next run's clean_leftover drains it
    assert "slurm-gpu-verify-gpu01" in b.reservations and "delete_reservation" not in b.order()


def test_verify_node_drains_when_slurm_stops_answering_about_the_job(tmp_path, site):
    b, clock = FakeSlurm(hang=True), Clock()

    def gone(job_id):
        raise SlurmError("slurmctld not reachable: scontrol show job", "hint")
    b.job_state = gone  # type: ignore[method-assign]
    r = verify(write_cfg(tmp_path), b, sleep=clock.sleep, monotonic=clock.monotonic)
    assert not r.ok and r.job_id == 101 and "slurmctld not reachable" in r.detail and r.failures == []
    assert b.order()[-3:] == ["drain", "cancel_reservation_jobs", "delete_reservation"]  # its job goes with it
    b.jobs[101].proc.kill()


def test_clean_leftover_drains_cancels_and_deletes(tmp_path):
    cfg = config.load(str(write_cfg(tmp_path)))
    b = FakeSlurm()
    drained: List[str] = []
    assert V.clean_leftover(cfg, b, "gpu01", drained.append) == ""
    b.reservations["slurm-gpu-verify-gpu01"] = {"ReservationName": "slurm-gpu-verify-gpu01"}
    done = V.clean_leftover(cfg, b, "gpu01", drained.append)
    assert "node drained" in done and drained and "left by an earlier run" in drained[0]
    assert b.order() == ["cancel_reservation_jobs", "delete_reservation"] and b.reservations == {}


def test_backend_without_the_verification_methods_says_which_backend_to_use():
    class Bare(slurm.SlurmBackend):
        name = "bare"
        node = nodes = drain = resume = job = None  # type: ignore[assignment]
    for call in (lambda b: b.create_reservation("r", "n", 1, ["root"]), lambda b: b.submit_batch([], "/x"),
                 lambda b: b.job_state(1), lambda b: b.delete_reservation("r")):
        with pytest.raises(SlurmError) as e:
            call(Bare())
        assert "the bare backend cannot" in e.value.message and 'slurm_backend = "cli"' in e.value.hint


# ------------------------------------------------------------------------------------------ CliBackend arguments

class Recorder(CliBackend):
    def __init__(self, answers: Dict[str, Tuple[int, str, str]]):
        super().__init__(bin_dir="/nonexistent", timeout_s=5)
        self.answers, self.argv = answers, []

    def run(self, tool, args, timeout_s=None):
        self.argv.append([tool, *args])
        for key, answer in self.answers.items():
            if key in " ".join([tool, *args]):
                return answer
        return 0, "", ""


def test_cli_backend_reservation_and_job_commands():
    b = Recorder({"show reservation gone": (1, "Reservation gone not found\n", ""),
                  "delete Reservation=gone": (1, "", "delete_reservation Reservation=gone: Requested reservation is invalid\n"),
                  "delete Reservation=busy": (1, "", "delete_reservation Reservation=busy: Requested reservation is in use\n"),
                  "show reservation r1": (0, "ReservationName=r1 StartTime=2026-12-04T04:39:38 Nodes=gpu01 "
                                             "Flags=MAINT,IGNORE_JOBS,SPEC_NODES Users=root State=ACTIVE\n", ""),
                  "sbatch": (0, "4711\n", ""),
                  "show job 4711": (0, "JobId=4711 JobName=slurm-gpu-verify JobState=PENDING Reason=ReqNodeNotAvail,_"
                                       "UnavailableNodes:gpu01 NodeList=(null)\n", ""),
                  "show job 4712": (1, "", "slurm_load_jobs error: Invalid job id specified\n"),
                  "sacct": (0, "4712|CANCELLED by 0|gpu01|None\n", "")})
    b.create_reservation("slurm-gpu-verify-gpu01", "gpu01", 33, ["root"])
    assert b.argv[-1] == ["scontrol", "create", "reservation", "ReservationName=slurm-gpu-verify-gpu01", "Nodes=gpu01",
                          "StartTime=now", "Duration=33", "Users=root", "Flags=MAINT,IGNORE_JOBS"]
    assert b.reservation("gone") is None
    assert b.reservation("r1")["Flags"] == "MAINT,IGNORE_JOBS,SPEC_NODES"
    assert b.delete_reservation("gone") is False and b.delete_reservation("r1") is True
    with pytest.raises(SlurmError, match="still has jobs"):
        b.delete_reservation("busy")
    assert b.submit_batch(["--nodelist=gpu01", "--exclusive"], "/x/gpu01.batch") == 4711
    assert b.argv[-1] == ["sbatch", "--parsable", "--nodelist=gpu01", "--exclusive", "/x/gpu01.batch"]
    assert b.job_state(4711) == ("PENDING", "", "ReqNodeNotAvail,_UnavailableNodes:gpu01")
    assert b.job_state(4712) == ("CANCELLED", "gpu01", "")
    b.cancel_job(4711)
    b.cancel_reservation_jobs("r1")
    assert b.argv[-2:] == [["scancel", "4711"], ["scancel", "--reservation=r1"]]
    ended = Recorder({"-j 7": (0, "7|2026-12-04T10:02:53\n", ""), "-j 8": (0, "8|Unknown\n", ""),
                      "-j 9": (0, "", "")})
    assert ended.job_accounted(7) and not ended.job_accounted(8) and not ended.job_accounted(9)
    assert ended.argv[0] == ["sacct", "-X", "-n", "-P", "-j", "7", "--format=JobIDRaw,End"]
    with pytest.raises(SlurmError, match="invalid reservation name"):
        b.create_reservation("r x", "gpu01", 1, ["root"])
    with pytest.raises(SlurmError, match="--name=value"):
        b.submit_batch(["-w", "gpu01"], "/x")
