"""The Ansible role (deploy/ansible) against this machine, then real jobs through the hooks it installed.

`ansible-playbook` runs the sample playbook with ``connection: local`` and variables that point
every path into a temporary directory (venv, config, node databases, spool, logs, prolog.d and
epilog.d, units, a slurm.conf and gres.conf to manage) and the central server at the testbed's
own MariaDB.  The testbed's slurmd then runs ``Prolog=<prolog.d>/*`` and ``Epilog=<epilog.d>/*``:
the drop-ins the role wrote, which reach the role's config only through the wrapper (the testbed
writes no slurm-gpu.toml).  Three playbook runs in all: install, the same again (changed=0), and
``--check --diff`` with one variable changed.
"""
from __future__ import annotations

import configparser
import os
import re
import secrets
import shlex
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest
import simgpu
from checkout import copy_checkout
from testbed import slurm_version, unavailable

from .sites import Site, play_work, wait_running

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
ANSIBLE = REPO / "deploy" / "ansible"
PLAYBOOK = ANSIBLE / "site.yml"
NODES = ("gpu01", "gpu02")


def _need(program: str) -> str:
    path = shutil.which(program)
    if path is None:
        unavailable(f"{program} not found (Debian packages ansible-core ansible-lint; .ci/install-deps.sh)")
    return path


class Deployment:
    """The temporary site the playbook configures, and its three runs."""

    def __init__(self, root: Path, site: Site, bed, wheel: Path, password: str):
        self.root, self.site, self.bed, self.wheel, self.password = root, site, bed, wheel, password
        self.prefix = root / "opt"
        self.venv = self.prefix / "venv"
        self.config = root / "etc" / "slurm-gpu" / "config.toml"
        self.password_file = root / "etc" / "slurm-gpu" / "central.password"
        self.credentials = root / "credentials"  # on the Ansible control machine
        self.writers_dir = root / "etc" / "slurm-gpu" / "writers"
        self.units = root / "systemd"
        self.slurm_dir = root / "slurm"
        self.slurm_conf = self.slurm_dir / "slurm.conf"
        self.gres_conf = self.slurm_dir / "gres.conf"
        self.textfile = root / "textfile"
        self.inventory = root / "inventory.yml"
        self.runs: List[subprocess.CompletedProcess] = []

    def variables(self, max_temperature_c: int = 87) -> Dict:
        s = self.site.root
        return {
            "slurm_gpu_install_from": "wheel",
            "slurm_gpu_wheel": str(self.wheel),
            "slurm_gpu_python": "/usr/bin/python3",
            "slurm_gpu_prefix": str(self.prefix),
            "slurm_gpu_config_path": str(self.config),
            "slurm_gpu_node_name": "gpu01",
            "slurm_gpu_nvml_library": str(self.site.lib),
            "slurm_gpu_slurm_conf": str(self.slurm_conf),
            "slurm_gpu_database": f"{s}/%n/usage.db",
            "slurm_gpu_spool_dir": f"{s}/%n/spool",
            "slurm_gpu_log_file": f"{s}/%n/hooks.log",
            "slurm_gpu_syslog": False,
            "slurm_gpu_textfile_dir": f"{self.textfile}/%n",
            "slurm_gpu_exporter": True,
            "slurm_gpu_efficiency_timer": True,
            "slurm_gpu_efficiency_central": True,
            "slurm_gpu_systemd_unit_dir": str(self.units),
            "slurm_gpu_prolog_d": str(self.slurm_dir / "prolog.d"),
            "slurm_gpu_epilog_d": str(self.slurm_dir / "epilog.d"),
            "slurm_gpu_manage_slurm_conf": True,
            "slurm_gpu_reconfigure_command": [],  # this slurm.conf is a copy: no live cluster to tell
            "slurm_gpu_gres_conf_replace": True,
            "slurm_gpu_gres_conf_path": str(self.gres_conf),
            # The testbed's MariaDB: gpu01 ships through its own writer account, whose password the
            # role makes on the control machine; the admin account creates the schema.
            "slurm_gpu_central_url": f"mysql://slurm_gpu_writer_gpu01@127.0.0.1:{self.bed.mariadb_port}/slurm_gpu",
            "slurm_gpu_central_admin_url": f"mysql://sgadmin@127.0.0.1:{self.bed.mariadb_port}/slurm_gpu",
            "slurm_gpu_central_password_file": str(self.password_file),
            "slurm_gpu_central_credentials_dir": str(self.credentials),
            "slurm_gpu_central_cluster": "sgtest",
            "slurm_gpu_central_writers": ["gpu01"],
            "slurm_gpu_central_writers_dir": str(self.writers_dir),
            "slurm_gpu_controller": True,
            "slurm_gpu_central_init": True,
            "slurm_gpu_central_admin_password": self.password,
            "slurm_gpu_central_admin_password_file": str(self.root / "etc" / "slurm-gpu" / "admin.password"),
            "slurm_gpu_config_extra": {
                "nvml_timeout_s": 2.0,
                "slurm_timeout_s": 10.0,
                "store": {"busy_timeout_s": 1.0},
                "xid": {"source": f"file:{s}/%n.kmsg"},
                "hooks": {"prolog_deadline_s": 20, "epilog_deadline_s": 30, "kill_grace_s": 1.0},
                "health": {"max_temperature_c": max_temperature_c, "severity": {"pcie_link": "warn"}},
            },
        }

    def write_inventory(self) -> None:
        import json
        host = {"ansible_connection": "local", "ansible_become": False,
                "ansible_python_interpreter": "/usr/bin/python3"}
        # JSON is YAML: no quoting surprises in paths.
        self.inventory.write_text(json.dumps({"all": {"children": {"slurm_gpu_nodes": {"hosts": {"gpu01": host}}}}}))

    def play(self, variables: Dict, *extra: str) -> subprocess.CompletedProcess:
        import json
        vars_file = self.root / f"vars-{len(self.runs)}.json"
        vars_file.write_text(json.dumps(variables))
        os.chmod(vars_file, 0o600)  # it holds the central password
        env = dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0", ANSIBLE_LOCALHOST_WARNING="False",
                   ANSIBLE_RETRY_FILES_ENABLED="False", ANSIBLE_STDOUT_CALLBACK="default",
                   ANSIBLE_CONFIG=str(self.root / "ansible.cfg"))
        r = subprocess.run([_need("ansible-playbook"), "-i", str(self.inventory), str(PLAYBOOK),
                            "-e", f"@{vars_file}", *extra], cwd=self.root, env=env, capture_output=True,
                           text=True, timeout=600)
        self.runs.append(r)
        return r


def _recap(r: subprocess.CompletedProcess) -> Dict[str, int]:
    m = re.search(r"^gpu01\s*:\s*(.*)$", r.stdout, re.M)
    assert m, r.stdout[-3000:] + r.stderr[-3000:]
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(1))}


def _unit(path: Path) -> configparser.ConfigParser:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # keep key case
    unit.read(path)
    return unit


def _unit_command(path: Path):
    """(argv, environment) of a rendered unit's ExecStart and Environment= lines."""
    text = path.read_text()
    env = dict(line.split("=", 2)[1:] for line in text.splitlines() if line.startswith("Environment="))
    exec_start = next(line.split("=", 1)[1] for line in text.splitlines() if line.startswith("ExecStart="))
    return shlex.split(exec_start), env


@pytest.fixture(scope="module")
def deployment(slurm_testbed_factory, tmp_path_factory):
    _need("ansible-playbook")
    root = Path("/tmp") / f"slurm-gpu-ansible-{os.getpid()}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    site = Site(root / "site")
    cpu = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    for node in NODES:  # `gres-conf` maps each GPU's CPU affinity to this machine's cores
        for i in range(4):
            simgpu.set_gpu(site.state(node), i, cpu_affinity=str(cpu))
    dist = root / "dist"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist),
                        str(copy_checkout(tmp_path_factory.mktemp("src")))],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    wheel = next(dist.glob("slurm_gpu-*.whl"))

    slurm_dir = root / "slurm"
    bed = slurm_testbed_factory(prolog=f"{slurm_dir}/prolog.d/*", epilog=f"{slurm_dir}/epilog.d/*",
                                prolog_epilog_timeout=60)
    password = secrets.token_urlsafe(18)
    bed.sql("CREATE DATABASE IF NOT EXISTS slurm_gpu CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;"
            f"CREATE OR REPLACE USER 'sgadmin'@'127.0.0.1' IDENTIFIED BY '{password}';"
            "GRANT ALL ON slurm_gpu.* TO 'sgadmin'@'127.0.0.1'; FLUSH PRIVILEGES;")
    d = Deployment(root, site, bed, wheel, password)
    slurm_dir.mkdir()
    # A slurm.conf with an old prolog to replace, and the testbed's two-node gres.conf.
    d.slurm_conf.write_text("ClusterName=sgtest\nprolog = /usr/local/sbin/old-prolog\n"
                            "SchedulerParameters=bf_continue,nohold_on_prolog_fail\n"
                            "NodeName=gpu01 Gres=gpu:h100:4\n")
    d.gres_conf.write_text(bed.gres_conf_text())
    d.write_inventory()
    (root / "ansible.cfg").write_text("[defaults]\n")  # this machine's ansible.cfg files play no part
    t0 = time.monotonic()
    d.first = d.play(d.variables())
    d.first_s = time.monotonic() - t0
    # What the database admin does next: run the statements `central init` printed (the role
    # shows them), less the reporter's, which need a real password.
    stmts = re.findall(r'"((?:CREATE USER|ALTER USER|GRANT) [^"]*)"', d.first.stdout)
    if stmts:
        bed.sql("\n".join(x for x in stmts if "slurm_gpu_reporter" not in x), "slurm_gpu")
    yield d
    shutil.rmtree(root, ignore_errors=True)


def test_role_passes_ansible_lint_with_the_production_profile():
    lint = _need("ansible-lint")
    r = subprocess.run([lint, "--offline", "--profile", "production", "--nocolor"], cwd=ANSIBLE,
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, NO_COLOR="1"))
    assert r.returncode == 0, r.stdout + r.stderr
    # ansible-lint 6.13 (Debian 12) and 25 (Debian 13, unstable) word their success differently.
    said = r.stdout + r.stderr
    assert ("Passed with production profile" in said
            or re.search(r"Passed: 0 failure\(s\), 0 warning\(s\).*Profile 'production' was required, and it passed", said)), said


def test_first_run_installs_venv_config_directories_hooks_units_and_schema(deployment):
    d = deployment
    r = d.first
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    recap = _recap(r)
    assert recap["failed"] == 0 and recap["changed"] > 10, recap
    assert d.password not in r.stdout + r.stderr  # no_log, and no diff of the password files
    print(f"first run: {d.first_s:.1f} s, {recap}")

    # A real pip install into a virtual environment of its own, from the wheel.
    version = subprocess.run([str(d.venv / "bin" / "slurm-gpu"), "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and d.wheel.name.split("-")[1] in version.stdout, version
    where = subprocess.run([str(d.venv / "bin" / "python"), "-I", "-c", "import slurm_gpu; print(slurm_gpu.__file__)"],
                           capture_output=True, text=True)
    assert where.stdout.startswith(str(d.venv) + "/"), where
    # Root-owned files, modes as slurm-gpu checks them.
    for path, mode in ((d.config, 0o644), (d.password_file, 0o600), (d.site.root / "gpu01" / "spool", 0o700),
                       (d.site.root / "gpu01", 0o755), (d.prefix / "hooks" / "slurm-gpu-prolog", 0o755),
                       (d.slurm_dir / "prolog.d" / "slurm-gpu", 0o755), (d.textfile / "gpu01", 0o755)):
        st = os.lstat(path)
        assert (st.st_uid, stat.S_IMODE(st.st_mode), stat.S_ISLNK(st.st_mode)) == (0, mode, False), path
    # gpu01's own writer password, made once on the control machine; the controller's copy is the same.
    secret = (d.credentials / "slurm_gpu_writer_gpu01").read_text().strip()
    assert d.password_file.read_text() == secret + "\n" and len(secret) == 32
    assert (d.writers_dir / "slurm_gpu_writer_gpu01.password").read_text().strip() == secret
    assert secret not in r.stdout + r.stderr
    assert d.bed.sql("SELECT account, cluster, node FROM writer_nodes", "slurm_gpu").split() == \
        ["slurm_gpu_writer_gpu01", "sgtest", "gpu01"]
    # slurm-gpu reads the config the role wrote, and nothing in it is unknown.
    cfg = subprocess.run([str(d.venv / "bin" / "python"), "-I", "-c",
                          "import sys; from slurm_gpu import config; c = config.load(sys.argv[1]); "
                          "print(c.get('health', 'max_temperature_c'), c.get('store', 'spool_dir'), c.get('central', 'url'))",
                          str(d.config)], capture_output=True, text=True)
    assert cfg.stdout.split() == ["87", f"{d.site.root}/%n/spool", d.variables()["slurm_gpu_central_url"]], cfg
    # slurm.conf: the old prolog line replaced in place, the others added; nothing else touched.
    lines = d.slurm_conf.read_text().splitlines()
    assert lines[1] == f"Prolog={d.slurm_dir}/prolog.d/*" and f"Epilog={d.slurm_dir}/epilog.d/*" in lines
    assert f"EpilogSlurmctld={d.prefix}/hooks/slurm-gpu-epilog-ctld" in lines
    assert {"PrologFlags=Alloc", "PrologEpilogTimeout=120", "HealthCheckInterval=300",
            "SchedulerParameters=bf_continue,nohold_on_prolog_fail"} <= set(lines)
    # PrologTimeout and EpilogTimeout where this machine's Slurm has them (25.05+; older slurmd
    # refuse to start on them: test_version_facts), the version read from `slurmd -V`.
    major, minor, patch = slurm_version()
    if (major, minor) >= (25, 5):
        assert {"PrologTimeout=60", "EpilogTimeout=120"} <= set(lines), lines
    else:
        assert not [ln for ln in lines if re.match(r"(?i)(Prolog|Epilog)Timeout=", ln)], lines
        assert f"Slurm {major}.{minor:02d}.{patch} has no PrologTimeout or EpilogTimeout" in r.stdout, r.stdout
    # gres.conf differed from the GPUs: the diff was shown, the file replaced with this node's lines.
    assert "differs from the GPUs of gpu01" in r.stdout and "Type=h100" in r.stdout
    gres = d.gres_conf.read_text()
    assert "NodeName=gpu01" in gres and "gpu02" not in gres and "Type=h100" not in gres
    assert list(d.slurm_dir.glob("gres.conf.*")), "no backup of the old gres.conf"
    # The units pass systemd-analyze verify (the role ran it) and name this installation.
    for unit, args in (("slurm-gpu-push.service", ["db", "push"]), ("slurm-gpu-efficiency.service", ["efficiency", "run"]),
                       ("slurm-gpu-efficiency-central.service", ["efficiency", "enforce"])):
        argv, env = _unit_command(d.units / unit)
        assert argv[0] == str(d.venv / "bin" / "slurm-gpu") and argv[1:3] == args, argv
        assert env["SLURM_GPU_CONFIG"] == str(d.config), env
    assert "Verify the units with systemd-analyze" in r.stdout
    # The role's units are the shipped ones (deploy/systemd) but for the paths.
    for name in ("slurm-gpu-push.service", "slurm-gpu-push.timer", "slurm-gpu-exporter.service",
                 "slurm-gpu-efficiency.service", "slurm-gpu-efficiency.timer",
                 "slurm-gpu-efficiency-central.service", "slurm-gpu-efficiency-central.timer"):
        shipped, rendered = _unit(REPO / "deploy" / "systemd" / name), _unit(d.units / name)
        for section in shipped.sections():
            for key, value in shipped[section].items():
                if key not in ("ExecStart", "ReadWritePaths", "ConditionPathExists"):
                    assert rendered[section].get(key) == value, (name, section, key)
    # central init created the schema (the statements it printed are in the output).
    assert d.bed.sql("SELECT value FROM meta WHERE name = 'schema_version'", "slurm_gpu").strip()
    assert "GRANT" in r.stdout and "IDENTIFIED WITH mysql_native_password AS '*" in r.stdout


def test_jobs_run_through_the_installed_hooks_and_are_recorded_and_shipped(deployment):
    d = deployment
    assert d.first.returncode == 0, "first run failed"
    bed, site = d.bed, d.site
    jobs = {}
    for node, gpus in (("gpu01", 2), ("gpu02", 1)):
        jobs[node] = bed.sbatch("sleep 4", args=["-p", "gpu", "-w", node, f"--gres=gpu:{gpus}"])
    for node, job in jobs.items():
        wait_running(bed, site, node, job)
        play_work(site, node, 0, energy_j=500.0, pid=4242, util=80, mem_util=30, peak_bytes=8 << 30, busy_ms=2000)
    for node, job in jobs.items():
        assert bed.wait_job(job, timeout=60) == "COMPLETED", site.log(node)
    for node, gpus in (("gpu01", 2), ("gpu02", 1)):
        rows = site.rows(node, "SELECT * FROM job_gpus WHERE job_id = ?", jobs[node])
        assert len(rows) == gpus, site.log(node)
        assert all((r["user"], r["account"], r["node"]) == ("sgtest", "physics", node) for r in rows)
        assert [r["energy_j"] for r in rows if r["gpu_index"] == 0] == [pytest.approx(500.0)]
    assert list((d.textfile / "gpu01").glob("slurm_gpu_*.prom")), "the hooks wrote no metrics"

    # A GPU with uncorrectable ECC errors: the installed prolog drains gpu02 with our reason.
    simgpu.set_gpu(site.state("gpu02"), 0, ecc_volatile_uncorrected=2)
    job = bed.sbatch("true", args=["-p", "gpu", "-w", "gpu02", "--gres=gpu:1"])
    info = bed.wait_node_state("gpu02", "DRAIN", timeout=60)
    assert info["Reason"].startswith("slurm-gpu: GPU 0 (GPU-") and f"[prolog job {job}; check " in info["Reason"], info
    bed.run("scancel", str(job), check=False)
    simgpu.set_gpu(site.state("gpu02"), 0, ecc_volatile_uncorrected=0)

    # The push unit's own command, with its environment, ships gpu01's records to the server.
    argv, env = _unit_command(d.units / "slurm-gpu-push.service")
    push = subprocess.run(argv, env=dict(os.environ, **env), capture_output=True, text=True, timeout=120)
    assert push.returncode == 0 and push.stdout == "" and push.stderr == "", push  # as slurm_gpu_writer_gpu01
    shipped = d.bed.sql(f"SELECT COUNT(*) FROM job_gpus WHERE job_id = {jobs['gpu01']}", "slurm_gpu").strip()
    assert shipped == "2"
    # The exporter unit's command serves the hooks' metrics (one scrape, no server).
    argv, env = _unit_command(d.units / "slurm-gpu-exporter.service")
    once = subprocess.run(argv + ["--once"], env=dict(os.environ, **env), capture_output=True, text=True, timeout=60)
    assert once.returncode == 0 and "slurm_gpu_check_status" in once.stdout, once


def test_second_run_changes_nothing(deployment):
    d = deployment
    assert d.first.returncode == 0, "first run failed"
    before = {p: p.stat().st_mtime_ns for p in (d.config, d.gres_conf, d.slurm_conf, d.password_file)}
    t0 = time.monotonic()
    r = d.play(d.variables())
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    recap = _recap(r)
    print(f"second run: {time.monotonic() - t0:.1f} s, {recap}")
    assert recap["changed"] == 0 and recap["failed"] == 0, \
        "\n".join(line for line in r.stdout.splitlines() if line.startswith("changed") or line.startswith("TASK"))
    assert {p: p.stat().st_mtime_ns for p in before} == before


def test_check_diff_shows_a_changed_variable_and_changes_nothing(deployment):
    """Two variables changed in check mode: the config's temperature, and slurm_gpu_slurm_version,
    which overrides what the daemons' -V says, set to the other side of 25.05 than this machine's
    Slurm (the PrologTimeout and EpilogTimeout lines)."""
    d = deployment
    assert d.first.returncode == 0, "first run failed"
    text, conf = d.config.read_bytes(), d.slurm_conf.read_bytes()
    mtime = d.config.stat().st_mtime_ns
    newer = slurm_version()[:2] < (25, 5)
    given = "25.11.2" if newer else "24.11.5"
    r = d.play(dict(d.variables(max_temperature_c=80), slurm_gpu_slurm_version=given), "--check", "--diff")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    recap = _recap(r)
    assert "-max_temperature_c = 87\n+max_temperature_c = 80" in r.stdout, r.stdout[-4000:]
    if newer:  # one more task changed: the loop over the slurm.conf lines
        assert "+PrologTimeout=60" in r.stdout and "+EpilogTimeout=120" in r.stdout, r.stdout[-4000:]
        assert recap["changed"] == 2, recap
    else:  # the lines a newer Slurm got stay (the role never removes a line), no new ones
        assert "Slurm 24.11.5 has no PrologTimeout or EpilogTimeout" in r.stdout, r.stdout[-4000:]
        assert recap["changed"] == 1, recap
    assert d.slurm_conf.read_bytes() == conf
    assert d.password not in r.stdout + r.stderr
    assert d.config.read_bytes() == text and d.config.stat().st_mtime_ns == mtime
    cfg = subprocess.run([str(d.venv / "bin" / "python"), "-I", "-c",
                          "import sys; from slurm_gpu import config; "
                          "print(config.load(sys.argv[1]).get('health', 'max_temperature_c'))",
                          str(d.config)], capture_output=True, text=True)
    assert cfg.stdout.strip() == "87"

