"""The controller epilog on the real testbed: every job's GPU summary in its AdminComment.

Nodes run the real prolog/epilog; a background loop plays the push timer (`db push` of both
node databases every second) into the session's MariaDB (tests/conftest.py `mariadb_server`), not
the testbed's, so that it can be stopped without stopping slurmdbd; slurmctld runs `slurm-gpu-epilog-ctld` (through a
wrapper that names the config: slurmctld gives EpilogSlurmctld no SLURM_CONF).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from mariadb import MariaDB
from testbed import slurm_version, unavailable

from slurm_gpu.store import summary as S

from .sites import hook_script, play_work, wait_running

pytestmark = pytest.mark.slurm


def _cli(env, *args, timeout=120):
    return subprocess.run([sys.executable, "-m", "slurm_gpu.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


class Central:
    """A fresh database per test (each test's testbed numbers its jobs from 1 again)."""

    def __init__(self, server: MariaDB, tmp: Path):
        self.server = server
        self.db = self.server.new_database("sgjobs")
        self.tmp = tmp
        self.admin = self._account("sg_admin", [f"GRANT ALL ON {self.db}.* TO 'sg_admin'@'%';"])
        # One writer account for the testbed's nodes (test_central_slurm gives each node its own).
        r = _cli(dict(os.environ), "--config", str(self.admin), "central", "init", "--cluster", "sgtest",
                 "--writers", "*", "--group", "slurm_gpu_writer", "--password-dir", str(tmp / "writers"))
        assert r.returncode == 0, r.stderr
        grants = [s for s in r.stdout.splitlines() if s.startswith("GRANT")]
        self.writer = self._account("slurm_gpu_writer", [g for g in grants if "slurm_gpu_writer" in g])
        self.reporter = self._account("slurm_gpu_reporter", [g for g in grants if "slurm_gpu_reporter" in g])

    def _account(self, user, grants, extra=""):
        password = self.server.new_user(user, grants)
        pw = self.tmp / f"{user}.password"
        pw.write_text(password + "\n")
        os.chmod(pw, 0o600)
        cfg = self.tmp / f"{user}.toml"
        cfg.write_text(f'cluster_name = "sgtest"\n{extra}[central]\nurl = "{self.server.url(user, self.db)}"\n'
                       f'password_file = "{pw}"\ntimeout_s = 3\n')
        os.chmod(cfg, 0o644)
        return cfg


@pytest.fixture(scope="module")
def central_server(mariadb_server):
    """The session's MariaDB (tests/conftest.py), not the testbed's: stopping it leaves slurmdbd be.
    The "central down" test starts it again itself (and tests/conftest.py after every test)."""
    return mariadb_server


@pytest.fixture
def central(central_server, tmp_path):
    return Central(central_server, tmp_path)


def _ctld_testbed(site, central, factory, tmp_path, users_config="", before=""):
    """A testbed whose slurmctld runs `slurm-gpu-epilog-ctld`, through a wrapper naming its config
    (reporter account, the testbed's slurm.conf, a 15 s wait): slurmctld passes it neither.
    `before`: a shell line the wrapper runs first (another tool's controller epilog; SLURM_CONF set)."""
    site.reset()
    ctld_cfg = tmp_path / "ctld.toml"
    wrapper = tmp_path / "epilog-ctld.sh"
    wrapper.write_text(f"#!/bin/sh\nSLURM_GPU_CONFIG={ctld_cfg} exec {hook_script('slurm-gpu-epilog-ctld')}\n")
    os.chmod(wrapper, 0o755)
    b = factory(prolog=hook_script("slurm-gpu-prolog"), epilog=hook_script("slurm-gpu-epilog"),
                slurm_gpu_config=site.config() + users_config, prolog_epilog_timeout=60,
                epilog_slurmctld=str(wrapper))
    if before:
        wrapper.write_text(f"#!/bin/sh\nexport SLURM_CONF={b.slurm_conf}\n{before}\n"
                           f"SLURM_GPU_CONFIG={ctld_cfg} exec {hook_script('slurm-gpu-epilog-ctld')}\n")
    ctld_cfg.write_text(central.reporter.read_text().replace(
        "[central]", f'slurm_conf = "{b.slurm_conf}"\n[job_summary]\nwait_s = 15\n'
                     f'[log]\nsyslog = false\nfile = "{tmp_path}/ctld.log"\n[central]'))
    os.chmod(ctld_cfg, 0o644)
    b.ctld_log = tmp_path / "ctld.log"
    return b


@pytest.fixture
def bed(site, central, slurm_testbed_factory, tmp_path):
    return _ctld_testbed(site, central, slurm_testbed_factory, tmp_path)


class PushTimer:
    """`db push` of both node databases every second, like the systemd timer (faster)."""

    def __init__(self, central: Central, site, bed):
        self.stop_flag = threading.Event()
        self.central, self.site, self.env = central, site, dict(bed.env)
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self.stop_flag.is_set():
            for node in ("gpu01", "gpu02"):
                if self.site.db(node).exists():
                    _cli(self.env, "--config", str(self.central.writer), "db", "push", "--quiet",
                         "--db", str(self.site.db(node)))
            self.stop_flag.wait(1.0)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop_flag.set()
        self.thread.join(timeout=30)


def admin_comment(bed, job):
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", str(job), "--format=JobIDRaw,AdminComment"],
                         env=dict(bed.env), capture_output=True, text=True, timeout=30).stdout
    return {line.split("|", 1)[0]: line.split("|", 1)[1] for line in out.splitlines() if "|" in line}


def wait_comment(bed, job, timeout=60, raw=None):
    end = time.monotonic() + timeout
    key = str(raw or job)
    while time.monotonic() < end:
        c = admin_comment(bed, job).get(key, "")
        if c:
            return c
        time.sleep(1)
    raise AssertionError(f"no AdminComment for job {job} after {timeout}s: "
                         f"{bed.ctld_log.read_text() if bed.ctld_log.exists() else '(no ctld log)'}")


def test_every_job_gets_a_summary_in_its_admin_comment_with_the_node_records_numbers(bed, site, central):
    with PushTimer(central, site, bed):
        busy = bed.sbatch("sleep 4", args=["-p", "gpu", "-w", "gpu01", "--gres=gpu:1"])
        idle = bed.sbatch("sleep 4", args=["-p", "gpu", "-w", "gpu02", "-A", "chem", "--gres=gpu:1"])
        wide = bed.sbatch("sleep 4", args=["-p", "gpu", "-N", "2", "--gres=gpu:1"])
        array = bed.sbatch("sleep 1", args=["-p", "gpu", "--gres=gpu:1", "--array=1-2"])
        het = bed.sbatch("sleep 1", args=["-p", "gpu", "--gres=gpu:1", ":", "-p", "gpu", "--gres=gpu:1"])
        wait_running(bed, site, "gpu01", busy)
        play_work(site, "gpu01", 0, energy_j=36_000, pid=4242, util=90, mem_util=40, peak_bytes=6 << 30, busy_ms=3000)
        for j in (busy, idle, wide):
            assert bed.wait_job(j, timeout=90) == "COMPLETED"
        comments = {j: S.decode(wait_comment(bed, j)) for j in (busy, idle, wide)}
        tasks = admin_comment(bed, array)
        assert len(tasks) == 2, tasks
        for raw in tasks:
            comments[int(raw)] = S.decode(wait_comment(bed, array, raw=raw))
        # A heterogeneous job: each component is a job of its own, under its raw id (het, het + 1).
        for raw in (het, het + 1):
            comments[raw] = S.decode(wait_comment(bed, het, raw=raw))
    b = comments[busy]
    assert b.job_id == busy and not b.partial and [g.node for g in b.gpus] == ["gpu01"]
    rec = site.rows("gpu01", "SELECT * FROM job_gpus WHERE job_id = ?", busy)[0]
    assert b.gpus[0].energy_wh == round(rec["energy_j"] / 3600, 2) == 10.0
    assert b.gpus[0].util_pct == round(rec["gpu_util_mean_pct"], 1) > 0
    assert b.gpus[0].peak_mib == 6 * 1024 and b.gpus[0].total_mib and b.gpus[0].total_mib > 6 * 1024
    assert comments[idle].gpus[0].util_pct in (0.0, None)
    assert sorted(g.node for g in comments[wide].gpus) == ["gpu01", "gpu02"] and not comments[wide].partial
    assert all(len(comments[int(raw)].gpus) == 1 and comments[int(raw)].job_id == int(raw) for raw in tasks)
    assert [comments[r].job_id for r in (het, het + 1)] == [het, het + 1]
    assert all(len(comments[r].gpus) == 1 and not comments[r].partial for r in (het, het + 1)), \
        [comments[r] for r in (het, het + 1)]
    # sacctmgr lowercased what it stored; the summary reads back all the same.
    assert wait_comment(bed, busy) == wait_comment(bed, busy).lower()
    # The measured GPU energy in Slurm's own accounting where sacctmgr may set a finished job's TRES
    # (25.11+): sacct's ConsumedEnergy within 0.1 % of the record (whole joules); before, none.
    settable = slurm_version()[:2] >= (25, 11)
    end = time.monotonic() + 20
    while True:
        energy = bed.run("sacct", "-X", "-n", "-P", "-j", str(busy), "-o", "ConsumedEnergyRaw").stdout.strip()
        if not settable or energy not in ("", "0") or time.monotonic() > end:
            break
        time.sleep(0.5)
    if settable:
        assert abs(int(energy) - rec["energy_j"]) <= max(1.0, rec["energy_j"] * 0.001), (energy, rec["energy_j"])
        alloc = bed.run("sacct", "-X", "-n", "-P", "-j", str(busy), "-o", "AllocTRES").stdout
        assert f"energy={int(energy)}" in alloc, alloc
    else:
        assert energy in ("", "0"), energy
    # The run's SLUID (SLURM_JOB_SLUID, 25.11+) in the node's records; from 26.05 sacct shows it and
    # takes it, and so does `slurm-gpu job`: the same run, its summary.
    sluids = {r["sluid"] for r in site.rows("gpu01", "SELECT sluid FROM job_gpus WHERE job_id = ?", busy)}
    sluids |= {r["sluid"] for r in site.rows("gpu01", "SELECT sluid FROM jobs WHERE job_id = ?", busy)}
    if slurm_version()[:2] >= (26, 5):
        shown = bed.run("sacct", "-X", "-n", "-P", "-j", str(busy), "-o", "SLUID").stdout.strip()
        assert sluids == {shown} and shown.startswith("s") and len(shown) == 14, (sluids, shown)
        r = _cli(dict(bed.env), "job", shown.lower(), "--format", "json")
        assert r.returncode == 0, r.stdout + r.stderr
        data = json.loads(r.stdout)
        assert data["job"]["job_id_raw"] == busy and [g["node"] for g in data["gpus"]] == ["gpu01"], data
    elif slurm_version()[:2] < (25, 11):
        assert sluids == {None}, sluids


def test_an_admin_comment_set_before_the_job_ends_is_left_as_it_was(bed, site, central):
    with PushTimer(central, site, bed):
        job = bed.sbatch("sleep 3", args=["-p", "gpu", "--gres=gpu:1"])
        bed.run("scontrol", "update", f"job={job}", "AdminComment=JS1:Keep-This")
        assert bed.wait_job(job, timeout=90) == "COMPLETED"
        time.sleep(5)
    assert admin_comment(bed, job)[str(job)] == "JS1:Keep-This"
    assert "AdminComment belongs to another tool" in bed.ctld_log.read_text()


def test_central_down_at_job_end_gives_a_partial_summary_that_annotate_completes(bed, site, central):
    job = bed.sbatch("sleep 3", args=["-p", "gpu", "-w", "gpu02", "--gres=gpu:2"])
    wait_running(bed, site, "gpu02", job)
    central.server.stop()
    try:
        assert bed.wait_job(job, timeout=90) == "COMPLETED"
        first = S.decode(wait_comment(bed, job, timeout=60))
    finally:
        central.server.start()
    assert first.partial and first.gpus == [] and first.missing == ["gpu02"]
    assert "central-unavailable" in bed.ctld_log.read_text()
    env = dict(bed.env)
    assert _cli(env, "--config", str(central.writer), "db", "push", "--db", str(site.db("gpu02"))).returncode == 0
    ctld_cfg = Path(str(bed.ctld_log).replace("ctld.log", "ctld.toml"))
    r = _cli(env, "--config", str(ctld_cfg), "central", "annotate", "--since", "now-1hour")
    assert r.returncode == 0 and "1 completed" in r.stdout, r.stdout + r.stderr
    done = S.decode(admin_comment(bed, job)[str(job)])
    assert not done.partial and len(done.gpus) == 2
    r = _cli(env, "--config", str(ctld_cfg), "central", "annotate", "--since", "now-1hour")
    assert r.returncode == 0 and "1 already complete" in r.stdout, r.stdout


@pytest.fixture
def private_bed(site, central, slurm_testbed_factory, tmp_path):
    """The users' config (slurm-gpu.toml beside slurm.conf) judging seconds-long jobs too; the
    testbed's slurmdbd.conf has PrivateData=jobs (what hides other users' jobs from sacct)."""
    return _ctld_testbed(site, central, slurm_testbed_factory, tmp_path, users_config="[job]\nmin_runtime_s = 1\n")


def test_users_see_their_own_jobs_gpu_use_and_advice_and_not_other_users_jobs(private_bed, site, central):
    import json
    import pwd

    from testbed import OTHER_USER, user_cli
    try:
        pwd.getpwnam(OTHER_USER)
    except KeyError:
        unavailable(f"user {OTHER_USER} missing (run .ci/install-deps.sh)")
    bed = private_bed
    with PushTimer(central, site, bed):
        busy = bed.sbatch("sleep 8", args=["-p", "gpu", "-w", "gpu01", "--gres=gpu:1"])
        idle = bed.sbatch("sleep 8", args=["-p", "gpu", "-w", "gpu02", "--gres=gpu:2"])
        wait_running(bed, site, "gpu01", busy)
        play_work(site, "gpu01", 0, energy_j=72_000, pid=4343, util=95, mem_util=50, peak_bytes=70 << 30, busy_ms=8000)
        for j in (busy, idle):
            assert bed.wait_job(j, timeout=90) == "COMPLETED"
            wait_comment(bed, j)
    env = dict(bed.env)
    r = user_cli("sgtest", ["job", str(busy), "--format", "json"], env)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(r.stdout)
    # The summary keeps utilisation to one decimal (store/summary.py): compare at that precision, not
    # both sides rounded to whole percent (91.46 in the record is 91.5 in the summary: 91 against 92).
    recorded = site.rows("gpu01", "SELECT gpu_util_mean_pct FROM job_gpus WHERE job_id = ?", busy)[0]["gpu_util_mean_pct"]
    assert [g["util_pct"] for g in data["gpus"]] == [pytest.approx(recorded, abs=0.05 + 1e-9)], (data["gpus"], recorded)
    assert not any(n["code"] in ("idle", "small_memory") for n in data["notes"]), data["notes"]
    r = user_cli("sgtest", ["job", str(idle)], env)
    assert r.returncode == 0, r.stderr
    assert "None of the job's 2 GPUs was used" in r.stdout, r.stdout
    # PrivateData=jobs in slurmdbd.conf: another user's job is not there for sgtest2.
    r = user_cli(OTHER_USER, ["job", str(busy)], env)
    assert r.returncode == 7, r.stdout + r.stderr
    assert "not visible to you" in r.stderr and len(r.stderr.strip().splitlines()) == 2


# What jobstats' controller epilog does when the job ends (its summary, set through sacctmgr,
# which slurmctld's `scontrol show job` does not show): run before ours.  slurmctld hands the job
# to slurmdbd asynchronously, so right at the job's end sacctmgr may modify nothing ("not in
# accounting yet"; 1 run in CI on 24.11): the stand-in tries again for up to 10 s, so that the
# premise, jobstats' comment in accounting before our epilog runs, holds.
JOBSTATS = ("for i in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do "
            "{sacctmgr} -i modify job where jobid=$SLURM_JOB_ID set "
            "AdminComment=JS1:eyJncHVzIjogMSwgIm5vZGVzIjogeyJncHUwMSI6IHt9fX0= 2>&1 "
            "| grep -qi -e 'nothing modified' -e 'affect anything' || break; sleep 0.5; done")


@pytest.fixture
def jobstats_bed(site, central, slurm_testbed_factory, tmp_path):
    import shutil
    return _ctld_testbed(site, central, slurm_testbed_factory, tmp_path,
                         before=JOBSTATS.format(sacctmgr=shutil.which("sacctmgr")))


def test_a_jobstats_admin_comment_set_through_sacctmgr_is_not_overwritten(jobstats_bed, site, central):
    bed = jobstats_bed
    with PushTimer(central, site, bed):
        job = bed.sbatch("sleep 2", args=["-p", "gpu", "-w", "gpu01", "--gres=gpu:1"])
        assert bed.wait_job(job, timeout=90) == "COMPLETED"
        first = wait_comment(bed, job)
        end = time.monotonic() + 40
        while "summary" not in (bed.ctld_log.read_text() if bed.ctld_log.exists() else "") and time.monotonic() < end:
            time.sleep(1)
    # sacctmgr lowercased it (22.05.8): still jobstats' value, not ours.
    assert first.lower().startswith("js1:") and admin_comment(bed, job)[str(job)] == first
    assert not S.is_ours(admin_comment(bed, job)[str(job)])
    assert "AdminComment belongs to another tool (in accounting)" in bed.ctld_log.read_text()


def test_a_summary_of_3000_gpus_fits_slurmdbds_column_and_slurm_gpu_job_decodes_it(bed, site, central):
    import json
    import random

    from slurm_gpu.config import load
    from slurm_gpu.slurm.cli_backend import CliBackend
    job = bed.sbatch("sleep 1", args=["-p", "gpu", "-w", "gpu01", "--gres=gpu:1"])
    assert bed.wait_job(job, timeout=90) == "COMPLETED"
    wait_comment(bed, job)  # the controller epilog is done with it
    rnd = random.Random(3)
    nodes = [f"gpu{n:04d}" for n in range(375)]
    rows = [dict(node=n, gpu_index=g, gpu_model="NVIDIA H100 80GB HBM3", start_time=1.79e9, end_time=1.79e9 + 3600,
                 gpu_util_mean_pct=rnd.uniform(0, 100), mem_util_mean_pct=rnd.uniform(0, 50),
                 max_memory_bytes=rnd.randrange(1 << 30, 80 << 30), memory_total_bytes=85520809984,
                 energy_j=rnd.uniform(1e6, 3e6)) for n in nodes for g in range(8)]
    summary = S.from_records("sgtest", job, 0, nodes, rows)
    env = dict(bed.env)
    cfg_path = Path(str(bed.ctld_log).replace("ctld.log", "ctld.toml"))
    cfg, _ = load(env=dict(env, SLURM_GPU_CONFIG=str(cfg_path)), lenient=True)
    backend = CliBackend(cfg, env=env)
    full = S.encode(summary)
    assert len(full) > S.MAX_BYTES
    # What happened before: sacctmgr exits 0, slurmdbd keeps the first 65,535 bytes, nobody can decode it.
    backend.set_admin_comment(job, "sgtest", full)
    stored = admin_comment(bed, job)[str(job)]
    assert len(stored) == S.MAX_BYTES and S.decode_safe(stored) is None
    r = _cli(env, "--config", str(cfg_path), "job", str(job))
    assert r.returncode == 10 and "damaged" in r.stderr, r.stdout + r.stderr
    backend.set_admin_comment(job, "sgtest", S.fit(summary))
    stored = admin_comment(bed, job)[str(job)]
    assert len(stored) <= S.MAX_BYTES and S.decode(stored).detail == "node"
    r = _cli(env, "--config", str(cfg_path), "job", str(job), "--format", "json")
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(r.stdout)
    assert len(data["gpus"]) == 375 and sum(g["count"] for g in data["gpus"]) == 3000
    assert abs(sum(g["energy_wh"] for g in data["gpus"]) - sum(x["energy_j"] for x in rows) / 3600) < 375 * 0.01
    r = _cli(env, "--config", str(cfg_path), "job", str(job))
    assert r.returncode == 0 and "8 GPUs" in r.stdout and "Per-GPU figures are on the central server" in r.stdout, r.stdout
    print(f"3000 GPUs: {len(full)} bytes per GPU, {len(stored)} bytes per node")
