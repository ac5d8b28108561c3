"""What the integration tests share, imported from here alone (``from .sites import ...``): the
simulated site a shared cluster's hooks run on, the wrappers slurmd runs, and the small waits and
reads on Slurm's state that several modules use.  docs/testbed.md, "Shared clusters".

A module's differences from another are state it sets on a shared cluster (its Site's
slurm-gpu.toml, its hook scripts), never a cluster of its own: see tests/integration/conftest.py.
"""
from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest
import simgpu
from testbed import parse_gres_records, run_slurmd_G, unavailable

from slurm_gpu.slurm import hostlist

REPO = Path(__file__).resolve().parents[2]

# The session's cluster factories (conftest.py): a Site's teardown turns their hooks off first.
FACTORIES: List[Any] = []


def hooks_off_everywhere() -> None:
    """Every shared cluster's hooks off and idle: before a module's site (the files its hooks read)
    goes away, and after each module."""
    for factory in FACTORIES:
        factory.hooks_off()


def hook_script(name: str) -> str:
    """An installed entry point (slurm-gpu-prolog, ...) by absolute path: slurmd runs hooks without PATH."""
    path = os.path.join(os.path.dirname(sys.executable), name)
    return path if os.path.exists(path) else shutil.which(name) or pytest.fail(f"{name} is not installed (pip install -e .)")


def healthcheck_wrapper(tmp: Path, cfg: Path, states: Path, slurm_conf: Path) -> Path:
    """docs/admin-guide.md's HealthCheckProgram wrapper: slurmd passes no arguments, no PATH and no
    SLURM_CONF (only SLURMD_NODENAME), so the wrapper sets what is site-specific."""
    wrapper = tmp / "slurm-gpu-healthcheck"
    wrapper.write_text(f"""#!/bin/sh
export SLURM_CONF={slurm_conf}
export SLURM_GPU_CONFIG={cfg}
export SIMNVML_STATE={states}/"$SLURMD_NODENAME".state
export PYTHONPATH={REPO}
exec {sys.executable} -m slurm_gpu.cli healthcheck
""")
    wrapper.chmod(0o755)
    return wrapper


class Site:
    """Per-node simulated GPUs, databases and logs for the two-node cluster."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o755)
        self.lib = simgpu.build(root / "lib", default_state=str(root / "%n.state"))
        self.minors = {"gpu01": [0, 1, 2, 3], "gpu02": [4, 5, 6, 7]}
        self.reset()

    def reset(self) -> None:
        for node, minors in self.minors.items():
            shutil.rmtree(self.root / node, ignore_errors=True)  # database, spool and log of the last test
            prof = simgpu.h100_sxm(4, seed=node)
            for g, m in zip(prof["gpus"], minors):
                g["minor"] = m
            simgpu.write_state(self.state(node), prof)
            (self.root / f"{node}.kmsg").write_text("")

    def state(self, node: str) -> Path:
        return self.root / f"{node}.state"

    def db(self, node: str) -> Path:
        return self.root / node / "usage.db"

    def log(self, node: str) -> str:
        p = self.root / node / "hooks.log"
        return p.read_text() if p.exists() else ""

    def rows(self, node: str, sql: str, *args):
        if not self.db(node).exists():
            return []
        conn = sqlite3.connect(str(self.db(node)))
        conn.row_factory = sqlite3.Row
        try:
            return [dict(r) for r in conn.execute(sql, args)]
        finally:
            conn.close()

    def config(self) -> str:
        r = self.root
        return (f'nvml_library = "{self.lib}"\nnvml_timeout_s = 2.0\nslurm_timeout_s = 10.0\n'
                f'[store]\ndatabase = "{r}/%n/usage.db"\nspool_dir = "{r}/%n/spool"\nbusy_timeout_s = 1.0\n'
                f'[log]\nsyslog = false\nfile = "{r}/%n/hooks.log"\n'
                f'[xid]\nsource = "file:{r}/%n.kmsg"\n'
                '[hooks]\nprolog_deadline_s = 20\nepilog_deadline_s = 30\nkill_grace_s = 1.0\n'
                f'healthcheck_lock_file = "{r}/%n/healthcheck.lock"\n')


def site_fixture(cls: type, name: str) -> Callable[..., Any]:
    """A module's `site` fixture: a `cls` (a Site) under /tmp/slurm-gpu-<name>-<pid>, removed after
    the shared clusters' hooks are off (they read its files)."""
    @pytest.fixture(scope="module")
    def site():
        s = cls(Path("/tmp") / f"slurm-gpu-{name}-{os.getpid()}")
        yield s
        hooks_off_everywhere()
        shutil.rmtree(s.root, ignore_errors=True)
    return site


def hooked_cluster(site: Site, factory: Callable[..., Any], **extra: Any) -> Any:
    """The two-node cluster with slurm-gpu's prolog and epilog on `site`'s config (testbed kwargs in extra)."""
    site.reset()
    return factory(prolog=hook_script("slurm-gpu-prolog"), epilog=hook_script("slurm-gpu-epilog"),
                   slurm_gpu_config=site.config(), prolog_epilog_timeout=60, **extra)


def play_work(site: Site, node: str, gpu: int, *, energy_j: float, pid: int, util: int, mem_util: int,
              peak_bytes: int, busy_ms: int) -> None:
    """The simulated driver plays a job's work on one GPU: energy counted, one process accounted."""
    simgpu.set_gpu(site.state(node), gpu, energy_mj=1_000_000_000 + int(energy_j * 1000),
                   acct=[dict(pid=pid, gpu_util=util, mem_util=mem_util, max_mem_bytes=peak_bytes, time_ms=busy_ms,
                              start_time_us=int(time.time() * 1e6), is_running=0)])


def wait_running(bed: Any, site: Site, node: str, job_id: int, timeout: float = 30) -> None:
    """Until the job's prolog has passed: with PrologFlags=Alloc a job is RUNNING while its prolog runs."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if f"prolog pass job={job_id} " in site.log(node) and bed.job_info(job_id).get("JobState") == "RUNNING":
            return
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} did not start: {bed.job_info(job_id)}\n{site.log(node)}")


def node_reasons(bed: Any) -> List[Dict[str, str]]:
    """Every node with a reason (sinfo -R): node, reason."""
    out = []
    for line in bed.run("sinfo", "-h", "-N", "-R", "-o", "%N|%E").stdout.splitlines():
        node, _, reason = line.partition("|")
        out.append({"node": node.strip(), "reason": reason.strip()})
    return out


# --------------------------------------------------------------------------- remediation on real Slurm

def power_cycle(site: Site, node: str) -> None:
    """What a power cycle does to the simulated GPUs (a testbed on_reboot=): a pending remap is applied;
    anything else (a fault only a diagnostic sees) stays."""
    state = simgpu.read_state(site.state(node))
    for i in range(4):
        if state.get(f"gpu.{i}.remapped_pending", "0") != "0":
            simgpu.set_gpu(site.state(node), i, remapped_pending=0, reset_sticky=0)


class RemediationSite(Site):
    """The stand-in nvidia-smi resets GPUs of the simulated driver; verification is quick."""

    def config(self) -> str:
        cmd = [sys.executable, str(simgpu.STAND_IN_NVIDIA_SMI), "--state", f"{self.root}/%n.state", "--gpu-reset",
               "-i", "{pci_bus_id}"]
        return super().config() + ("[remediation]\nreset_command = [%s]\nverify_passes = 2\nverify_interval_s = 1\n"
                                   'lock_file = "%s/%%n/remediate.lock"\n' % (", ".join(f'"{a}"' for a in cmd), self.root))


class VerifySite(Site):
    """The verification job's battery: the stand-in dcgmi and all_reduce_perf on the simulated GPUs (their
    state through SIMNVML_STATE with %n, which the job inherits from sbatch), short deadlines."""

    START_TIMEOUT_S = 5
    TIMEOUT_S = 20

    def config(self) -> str:
        nccl = [str(simgpu.STAND_IN_ALL_REDUCE_PERF), "-b", "8M", "-e", "256M", "-f", "2", "-g", "{gpus}"]
        return super().config() + (
            '[verify]\nenabled = true\ndcgm_level = 2\ndcgmi = "%s"\nnccl_command = [%s]\n'
            'nccl_min_busbw_gbps = {"NVIDIA H100 80GB HBM3" = 300.0}\nstart_timeout_s = %d\ntimeout_s = %d\n'
            % (simgpu.STAND_IN_DCGMI, ", ".join(f'"{a}"' for a in nccl), self.START_TIMEOUT_S, self.TIMEOUT_S))

    def job_env(self) -> Dict[str, str]:
        """What the submitter adds to its environment for the stand-ins (sbatch exports it to the job)."""
        return {"SIMNVML_STATE": f"{self.root}/%n.state"}


class CrashSite(Site):
    """Resets go through reset.sh: `begin` and `end` lines in resets.log, sleeps from pre_s and post_s,
    and, when appear.pid exists, a process that shows up on the GPU right before the reset."""

    def reset(self) -> None:
        super().reset()
        for name in ("resets.log", "appear.pid"):
            (self.root / name).unlink(missing_ok=True)
        self.slow(0, 0)

    def slow(self, pre: float, post: float) -> None:
        (self.root / "pre_s").write_text(f"{pre}\n")
        (self.root / "post_s").write_text(f"{post}\n")

    def reset_log(self) -> str:
        p = self.root / "resets.log"
        return p.read_text() if p.exists() else ""

    def config(self) -> str:
        script = self.root / "reset.sh"
        r = self.root
        script.write_text(f"""#!/bin/sh
echo "begin $SLURMD_NODENAME $1 $$ $(date +%s.%N)" >> {r}/resets.log
sleep "$(cat {r}/pre_s)"
if [ -f {r}/appear.pid ]; then
  {sys.executable} -c 'import sys; sys.path.insert(0, "{simgpu.HERE}"); import simgpu; \
simgpu.set_gpu(sys.argv[1], 2, procs=[(int(open(sys.argv[2]).read()), 1 << 30)])' {r}/"$SLURMD_NODENAME".state {r}/appear.pid
fi
{sys.executable} {simgpu.STAND_IN_NVIDIA_SMI} --state {r}/"$SLURMD_NODENAME".state --gpu-reset -i "$1" || rc=$?
sleep "$(cat {r}/post_s)"
echo "end $SLURMD_NODENAME $1 $$ $(date +%s.%N)" >> {r}/resets.log
exit ${{rc:-0}}
""")
        script.chmod(0o755)
        return super().config() + ("[remediation]\nreset_command = [\"%s\", \"{pci_bus_id}\"]\nverify_passes = 2\n"
                                   'verify_interval_s = 0.5\nreset_timeout_s = 30\nlock_file = "%s/%%n/remediate.lock"\n'
                                   % (script, r))


def remediate(cluster: Any, node: str) -> "subprocess.CompletedProcess[str]":
    env = dict(cluster.env, SLURMD_NODENAME=node)
    return subprocess.run([hook_script("slurm-gpu"), "remediate", "--node", node], env=env, capture_output=True,
                          text=True, timeout=120)


def drained_by_prolog(cluster: Any, site: Site) -> float:
    """A 4-GPU job lands on gpu01, whose prolog drains it; the job runs on gpu02. When gpu01 was drained."""
    job = cluster.sbatch("sleep 1", args=["-p", "gpu", "--gres=gpu:4"])
    assert cluster.wait_job(job, timeout=90) == "COMPLETED"
    assert cluster.job_info(job)["NodeList"] == "gpu02", site.log("gpu01")
    reasons = {r["node"]: r["reason"] for r in node_reasons(cluster)}
    assert reasons.get("gpu01", "").startswith("slurm-gpu: ") and f"[prolog job {job}; check " in reasons["gpu01"], reasons
    return time.time()


def jobs_on(cluster: Any, node: str, since: float, until: float) -> List[tuple]:
    """(job, start, end) of every job Slurm's accounting has on the node that overlaps [since, until]."""
    r = cluster.run("sacct", "-n", "-P", "-X", "-a", "-N", node, "-S", "now-1hour", "-E", "now",
                    "--format=JobID,Start,End,NodeList", "-o", "JobID,Start,End")
    out = []
    for line in r.stdout.splitlines():
        jid, start, end = line.split("|")[:3]
        ts = lambda v: time.mktime(time.strptime(v, "%Y-%m-%dT%H:%M:%S")) if v[:1].isdigit() else float("inf")  # noqa: E731
        if ts(start) < until and ts(end) > since:
            out.append((jid, start, end))
    return out


# --------------------------------------------------------------------------- what a job and a hook see

PROBE = textwrap.dedent("""\
    echo "user=$(id -un)"
    echo "node=$SLURMD_NODENAME"
    echo "gpus=$SLURM_JOB_GPUS"
    echo "cvd=$CUDA_VISIBLE_DEVICES"
    echo "account=$SLURM_JOB_ACCOUNT"
""")


def parse_probe(text: str) -> Dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def parse_env_file(path: Path) -> Dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def wait_for_file(path: Path, timeout: float = 20) -> Path:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)
    time.sleep(0.1)  # let the writer finish
    return path


# --------------------------------------------------------------------------- slurmd -G alone

def need_slurmd() -> str:
    if os.geteuid() != 0:
        unavailable("needs root (device files, slurmd)")
    exe = shutil.which("slurmd", path="/usr/sbin:/usr/bin:/sbin:/bin:" + os.environ.get("PATH", ""))
    if not exe:
        unavailable("slurmd is not installed (apt-get install slurmd)")
    return exe


def slurmd_order(conf_dir: Path, node: str, munge: Any) -> List[str]:
    """Device files of the node's GPU GRES records in slurmd's index order (`slurmd -G`)."""
    need_slurmd()
    output = run_slurmd_G(conf_dir / "slurm.conf", node, munge)
    out = []
    for rec in parse_gres_records(output):
        if "nvidia-caps" in rec.files:
            out.append(rec.files)  # one MIG record: its files as one entry
        else:
            out.extend(hostlist.expand(rec.files))
    assert out, f"slurmd -G printed no GPU records:\n{output}"
    return out
