#!/usr/bin/env python3
"""`make demo`: a throwaway two-node Slurm 22.05 cluster with 8 simulated H100s, gated and
accounted by slurm-gpu.

It starts real munged, MariaDB, slurmdbd, slurmctld and two slurmd on 127.0.0.1 (their own
ports and directories), points Prolog=/Epilog= at slurm-gpu's hooks, runs a few jobs of the
unprivileged user `sgtest` while the simulated driver counts energy and utilisation, breaks one
node's GPUs (uncorrectable ECC errors), shows the drained node with its reason and a per-job GPU
usage table, ships both nodes' records to a central database on the same MariaDB (`db push`)
and reports the cluster from there, closes the loop with `slurm-gpu remediate` (reset, verify,
resume; a pending row remap cured the same way; a failed remap left drained as an RMA), shows an idle
job's user warned by mail and the job cancelled through Slurm (`slurm-gpu efficiency`), and tears
everything down.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

BOLD, DIM, RESET = ("\033[1m", "\033[2m", "\033[0m") if sys.stdout.isatty() else ("", "", "")


def say(text: str) -> None:
    print(f"\n{BOLD}== {text}{RESET}", flush=True)


def need(cond: bool, what: str, fix: str) -> None:
    if not cond:
        print(f"demo: cannot run: {what}\nhint: {fix}", file=sys.stderr)
        sys.exit(2)


def script(name: str) -> str:
    path = os.path.join(os.path.dirname(sys.executable), name)
    return path if os.path.exists(path) else (shutil.which(name) or "")


def run_cli(*args: str, env: dict) -> None:
    cp = subprocess.run([sys.executable, "-m", "slurm_gpu.cli", *args], env=env, capture_output=True, text=True)
    sys.stdout.write(cp.stdout)
    if cp.returncode not in (0, 1):
        sys.stdout.write(cp.stderr)


def main() -> int:
    need(os.geteuid() == 0, "it must run as root (slurmd runs prolog/epilog as root, devices are created with mknod)",
         "run `sudo make demo`")
    need(shutil.which("apt-get") is not None or shutil.which("slurmctld", path="/usr/sbin:/usr/bin") is not None,
         "no apt-get and no Slurm installed", "install slurmctld slurmd slurm-client munge slurmdbd mariadb-server")
    try:
        import simgpu
        from testbed import SlurmTestbed, TestbedUnavailable, check_available

        import slurm_gpu  # noqa: F401
    except ImportError as e:
        need(False, f"missing Python module: {e.name}", "run `bash .ci/install-deps.sh` (or `make demo`, which does)")
    try:
        check_available()
    except TestbedUnavailable as e:
        need(False, e.reason, "run `bash .ci/install-deps.sh` as root (apt installs Slurm, MariaDB and munge)")
    prolog, epilog = script("slurm-gpu-prolog"), script("slurm-gpu-epilog")
    need(bool(prolog and epilog), "slurm-gpu-prolog/epilog are not installed", "pip install -e .")

    work = Path(tempfile.mkdtemp(prefix="slurm-gpu-demo-", dir="/tmp"))
    os.chmod(work, 0o755)
    site = work / "site"
    site.mkdir()
    lib = simgpu.build(site / "lib", default_state=str(site / "%n.state"))
    for node, minors in (("gpu01", (0, 1, 2, 3)), ("gpu02", (4, 5, 6, 7))):
        prof = simgpu.h100_sxm(4, seed=node)
        for g, m in zip(prof["gpus"], minors):
            g["minor"] = m
        simgpu.write_state(site / f"{node}.state", prof)
    # [job] min_runtime_s: the demo's jobs last seconds; `slurm-gpu job` judges them anyway.
    from smtpserver import SmtpServer, free_port
    smtp_port = free_port()
    config = (f'nvml_library = "{lib}"\nnvml_timeout_s = 2.0\n'
              f'[store]\ndatabase = "{site}/%n/usage.db"\nspool_dir = "{site}/%n/spool"\n'
              f'[log]\nsyslog = false\nfile = "{site}/%n/hooks.log"\n[xid]\nsource = "none"\n'
              f'[metrics]\ntextfile_dir = "{site}/%n/metrics"\n'
              '[job]\nmin_runtime_s = 1\n'
              # `remediate` resets a GPU with the stand-in nvidia-smi that drives the simulated GPUs
              # (production: the real `nvidia-smi --gpu-reset -i <bus id>`, the default).
              f'[remediation]\nreset_command = ["{sys.executable}", "{simgpu.STAND_IN_NVIDIA_SMI}", '
              f'"--state", "{site}/%n.state", "--gpu-reset", "-i", "{{pci_bus_id}}"]\n'
              f'verify_passes = 2\nverify_interval_s = 1\nlock_file = "{site}/%n/remediate.lock"\n'
              # ... and before it resumes a node, verifies it with a job of its own in a reservation of that
              # node: the stand-in dcgmi and all_reduce_perf read the simulated GPUs (production: DCGM and
              # nccl-tests; docs/remediation.md, "Verification job").
              f'[verify]\nenabled = true\ndcgmi = "{simgpu.STAND_IN_DCGMI}"\n'
              f'nccl_command = ["{simgpu.STAND_IN_ALL_REDUCE_PERF}", "-b", "8M", "-e", "256M", "-f", "2", "-g", "{{gpus}}"]\n'
              'start_timeout_s = 60\ntimeout_s = 120\n'
              # Idle GPUs of running jobs (docs/efficiency.md), minutes scaled to seconds: sampled every second,
              # the user warned after 4 s idle, the job cancelled after 12 s; mails to a local SMTP server.
              f'[efficiency]\nsample_every_s = 1\ngrace_s = 0\nnotify_after_s = 4\ncancel_after_s = 12\n'
              f'mail_retry_s = 1\nlive_summary_every_s = 1\nsmtp_server = "127.0.0.1:{smtp_port}"\n'
              'mail_domain = "example.org"\njob_url = "https://ood.example.org/pun/sys/jobstats?jobid={job_id}"\n')
    bed = SlurmTestbed(work / "cluster", prolog=prolog, epilog=epilog, slurm_gpu_config=config)
    try:
        say("Starting a 2-node Slurm 22.05 cluster (munge, MariaDB, slurmdbd, slurmctld, 2x slurmd) on 127.0.0.1")
        t0 = time.monotonic()
        bed.start()
        print(f"up in {time.monotonic() - t0:.1f} s; Prolog={prolog}\n                Epilog={epilog}")
        env = dict(os.environ, **bed.env, SIMNVML_STATE=str(site / "gpu01.state"))
        env["SLURM_GPU_CONFIG"] = str(bed.conf_dir / "slurm-gpu.toml")
        print(bed.run("sinfo", "-N", "-o", "%N %T %G").stdout, end="")

        say("Running three GPU jobs of user sgtest (accounts physics and chem)")
        jobs = [
            (bed.sbatch("sleep 4", args=["-p", "gpu", "-w", "gpu01", "-A", "physics", "--gres=gpu:2"]), "gpu01", 85),
            (bed.sbatch("sleep 4", args=["-p", "gpu", "-w", "gpu02", "-A", "chem", "--gres=gpu:1"]), "gpu02", 40),
            (bed.sbatch("sleep 4", args=["-p", "gpu", "-w", "gpu02", "-A", "physics", "--gres=gpu:1"]), "gpu02", 0),
        ]
        # The simulated driver plays the workload on each job's GPUs: energy and per-process
        # accounting while the jobs run (job C holds its GPU without using it).
        _wait_all_running(bed, site, jobs)
        now_us = int(time.time() * 1e6)
        for job, node, util in jobs:
            for i in _job_gpus(bed, job):
                simgpu.set_gpu(site / f"{node}.state", i, energy_mj=1_000_000_000 + i * 1_000_003 + 300_000 + util * 30_000,
                               acct=[dict(pid=10000 + job, gpu_util=util, mem_util=util // 2, max_mem_bytes=(20 + i) << 30,
                                          time_ms=3500, start_time_us=now_us, is_running=0)] if util else [])
        for job, node, _ in jobs:
            print(f"job {job} on {node}: {bed.wait_job(job, timeout=90)}")

        say("GPU 0-3 of gpu01 develop uncorrectable ECC errors; a new job lands there first")
        for i in range(4):
            simgpu.set_gpu(site / "gpu01.state", i, ecc_volatile_uncorrected=3)
        job = bed.sbatch("sleep 1", args=["-p", "gpu", "-A", "physics", "--gres=gpu:2"])
        state = bed.wait_job(job, timeout=120)
        info = bed.job_info(job)
        print(f"job {job}: {state} on {info.get('NodeList')} after {info.get('Restarts', '?')} requeue(s)")

        say("Drained nodes (sinfo -R)")
        print(bed.run("sinfo", "-R", "-o", "%15N %20T %E").stdout, end="")
        say("slurm-gpu status")
        run_cli("status", env=env)
        say("Spare GPUs against the 20 % reserve, per partition and model (slurm-gpu fleet capacity)")
        run_cli("fleet", "capacity", env=env)
        say("What Prometheus scrapes from gpu01 (node_exporter's textfile collector; GPU labels as dcgm-exporter's)")
        _show_metrics(site / "gpu01" / "metrics" / "slurm_gpu_node.prom")

        dbs = ["--db", str(site / "gpu01" / "usage.db"), "--db", str(site / "gpu02" / "usage.db")]
        say("Per-job GPU usage recorded by the epilogs (slurm-gpu report jobs)")
        # The demo's jobs last seconds: the report shows a job's GPU time as HH:MM:SS and energy in
        # Wh (units follow the size of the figures), so the idle job and the busy ones stand apart.
        print(f"{DIM}GPU time = prolog start to epilog start, per GPU, as HH:MM:SS; energy from the driver's "
              f"counter (Wh){RESET}")
        run_cli("report", "jobs", *dbs, "--sort", "job_id", env=env)
        say("By account (slurm-gpu report --by account)")
        print(f"{DIM}seconds-long jobs: GPU time in GPU-seconds, energy in Wh; TOTAL from the exact sums{RESET}")
        run_cli("report", "--by", "account", *dbs, env=env)

        say("Shipping both nodes' records to the central SQL server (slurm-gpu db push), then one report from there")
        print(f"{DIM}database slurm_gpu on the MariaDB that slurmdbd uses; the writer account can insert, "
              f"never read or delete{RESET}")
        writer, reporter = _central(bed, work)
        for node in ("gpu01", "gpu02"):
            run_cli("--config", str(writer), "db", "push", "--db", str(site / node / "usage.db"), env=env)
        run_cli("--config", str(reporter), "report", "--by", "account,node", "--db", "central", env=env)

        say("Each job's GPU summary into Slurm's accounting (AdminComment), then `slurm-gpu job` as user sgtest")
        print(f"{DIM}on a cluster the controller epilog (slurm-gpu-epilog-ctld) writes it as each job ends; "
              f"here `central annotate` does it for all of them{RESET}")
        run_cli("--config", str(reporter), "central", "annotate", "--since", "now-1hour", env=env)
        from testbed import user_cli
        for job, _node, util in (jobs[0], jobs[2]):
            print(f"{DIM}$ slurm-gpu job {job}    # as sgtest, through sacct: no root, no database{RESET}")
            cp = user_cli("sgtest", ["job", str(job)], env)
            sys.stdout.write(cp.stdout + (cp.stderr if cp.returncode not in (0,) else ""))
        _idle_job(bed, site, env, SmtpServer(work / "smtp", port=smtp_port))
        _remediation(bed, site, env)
        say("What the hooks logged on gpu01")
        log = (site / "gpu01" / "hooks.log").read_text().splitlines()
        print("\n".join(line for line in log if " drain " in line or " check " in line)[:2000])
    finally:
        say("Tearing down")
        bed.stop()
        shutil.rmtree(work, ignore_errors=True)
        print("all daemons stopped, work directory removed")
    return 0


def _remediation(bed, site: Path, env: dict) -> None:
    """Issue 26's loop with nobody touching it: gpu01's drain is cured by a GPU reset and verified;
    a pending row remap is drained by the prolog and cured the same way; a failed remap is an RMA."""
    import simgpu
    node_env = dict(env, SLURMD_NODENAME="gpu01", SIMNVML_STATE=str(site / "%n.state"))

    def remediate() -> None:
        print(f"{DIM}$ slurm-gpu remediate --node gpu01{RESET}")
        run_cli("remediate", "--node", "gpu01", env=node_env)

    def drained_by_a_job() -> int:
        """A job for gpu01: its prolog finds the fault, drains the node; Slurm requeues the job."""
        job = bed.sbatch("sleep 1", args=["-p", "gpu", "-A", "physics", "--gres=gpu:4", "-w", "gpu01"])
        # remediate acts only once Slurm has the node idle: wait for the requeue to finish (the
        # job back in the queue, the node no longer running or completing it)
        end = time.monotonic() + 60
        while time.monotonic() < end and bed.job_info(job).get("JobState") != "PENDING":
            time.sleep(0.2)
        bed.wait_node_state("gpu01", lambda i: "DRAIN" in i["State"] and not {"COMPLETING", "ALLOCATED", "MIXED"}
                            & set(i["State"].split("+")), timeout=60)
        print(f"job {job} for gpu01: {bed.job_info(job).get('JobState')} (requeued: the prolog refused the GPU)")
        print(bed.run("sinfo", "-R", "-h", "-o", "%15N %E").stdout, end="")
        return job

    say("Closing the loop: `slurm-gpu remediate` resets gpu01's GPUs, verifies them and resumes the node")
    print(f"{DIM}only our own drain, only while Slurm says idle and no process holds a GPU; the reset is the "
          f"stand-in nvidia-smi of the simulated driver; two passive checks, then a verification job (DCGM diag "
          f"and NCCL all-reduce, stand-ins here) in a reservation of gpu01 alone{RESET}")
    remediate()
    print(f"{DIM}$ sacct -X --name=slurm-gpu-verify -o JobID,NodeList,Reservation,State,Elapsed{RESET}")
    end = time.monotonic() + 15  # slurmdbd has the job's end a moment after slurmctld
    while True:
        out = bed.run("sacct", "-X", "-a", "--name=slurm-gpu-verify", "-S", "now-1hour", "-o",
                      "JobID,NodeList,Reservation%24,State,Elapsed").stdout
        if "COMPLETED" in out or time.monotonic() > end:
            break
        time.sleep(0.5)
    print(out, end="")

    say("GPU 2 of gpu01 has a row remap pending (it takes effect at a reset): drained by the prolog, reset, back to work")
    simgpu.set_gpu(site / "gpu01.state", 2, remapped_pending=1)
    job = drained_by_a_job()
    remediate()
    print(f"job {job}, which waited for gpu01: {bed.wait_job(job, timeout=120)} on {bed.job_info(job).get('NodeList')}")

    say("GPU 1 of gpu01: row remapping failed (no spare rows): no reset cures it, the drain stays as an RMA")
    simgpu.set_gpu(site / "gpu01.state", 1, remapped_failure=1)
    job = drained_by_a_job()
    remediate()
    print(bed.run("sinfo", "-R", "-h", "-o", "%15N %E").stdout, end="")
    bed.run("scancel", str(job))

    say("Each GPU's remediation history by serial, and drain to verified resume per fault (slurm-gpu fleet remediation)")
    db = str(site / "gpu01" / "usage.db")
    print(f"{DIM}$ slurm-gpu fleet remediation --node-db {db}{RESET}")
    run_cli("fleet", "remediation", "--node-db", db, env=env)
    run_cli("fleet", "remediation", "--by", "fault", "--node-db", db, env=env)


def _idle_job(bed, site: Path, env: dict, smtp) -> None:
    """Issue 38: a job that holds a GPU and does nothing. gpu02's timer (played here every second) samples it,
    its user sees it idle with `slurm-gpu job`, gets one warning by mail, then Slurm cancels the job."""
    from testbed import user_cli
    node_env = dict(env, SLURMD_NODENAME="gpu02", SIMNVML_STATE=str(site / "%n.state"))
    say("An idle job: its user is warned by mail, then Slurm cancels it (slurm-gpu efficiency run, every second here)")
    print(f"{DIM}policy: mail after 4 s with every GPU idle, cancel after 12 s if the warning went out "
          f"(a site: an hour and two); mails to an SMTP server on 127.0.0.1{RESET}")
    smtp.start()
    try:
        job = bed.sbatch("sleep 300", args=["-p", "gpu", "-w", "gpu02", "-A", "physics", "--gres=gpu:1"])
        _wait_all_running(bed, site, [(job, "gpu02", 0)])
        shown, end = False, time.monotonic() + 60
        while time.monotonic() < end and bed.job_info(job).get("JobState") == "RUNNING":
            subprocess.run([sys.executable, "-m", "slurm_gpu.cli", "efficiency", "run", "--node-name", "gpu02"],
                           env=node_env, capture_output=True, text=True)
            if not shown and smtp.messages():
                print(f"{DIM}$ slurm-gpu job {job}    # as sgtest, while it runs: its figures so far{RESET}")
                cp = user_cli("sgtest", ["job", str(job)], env)
                sys.stdout.write(cp.stdout if cp.returncode == 0 else cp.stderr)
                shown = True
            time.sleep(1)
        print(f"job {job}: {bed.wait_job(job, timeout=60)}")
        for m in sorted(smtp.wait_for(2), key=lambda m: "cancelled" in m["Subject"]):
            body = m.get_payload(decode=True).decode()
            print(f"{DIM}mail to {m['To']}:{RESET} {m['Subject']}")
            print("\n".join("    " + line for line in body.splitlines()[2:3] + body.splitlines()[4:7]))
        print(f"{DIM}$ sacct -X -j {job} -o JobID,State,AdminComment%90{RESET}")
        time.sleep(2)  # slurmdbd has the end a moment after slurmctld
        print(bed.run("sacct", "-X", "-j", str(job), "-o", "JobID,State,AdminComment%90").stdout, end="")
        print(f"{DIM}$ slurm-gpu efficiency actions --node-name gpu02{RESET}")
        run_cli("efficiency", "actions", "--node-name", "gpu02", env=node_env)
    finally:
        smtp.stop()


def _show_metrics(path: Path) -> None:
    """The lines of the node file a person watching wants: the drain, the failed checks, the ECC counts."""
    wanted = ("slurm_gpu_node_drained{", "slurm_gpu_ecc_errors_total{", "slurm_gpu_check_status{")
    lines = [line for line in path.read_text().splitlines() if line.startswith(wanted)]
    shown = [line for line in lines if "node_drained" in line
             or ("check_status" in line and 'status="FAIL"' in line and line.endswith(" 1"))
             or ("ecc_errors" in line and 'type="uncorrected",counter="volatile"' in line)]
    print(f"{DIM}{path}: {len(shown)} of its {len(lines)} drain, check and ECC series (modelName left out){RESET}")
    print("\n".join(re.sub(r',modelName="[^"]*"', "", line) for line in shown[:12]))


def _central(bed, work: Path):
    """A database on the testbed's MariaDB, its schema (`central init`) and the two accounts it prints."""
    import secrets

    def account(user: str, grants) -> Path:
        password = secrets.token_urlsafe(16)
        bed.sql("".join(f"CREATE OR REPLACE USER '{user}'@'{h}' IDENTIFIED BY '{password}';"
                        + "".join(g.replace("'%'", f"'{h}'") for g in grants) for h in ("127.0.0.1", "localhost")))
        pw = work / f"{user}.password"
        pw.write_text(password + "\n")
        os.chmod(pw, 0o600)
        cfg = work / f"{user}.toml"
        cfg.write_text(f'[central]\nurl = "mysql://{user}@127.0.0.1:{bed.mariadb_port}/slurm_gpu"\n'
                       f'password_file = "{pw}"\n')
        os.chmod(cfg, 0o644)
        return cfg

    bed.sql("CREATE DATABASE IF NOT EXISTS slurm_gpu CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
    admin = account("slurm_gpu_admin", ["GRANT ALL ON slurm_gpu.* TO 'slurm_gpu_admin'@'%';"])
    cp = subprocess.run([sys.executable, "-m", "slurm_gpu.cli", "--config", str(admin), "central", "init",
                         # one account for both demo nodes (a site gives each node its own)
                         "--cluster", "sgtest", "--writers", "*", "--group", "slurm_gpu_writer",
                         "--password-dir", str(work / "writers")],
                        env=bed.env, capture_output=True, text=True)
    if cp.returncode != 0:
        raise RuntimeError(f"central init failed: {cp.stderr}")
    grants = [line for line in cp.stdout.splitlines() if line.startswith("GRANT")]
    return (account("slurm_gpu_writer", [g for g in grants if "slurm_gpu_writer" in g]),
            account("slurm_gpu_reporter", [g for g in grants if "slurm_gpu_reporter" in g]))


def _wait_all_running(bed, site: Path, jobs, timeout: float = 60) -> None:
    """Until every job's prolog has passed (with PrologFlags=Alloc a job is RUNNING during its prolog)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        logs = {n: (site / n / "hooks.log").read_text() if (site / n / "hooks.log").exists() else "" for _, n, _ in jobs}
        if all(f"prolog pass job={j} " in logs[n] for j, n, _ in jobs):
            return
        time.sleep(0.2)


def _job_gpus(bed, job: int):
    """The job's GRES indices from `scontrol -d show job` (GRES=gpu:h100:2(IDX:0-1)); on these
    simulated nodes the k-th GRES GPU is NVML index k (minors in ascending order)."""
    import re
    out = bed.run("scontrol", "-d", "show", "job", str(job)).stdout
    m = re.search(r"\(IDX:([0-9,\-]+)\)", out)
    idx = []
    for part in (m.group(1).split(",") if m else []):
        a, _, b = part.partition("-")
        idx.extend(range(int(a), int(b or a) + 1))
    return idx


if __name__ == "__main__":
    sys.exit(main())
