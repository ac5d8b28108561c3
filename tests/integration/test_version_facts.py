"""The Slurm facts the product stands on, re-observed on each version's real daemons.

docs/testbed.md ("Slurm versions") has these facts as one table; this module is where each cell
is observed. FACTS holds what each version does; a test compares it with what the daemons of
this machine's Slurm (22.05 on Debian 12, 24.11 and 26.05 in the root filesystems of
.ci/rootfs.sh) do now, so a version that changes a fact fails here first.
"""
from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path
from typing import Dict, NamedTuple, Tuple

import pytest

import simgpu
from testbed import SlurmTestbed, run_slurmd_G, slurm_version

from .test_testbed import parse_env_file, wait_for_file

pytestmark = pytest.mark.slurm


class Facts(NamedTuple):
    nvml_plugin: bool             # Debian ships Slurm's gpu_nvml.so (AutoDetect=nvml works)
    start_only: bool              # HealthCheckNodeState=START_ONLY exists
    reboot_only: bool             # HealthCheckNodeState=REBOOT_ONLY exists
    health_check_timeout: bool    # HealthCheckTimeout exists (and must stay below HealthCheckInterval)
    sacctmgr_lowercases: bool     # `sacctmgr modify job ... set AdminComment=` lowercases the value
    env_uuid: bool                # gres.conf Flags=env_uuid exists
    hook_cuda_uuids: bool         # AutoDetect: CUDA_VISIBLE_DEVICES in prolog/epilog holds GPU UUIDs
    ordinal: bool                 # GPU_DEVICE_ORDINAL is set (gres.conf lines: yes; AutoDetect: ENV_NVML only)


FACTS: Dict[Tuple[int, int], Facts] = {
    (22, 5): Facts(nvml_plugin=False, start_only=False, reboot_only=False, health_check_timeout=False,
                   sacctmgr_lowercases=True, env_uuid=False, hook_cuda_uuids=False, ordinal=True),
    (24, 11): Facts(nvml_plugin=True, start_only=False, reboot_only=False, health_check_timeout=False,
                    sacctmgr_lowercases=False, env_uuid=False, hook_cuda_uuids=False, ordinal=False),
    (26, 5): Facts(nvml_plugin=True, start_only=True, reboot_only=True, health_check_timeout=True,
                   sacctmgr_lowercases=False, env_uuid=True, hook_cuda_uuids=True, ordinal=False),
}


@pytest.fixture(scope="module")
def facts() -> Facts:
    major, minor, _ = slurm_version()
    assert (major, minor) in FACTS, f"Slurm {major}.{minor} is not a version the testbed knows: add it to FACTS"
    return FACTS[(major, minor)]


def _slurmd_G_health(tmp_path: Path, munge, state: str) -> str:
    (tmp_path / "etc").mkdir(parents=True)
    (tmp_path / "etc" / "gres.conf").write_text("")
    (tmp_path / "etc" / "slurm.conf").write_text(
        "ClusterName=t\nSlurmctldHost=localhost\nHealthCheckProgram=/bin/true\nHealthCheckInterval=300\n"
        f"HealthCheckNodeState={state}\nNodeName=n1 CPUs=1\nPartitionName=p Nodes=n1\n")
    return run_slurmd_G(tmp_path / "etc" / "slurm.conf", "n1", munge)


@pytest.mark.parametrize("flag", ["START_ONLY", "REBOOT_ONLY"])
def test_health_check_node_state_flags_exist_where_the_version_has_them(flag, facts, slurmd_munge, tmp_path):
    alone = _slurmd_G_health(tmp_path / "alone", slurmd_munge, flag)
    combined = _slurmd_G_health(tmp_path / "combined", slurmd_munge, f"IDLE,{flag}")
    if getattr(facts, flag.lower()):
        assert "Invalid HealthCheckNodeState" not in alone and "fatal" not in alone, alone
        # 26.05: the flag stands alone; with another state slurmd refuses to start.
        assert f"HealthCheckNodeState={flag} cannot be combined" in combined, combined
    else:
        assert f"Invalid HealthCheckNodeState value {flag} ignored" in alone, alone


def test_health_check_timeout_must_stay_below_the_interval_where_it_exists(facts, slurmd_munge, tmp_path):
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "gres.conf").write_text("")
    (tmp_path / "etc" / "slurm.conf").write_text(
        "ClusterName=t\nSlurmctldHost=localhost\nHealthCheckProgram=/bin/true\nHealthCheckInterval=60\n"
        "NodeName=n1 CPUs=1\nPartitionName=p Nodes=n1\n")
    out = run_slurmd_G(tmp_path / "etc" / "slurm.conf", "n1", slurmd_munge)
    said = "HealthCheckTimeout (60) must be less than HealthCheckInterval (60)" in out
    assert said == facts.health_check_timeout, out


def test_sacctmgr_admin_comment_case_and_scontrol_keeps_it(slurm_testbed, facts):
    tb = slurm_testbed
    job = tb.sbatch("sleep 30", args=["--gres=gpu:1"])
    _wait_state(tb, job, "RUNNING")
    tb.run("scontrol", "update", f"JobId={job}", "AdminComment=Live:MiXeD")
    assert tb.job_info(job)["AdminComment"] == "Live:MiXeD"
    tb.run("scancel", str(job))
    assert tb.wait_job(job) == "CANCELLED"
    tb.wait_sacct(job)
    tb.run("sacctmgr", "-i", "modify", "job", "where", f"jobid={job}", "set", "AdminComment=JS1:AbC")
    seen = tb.run("sacct", "-X", "-n", "-P", "-j", str(job), "--format=AdminComment").stdout.strip()
    assert seen == ("js1:abc" if facts.sacctmgr_lowercases else "JS1:AbC"), seen


def _wait_state(tb: SlurmTestbed, job: int, state: str, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while tb.job_info(job).get("JobState") != state:
        assert time.monotonic() < end, tb.job_info(job)
        time.sleep(0.2)


# --------------------------------------------------------------------------- GPU variables

def _gpu_state(node: str, first_minor: int) -> Dict:
    prof = simgpu.h100_sxm(4, seed=node)
    for i, g in enumerate(prof["gpus"]):
        g["minor"] = first_minor + i
    return prof


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("gpu-vars")
    os.chmod(d, 0o755)
    for hook in ("prolog", "epilog"):
        (d / hook).write_text(textwrap.dedent(f"""\
            #!/bin/bash
            /usr/bin/env > {d}/{hook}-$SLURM_JOB_ID-$SLURMD_NODENAME
            """))
        os.chmod(d / hook, 0o755)
    return d


GPU_VARS = ("SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL")
JOB_DUMP = "echo SLURM_JOB_GPUS=$SLURM_JOB_GPUS; echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES; " \
           "echo GPU_DEVICE_ORDINAL=$GPU_DEVICE_ORDINAL"


def _observe(tb: SlurmTestbed, d: Path) -> Dict[str, Dict[str, str]]:
    """GPU variables a 2-GPU job on gpu02 sees in its prolog, its epilog and itself."""
    job = tb.sbatch(JOB_DUMP, args=["--gres=gpu:2", "-w", "gpu02"])
    assert tb.wait_job(job) == "COMPLETED", tb.job_output(job)
    seen = {"job": dict(line.split("=", 1) for line in tb.job_output(job).splitlines() if "=" in line)}
    for hook in ("prolog", "epilog"):
        env = parse_env_file(wait_for_file(d / f"{hook}-{job}-gpu02"))
        seen[hook] = {k: env.get(k, "") for k in GPU_VARS}
    return seen


def _uuids(state: Dict) -> list:
    return [g["uuid"] for g in state["gpus"]]


def _expect(seen: Dict[str, Dict[str, str]], facts: Facts, uuids: list) -> None:
    idx = seen["prolog"]["SLURM_JOB_GPUS"]
    assert idx in ("0,1", "2,3"), seen
    as_uuids = ",".join(uuids[int(i)] for i in idx.split(","))
    for where in ("prolog", "epilog", "job"):
        # Every version: SLURM_JOB_GPUS holds node-wide indices (not minors, not UUIDs) - what
        # the hooks read (slurm/jobenv.py).
        assert seen[where]["SLURM_JOB_GPUS"] == idx, seen
        hook = where != "job"
        want = as_uuids if hook and facts.hook_cuda_uuids and facts.nvml_plugin else idx
        assert seen[where]["CUDA_VISIBLE_DEVICES"] == want, seen
        assert seen[where]["GPU_DEVICE_ORDINAL"] == (idx if facts.ordinal else ""), seen


def test_gpu_variables_in_prolog_epilog_and_job(slurm_testbed_factory, dumps, facts, sim_lib, tmp_path_factory):
    # With AutoDetect where the version has it (the GPUs then carry their UUIDs into Slurm), else
    # the gres.conf the testbed writes. gpu02's GPUs are /dev/nvidia4-7: index != minor.
    states = {"gpu01": _gpu_state("gpu01", 0), "gpu02": _gpu_state("gpu02", 4)}
    work = tmp_path_factory.mktemp("gpu-vars-state")
    os.chmod(work, 0o755)
    node_env: Dict[str, Dict[str, str]] = {}
    for node, state in states.items():
        simgpu.write_state(work / f"{node}.state", state)
        node_env[node] = {"LD_LIBRARY_PATH": str(sim_lib.parent), "SIMNVML_STATE": str(work / f"{node}.state")}
    kwargs = dict(prolog=str(dumps / "prolog"), epilog=str(dumps / "epilog"), extra_node_env=node_env)
    if facts.nvml_plugin:
        kwargs["gres_conf"] = "AutoDetect=nvml\n"
    uuids = _uuids(states["gpu02"])
    _expect(_observe(slurm_testbed_factory(**kwargs), dumps), facts, uuids)
    if facts.env_uuid:
        # 26.05's Flags=env_uuid (gres.conf(5): UUIDs in CUDA_VISIBLE_DEVICES): observed with
        # task/none, the job itself still sees indices and the hooks see what they saw without it.
        kwargs["gres_conf"] = "AutoDetect=nvml\nName=gpu Flags=env_uuid\n"
        _expect(_observe(slurm_testbed_factory(**kwargs), dumps), facts, uuids)
