"""The Slurm facts the product stands on, re-observed on each version's real daemons.

docs/testbed.md ("Slurm versions") has these facts as one table; this module is where each cell
is observed. FACTS holds what each version does; a test compares it with what the daemons of
this machine's Slurm (22.05 on Debian 12, 24.11 and 26.05 in the root filesystems of
.ci/rootfs.sh) do now, so a version that changes a fact fails here first.
"""
from __future__ import annotations

import os
import pwd
import re
import textwrap
import time
from pathlib import Path
from typing import Any, Dict, NamedTuple, Tuple

import pytest
import simgpu
from testbed import JOB_USER, SlurmTestbed, run_slurmd_G, slurm_version

from .sites import Site, hook_script, parse_env_file, site_fixture, wait_for_file

pytestmark = pytest.mark.slurm


class Facts(NamedTuple):
    nvml_plugin: bool             # Debian ships Slurm's gpu_nvml.so (contrib's slurm-wlm-nvml-plugin)
    start_only: bool              # HealthCheckNodeState=START_ONLY exists
    reboot_only: bool             # HealthCheckNodeState=REBOOT_ONLY exists
    health_check_timeout: bool    # HealthCheckTimeout exists (and must stay below HealthCheckInterval)
    split_timeouts: bool          # PrologTimeout and EpilogTimeout exist beside PrologEpilogTimeout (25.05+)
    sacctmgr_lowercases: bool     # `sacctmgr modify job ... set AdminComment=` lowercases the value
    env_uuid: bool                # gres.conf Flags=env_uuid exists
    hook_cuda_uuids: bool         # AutoDetect: CUDA_VISIBLE_DEVICES in prolog/epilog holds GPU UUIDs
    ordinal: bool                 # GPU_DEVICE_ORDINAL set under AutoDetect (its records: ENV_NVML only); gres.conf lines set it
    job_cgroup: str               # the job's cgroup/v1 freezer path (proctrack/cgroup), {node} {uid} {job} filled in


FACTS: Dict[Tuple[int, int], Facts] = {
    (22, 5): Facts(nvml_plugin=False, start_only=False, reboot_only=False, health_check_timeout=False,
                   split_timeouts=False, sacctmgr_lowercases=True, env_uuid=False, hook_cuda_uuids=False, ordinal=True,
                   job_cgroup="/slurm_{node}/uid_{uid}/job_{job}/step_batch"),
    (24, 11): Facts(nvml_plugin=True, start_only=False, reboot_only=False, health_check_timeout=False,
                    split_timeouts=False, sacctmgr_lowercases=False, env_uuid=False, hook_cuda_uuids=False, ordinal=False,
                    job_cgroup="/slurm_{node}/uid_{uid}/job_{job}/step_batch"),
    (26, 5): Facts(nvml_plugin=True, start_only=True, reboot_only=True, health_check_timeout=True,
                   split_timeouts=True, sacctmgr_lowercases=False, env_uuid=True, hook_cuda_uuids=True, ordinal=False,
                   job_cgroup="/slurm_{node}/uid_{uid}/job_{job}/step_batch"),
}


def nvml_plugin_installed() -> bool:
    """Whether this machine has Slurm's NVML plugin: Debian 13 and unstable ship it in contrib
    (.ci/rootfs.sh installs it), a machine with main alone does not have it."""
    return any(os.path.exists(os.path.join(d, "gpu_nvml.so"))
               for d in ("/usr/lib/x86_64-linux-gnu/slurm-wlm", "/usr/lib/aarch64-linux-gnu/slurm-wlm", "/usr/lib/slurm"))


@pytest.fixture(scope="module")
def facts() -> Facts:
    major, minor, _ = slurm_version()
    assert (major, minor) in FACTS, f"Slurm {major}.{minor} is not a version the testbed knows: add it to FACTS"
    return FACTS[(major, minor)]


def _slurmd_G_with(tmp_path: Path, munge, lines: str) -> str:
    """`slurmd -G` on a one-node slurm.conf with these lines: what the version says of them."""
    (tmp_path / "etc").mkdir(parents=True)
    (tmp_path / "etc" / "gres.conf").write_text("")
    (tmp_path / "etc" / "slurm.conf").write_text(
        f"ClusterName=t\nSlurmctldHost=localhost\n{lines}NodeName=n1 CPUs=1\nPartitionName=p Nodes=n1\n")
    return run_slurmd_G(tmp_path / "etc" / "slurm.conf", "n1", munge)


def _slurmd_G_health(tmp_path: Path, munge, state: str) -> str:
    return _slurmd_G_with(tmp_path, munge, "HealthCheckProgram=/bin/true\nHealthCheckInterval=300\n"
                                           f"HealthCheckNodeState={state}\n")


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
    out = _slurmd_G_with(tmp_path, slurmd_munge, "HealthCheckProgram=/bin/true\nHealthCheckInterval=60\n")
    said = "HealthCheckTimeout (60) must be less than HealthCheckInterval (60)" in out
    assert said == facts.health_check_timeout, out


def test_prolog_and_epilog_timeouts_are_separate_keys_where_the_version_has_them(facts, slurmd_munge, tmp_path):
    """What deploy/ansible sets: PrologTimeout and EpilogTimeout where they exist (25.05+), and
    PrologEpilogTimeout alone before, where the separate keys stop the daemons."""
    out = _slurmd_G_with(tmp_path, slurmd_munge, "PrologEpilogTimeout=120\nPrologTimeout=60\nEpilogTimeout=120\n")
    refused = re.search(r"unrecognized key: (PrologTimeout|EpilogTimeout)", out, re.I)
    assert (refused is None) == facts.split_timeouts and (refused is None or "fatal" in out), out


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

site = site_fixture(Site, "facts")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> Path:
    """Prolog and epilog: dump the environment, then run our own hook, as slurmd would."""
    d = tmp_path_factory.mktemp("gpu-vars")
    os.chmod(d, 0o755)
    for hook in ("prolog", "epilog"):
        (d / hook).write_text(textwrap.dedent(f"""\
            #!/bin/bash
            {{ /usr/bin/env; echo "CGROUP_FREEZER=$(grep :freezer: /proc/self/cgroup | cut -d: -f3)"; }} \\
                > {d}/{hook}-$SLURM_JOB_ID-$SLURMD_NODENAME
            exec {hook_script(f"slurm-gpu-{hook}")}
            """))
        os.chmod(d / hook, 0o755)
    return d


GPU_VARS = ("SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL", "CGROUP_FREEZER")
JOB_DUMP = "echo SLURM_JOB_GPUS=$SLURM_JOB_GPUS; echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES; " \
           "echo GPU_DEVICE_ORDINAL=$GPU_DEVICE_ORDINAL; " \
           "echo CGROUP_FREEZER=$(grep :freezer: /proc/self/cgroup | cut -d: -f3); " \
           "for m in 4 5 6 7; do head -c1 /dev/nvidia$m >/dev/null 2>/tmp/e$$; " \
           "grep -q 'not permitted' /tmp/e$$ || echo OPENS=/dev/nvidia$m; done; rm -f /tmp/e$$"


def _observe(tb: SlurmTestbed, d: Path, site: Site, blocker: bool) -> Dict[str, Dict[str, str]]:
    """GPU variables a 2-GPU job on gpu02 sees in its prolog, its epilog and itself, and the GPUs
    our hooks recorded for it.  With `blocker` a 1-GPU job holds gpu02's first GPU meanwhile: the probe
    gets GPUs 1 and 2, so a job-side renumbering (ConstrainDevices) shows.  (Under AutoDetect 24.11 and
    26.05 kept such a probe pending on Resources with 3 GPUs and 3 CPUs free, disable-binding or not.)"""
    if blocker:
        held = tb.sbatch("sleep 60", args=["--gres=gpu:1", "-w", "gpu02"])
        _wait_state(tb, held, "RUNNING")
    # disable-binding: under AutoDetect each GPU has its cores, and the blocker's CPU may be the one
    # the free GPUs are bound to (24.11 and 26.05 then kept the probe pending on Resources).
    job = tb.sbatch(JOB_DUMP, args=["--gres=gpu:2", "--gres-flags=disable-binding", "-w", "gpu02"])
    end = time.monotonic() + 30
    while tb.job_info(job).get("JobState") == "PENDING":
        assert time.monotonic() < end, (tb.run("scontrol", "-d", "show", "node", "gpu02").stdout,
                                        tb.run("scontrol", "-d", "show", "job").stdout)
        time.sleep(0.3)
    assert tb.wait_job(job) == "COMPLETED", tb.job_output(job)
    if blocker:
        tb.run("scancel", str(held))
    lines = tb.job_output(job).splitlines()
    seen = {"job": dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("OPENS="))}
    seen["job"]["OPENS"] = ",".join(line[6:] for line in lines if line.startswith("OPENS="))
    seen["job"]["JOB_ID"] = str(job)
    for hook in ("prolog", "epilog"):
        env = parse_env_file(wait_for_file(d / f"{hook}-{job}-gpu02"))
        seen[hook] = {k: env.get(k, "") for k in GPU_VARS}
    end = time.monotonic() + 30
    while not site.rows("gpu02", "SELECT 1 FROM job_gpus WHERE job_id = ? AND end_time IS NOT NULL", job):
        assert time.monotonic() < end, site.log("gpu02")
        time.sleep(0.2)
    rows = site.rows("gpu02", "SELECT gpu_uuid FROM job_gpus WHERE job_id = ? ORDER BY gpu_index", job)
    seen["recorded"] = {"uuids": ",".join(r["gpu_uuid"] for r in rows)}
    return seen


def _uuids(node: str) -> list:
    """The node's GPU UUIDs in device-minor order (Site.reset's GPUs): Slurm GPU k on gpu02 is
    /dev/nvidia(4+k) both with the testbed's gres.conf and under AutoDetect."""
    return [g["uuid"] for g in simgpu.h100_sxm(4, seed=node)["gpus"]]


def _expect(seen: Dict[str, Dict[str, str]], facts: Facts, uuids: list, autodetect: bool, cgroups: bool) -> None:
    idx = seen["prolog"]["SLURM_JOB_GPUS"]
    assert idx == ("0,1" if autodetect else "1,2"), seen
    as_uuids = ",".join(uuids[int(i)] for i in idx.split(","))
    for where in ("prolog", "epilog", "job"):
        # Every version: SLURM_JOB_GPUS holds node-wide indices (not minors, not UUIDs) - what
        # the hooks read (slurm/jobenv.py).
        assert seen[where]["SLURM_JOB_GPUS"] == idx, seen
        hook = where != "job"
        want = as_uuids if hook and facts.hook_cuda_uuids and autodetect else idx
        if not hook and cgroups:
            want = "0,1"  # ConstrainDevices: the job sees its two GPUs only, numbered from 0
        assert seen[where]["CUDA_VISIBLE_DEVICES"] == want, seen
        ordinal = "0,1" if not hook and cgroups else idx  # renumbered in the job like CUDA_VISIBLE_DEVICES
        assert seen[where]["GPU_DEVICE_ORDINAL"] == (ordinal if facts.ordinal or not autodetect else ""), seen
    # And our hooks judged and recorded exactly those GPUs.
    assert seen["recorded"]["uuids"] == as_uuids, seen
    if cgroups:
        # The job runs in its cgroup; the prolog and epilog run outside every job's cgroup (slurmd's),
        # PrologFlags=Contain or not.  Only the job's own device files open (gpu02's are nvidia4-7).
        job = seen["job"]["JOB_ID"]
        want_cg = facts.job_cgroup.format(node="gpu02", uid=pwd.getpwnam(JOB_USER).pw_uid, job=job)
        assert seen["job"]["CGROUP_FREEZER"] == want_cg, seen
        for hook in ("prolog", "epilog"):
            assert f"job_{job}" not in seen[hook]["CGROUP_FREEZER"], seen
        assert seen["job"]["OPENS"] == ",".join(f"/dev/nvidia{4 + int(i)}" for i in idx.split(",")), seen


def test_gpu_variables_in_prolog_epilog_and_job(slurm_testbed_factory, dumps, facts, site):
    # With AutoDetect where the version has it (slurmd then names the GPUs by NVML, UUIDs
    # included), else the gres.conf the testbed writes. gpu02's GPUs are /dev/nvidia4-7.
    site.reset()
    node_env = {n: {"LD_LIBRARY_PATH": str(site.lib.parent), "SIMNVML_STATE": str(site.state(n))}
                for n in ("gpu01", "gpu02")}
    kwargs: Dict[str, Any] = dict(prolog=str(dumps / "prolog"), epilog=str(dumps / "epilog"),
                                  extra_node_env=node_env, slurm_gpu_config=site.config())
    # AutoDetect where this machine has the plugin its Debian ships (a Debian 13 without contrib
    # has not: then the testbed's gres.conf, as on 22.05).
    autodetect = facts.nvml_plugin and nvml_plugin_installed()
    if autodetect:
        kwargs["gres_conf"] = "AutoDetect=nvml\n"
    uuids = _uuids("gpu02")
    bed = slurm_testbed_factory(**kwargs)
    _expect(_observe(bed, dumps, site, not autodetect), facts, uuids, autodetect, bool(bed.cgroups))
    if facts.env_uuid and autodetect:
        # 26.05's Flags=env_uuid (gres.conf(5): UUIDs in CUDA_VISIBLE_DEVICES): observed with
        # task/none, the job itself still sees indices and the hooks see what they saw without it.
        kwargs["gres_conf"] = "AutoDetect=nvml\nName=gpu Flags=env_uuid\n"
        bed = slurm_testbed_factory(**kwargs)
        _expect(_observe(bed, dumps, site, not autodetect), facts, uuids, autodetect, bool(bed.cgroups))
