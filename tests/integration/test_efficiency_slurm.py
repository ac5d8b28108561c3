"""Issue 38 on real Slurm: jobs run on simulated GPUs whose utilisation the test sets while they run, each
node's timer is played by `slurm-gpu efficiency run` on both nodes every second (minutes scaled to
seconds in the config), the mails go to a real SMTP server on 127.0.0.1 (aiosmtpd's server process), and
Slurm's own records (squeue, sacct) say what happened to each job.  Only testbed APIs: the same test
runs on every Slurm the testbed has."""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time

import pytest
import simgpu
from smtpserver import SmtpServer, free_port

from .sites import Site, hooked_cluster, site_fixture, wait_running

pytestmark = pytest.mark.slurm

NOTIFY_S, CANCEL_S = 6, 14


class EfficiencySite(Site):
    """Minutes become seconds: sampled every second, mailed after 6 s idle, cancelled after 14 s."""

    def __init__(self, root):
        self.smtp_port = free_port()
        super().__init__(root)

    def config(self) -> str:
        return super().config() + (
            f"[efficiency]\nsample_every_s = 1\ngrace_s = 0\nnotify_after_s = {NOTIFY_S}\ncancel_after_s = {CANCEL_S}\n"
            f'mail_retry_s = 1\nlive_summary_every_s = 1\nexempt_accounts = ["chem"]\n'
            f'smtp_server = "127.0.0.1:{self.smtp_port}"\n'
            'mail_domain = "example.org"\njob_url = "https://ood.example.org/jobstats?jobid={job_id}"\n')


site = site_fixture(EfficiencySite, "efficiency")


@pytest.fixture
def cluster(site, slurm_testbed_factory):
    return hooked_cluster(site, slurm_testbed_factory)


def _run(cluster, node, *args):
    env = dict(cluster.env, SLURMD_NODENAME=node, SLURM_GPU_CONFIG=str(cluster.conf_dir / "slurm-gpu.toml"))
    return subprocess.run([sys.executable, "-m", "slurm_gpu.cli", "efficiency", *args, "--node-name", node],
                          env=env, capture_output=True, text=True, timeout=60)


def _samples(site, node):
    if not site.db(node).exists():
        return 0
    conn = sqlite3.connect(str(site.db(node)))
    try:
        return conn.execute("SELECT count(*) FROM job_samples").fetchone()[0]
    finally:
        conn.close()


def _sacct(cluster, job_id):
    out = cluster.run("sacct", "-n", "-P", "-X", "-j", str(job_id), "--format=JobID,State,AdminComment").stdout
    return [line.split("|") for line in out.splitlines() if line.split("|")[0] == str(job_id)]


def test_idle_jobs_are_warned_once_and_cancelled_busy_and_partly_idle_ones_never(cluster, site, tmp_path):
    smtp = SmtpServer(tmp_path / "smtp", port=site.smtp_port)  # down at first: the warnings must wait for it
    for i in range(4):
        simgpu.set_gpu(site.state("gpu02"), i, gpu_util=80)  # gpu02 works; gpu01's GPUs stay at 0 %
    idle = cluster.sbatch("sleep 300", args=["-p", "gpu", "-w", "gpu01", "-A", "physics", "--gres=gpu:1"])
    exempt = cluster.sbatch("sleep 300", args=["-p", "gpu", "-w", "gpu01", "-A", "chem", "--gres=gpu:1"])
    busy = cluster.sbatch("sleep 300", args=["-p", "gpu", "-w", "gpu02", "-A", "physics", "--gres=gpu:1"])
    both = cluster.sbatch("sleep 300", args=["-p", "gpu", "-N", "2", "-w", "gpu[01-02]", "-A", "physics",
                                             "--gres=gpu:1"])
    for job, node in ((idle, "gpu01"), (exempt, "gpu01"), (busy, "gpu02"), (both, "gpu01"), (both, "gpu02")):
        wait_running(cluster, site, node, job)
    try:
        started, failed_seen, samples_while_down = time.monotonic(), False, 0
        while time.monotonic() - started < 90:
            for node in ("gpu01", "gpu02"):
                r = _run(cluster, node, "run")
                assert r.returncode in (0, 1), r.stdout + r.stderr  # 1: a mail failed while the server is down
                failed_seen |= "mail failed" in r.stdout
            if failed_seen and smtp.proc is None and time.monotonic() - started > NOTIFY_S + 4:
                samples_while_down = _samples(site, "gpu01")
                smtp.start()  # the mail server comes back: the waiting warnings go out
            if cluster.job_info(idle).get("JobState") not in ("RUNNING", None, ""):
                break
            time.sleep(0.5)
        assert failed_seen, "the warnings were never tried while the mail server was down"
        assert samples_while_down > 0 and _samples(site, "gpu01") > samples_while_down, "sampling stopped"
        assert cluster.wait_job(idle, timeout=30) == "CANCELLED"
        # Neither the busy job, the exempt one nor the two-node job idle on one node was cancelled.
        for job in (exempt, busy, both):
            assert cluster.job_info(job).get("JobState") == "RUNNING", (job, cluster.job_info(job))
        # Exactly one warning and one cancel notice for the idle job, one warning for the exempt job.
        for _ in range(3):  # a run after the cancel must not mail again
            _run(cluster, "gpu01", "run")
        mails = smtp.wait_for(3, timeout=10)
        subjects = sorted(m["Subject"] for m in mails)
        assert len([s for s in subjects if s.startswith(f"[slurm-gpu] Job {idle}:")]) == 1, subjects
        assert len([s for s in subjects if s.startswith(f"[slurm-gpu] Job {idle} cancelled")]) == 1, subjects
        assert len([s for s in subjects if s.startswith(f"[slurm-gpu] Job {exempt}:")]) == 1, subjects
        assert all(m["To"] == "sgtest@example.org" for m in mails) and len(mails) == 3
        body = next(m for m in mails if m["Subject"].startswith(f"[slurm-gpu] Job {idle}:")).get_payload(decode=True)
        assert f"https://ood.example.org/jobstats?jobid={idle}".encode() in body
        # Slurm's accounting: CANCELLED, with our reason.
        deadline = time.monotonic() + 20
        while not (rows := _sacct(cluster, idle)) or not rows[0][1].startswith("CANCELLED"):
            assert time.monotonic() < deadline, rows
            time.sleep(0.5)
        assert rows[0][2].startswith("slurm-gpu cancelled this job: all GPUs (1) idle"), rows
        warned = [s for s in subjects if s.startswith(f"[slurm-gpu] Job {idle}: its GPU has been idle for ")]
        assert warned and NOTIFY_S <= int(warned[0].split()[-2]) < CANCEL_S, subjects
        # The record of what was done, for the admin.
        r = _run(cluster, "gpu01", "actions", "--json")
        assert r.returncode == 0, r.stderr
        acts = {(a["job_id"], a["stage"]): a for a in json.loads(r.stdout)}
        assert set(acts) == {(idle, "notify"), (idle, "cancel"), (exempt, "notify")}
        assert acts[(idle, "notify")]["mail_tries"] >= 2 and acts[(idle, "cancel")]["cancel_state"] == "done"
        r = _run(cluster, "gpu02", "actions", "--json")
        assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout
        # Its user sees a running job's figures so far, through Slurm (scontrol shows its AdminComment).
        from testbed import user_cli
        r = user_cli("sgtest", ["job", str(busy), "--format", "json"], dict(cluster.env))
        assert r.returncode == 0, r.stdout + r.stderr
        view = json.loads(r.stdout)
        assert view["summary"]["source"] == "live" and view["job"]["state"] == "RUNNING"
        assert [g["util_pct"] for g in view["gpus"]] == [80.0] and view["live"]["gpus"][0]["idle_s"] == 0
        assert 80 in view["live"]["gpus"][0]["last_hour_util_pct"]
        # The same figures as the node's samples up to the time the view is of.
        (util, peak, energy), = [tuple(r.values()) for r in site.rows(
            "gpu02", "SELECT SUM(gpu_util_pct * span_s) / SUM(span_s) AS u, MAX(memory_used_bytes) AS m, "
            "MAX(energy_j) AS e FROM job_samples WHERE job_id = ? AND time <= ?", busy, view["live"]["as_of"] + 0.1)]
        g = view["gpus"][0]
        assert g["util_pct"] == round(util, 1) and g["peak_mib"] == round(peak / (1 << 20))
        assert g["energy_wh"] == (None if energy is None else round(energy / 3600.0, 2))
        r = user_cli("sgtest", ["job", str(exempt)], dict(cluster.env))
        assert r.returncode == 0 and "LAST HOUR" in r.stdout and "Idle right now" not in r.stdout, r.stdout + r.stderr
    finally:
        smtp.stop()
        for job in (idle, exempt, busy, both):
            cluster.run("scancel", str(job), check=False)
        for job in (exempt, busy, both):
            cluster.wait_job(job, timeout=60)
    assert os.path.exists(site.db("gpu02"))


# --------------------------------------------------------------------------- jobs on several nodes: the central server


@pytest.fixture
def central(mariadb_server, tmp_path):
    from .test_job_summary_slurm import Central
    (tmp_path / "central").mkdir()
    return Central(mariadb_server, tmp_path / "central")


def _gpu_of(site, node, job, timeout=20):
    """The GPU the job's prolog recorded on the node (its log says "pass" a moment before the write)."""
    end = time.monotonic() + timeout
    while not (rows := site.rows(node, "SELECT gpu_index FROM job_starts WHERE job_id = ?", job)):
        assert time.monotonic() < end, f"no start record of job {job} on {node}"
        time.sleep(0.1)
    assert len(rows) == 1, rows
    return rows[0]["gpu_index"]


def test_a_job_on_two_nodes_is_judged_on_both_nodes_samples_on_the_central_server(cluster, site, central, tmp_path):
    """The nodes sample and push; a controller-side `efficiency enforce --db central` judges the jobs on
    several nodes: the one idle on both nodes is warned and cancelled, the one busy on one node gets
    advice only."""
    smtp = SmtpServer(tmp_path / "smtp", port=site.smtp_port).start()
    ctl = tmp_path / "ctl.toml"
    ctl.write_text(central.reporter.read_text().replace("[central]", (
        f'[store]\ndatabase = "{tmp_path}/ctl/usage.db"\nspool_dir = "{tmp_path}/ctl/spool"\n'
        f'[log]\nsyslog = false\nfile = "{tmp_path}/ctl/efficiency.log"\n'
        "[efficiency]" + site.config().split("[efficiency]")[1] + "[central]")))
    os.chmod(ctl, 0o644)
    idle = cluster.sbatch("sleep 300", args=["-p", "gpu", "-N", "2", "-w", "gpu[01-02]", "-A", "physics", "--gres=gpu:1"])
    half = cluster.sbatch("sleep 300", args=["-p", "gpu", "-N", "2", "-w", "gpu[01-02]", "-A", "physics", "--gres=gpu:1"])
    for job in (idle, half):
        for node in ("gpu01", "gpu02"):
            wait_running(cluster, site, node, job)
    simgpu.set_gpu(site.state("gpu02"), _gpu_of(site, "gpu02", half), gpu_util=80)  # half works on gpu02 only
    env = dict(cluster.env)
    try:
        started = time.monotonic()
        while time.monotonic() - started < 90:
            for node in ("gpu01", "gpu02"):
                r = _run(cluster, node, "run")
                assert r.returncode == 0, r.stdout + r.stderr
                assert "runs on 2 nodes" not in r.stdout  # the nodes leave it to the central run, quietly
                r = subprocess.run([sys.executable, "-m", "slurm_gpu.cli", "--config", str(central.writer), "db", "push",
                                    "--quiet", "--db", str(site.db(node))], env=env, capture_output=True, text=True,
                                   timeout=60)
                assert r.returncode == 0, r.stdout + r.stderr
            r = subprocess.run([sys.executable, "-m", "slurm_gpu.cli", "--config", str(ctl), "efficiency", "enforce",
                                "--db", "central", "--node-name", "ctl"], env=env, capture_output=True, text=True,
                               timeout=60)
            assert r.returncode == 0, r.stdout + r.stderr
            if cluster.job_info(idle).get("JobState") not in ("RUNNING", None, ""):
                break
            time.sleep(0.5)
        assert cluster.wait_job(idle, timeout=30) == "CANCELLED"
        assert cluster.job_info(half).get("JobState") == "RUNNING"
        # The central run asks slurmctld about many jobs in one `scontrol show job`: the same fields.
        from slurm_gpu import config as config_mod
        from slurm_gpu.slurm.cli_backend import CliBackend
        backend = CliBackend(config_mod.load(str(ctl)), env=env)
        every = backend.job_records()
        assert every[half]["JobState"] == "RUNNING" and every[half] == backend.job_record(half)
        subjects = sorted(m["Subject"] for m in smtp.wait_for(3, timeout=10))
        assert sorted(s.split(":")[0] for s in subjects) == sorted([
            f"[slurm-gpu] Job {idle}", f"[slurm-gpu] Job {idle} cancelled", f"[slurm-gpu] Job {half}"]), subjects
        assert f"[slurm-gpu] Job {half}: 1 of its 2 GPUs are idle" in subjects
        assert f"[slurm-gpu] Job {idle}: its 2 GPUs have been idle for" in " ".join(subjects)
        # The controller's decisions reach the central server with its next push.
        r = subprocess.run([sys.executable, "-m", "slurm_gpu.cli", "--config", str(central.writer), "db", "push",
                            "--quiet", "--db", f"{tmp_path}/ctl/usage.db"], env=env, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        got = central.server.rows("SELECT node, job_id, stage, cancel_state FROM efficiency_actions ORDER BY job_id, stage",
                                  central.db)
        assert got == [["ctl", str(idle), "cancel", "done"], ["ctl", str(idle), "notify", "NULL"],
                       ["ctl", str(half), "advice", "NULL"]], got
    finally:
        smtp.stop()
        for job in (idle, half):
            cluster.run("scancel", str(job), check=False)
        cluster.wait_job(half, timeout=60)
