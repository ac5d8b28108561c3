"""A throwaway but real Slurm 22.05 cluster on 127.0.0.1 for integration tests.

``SlurmTestbed(workdir)`` starts munged, MariaDB, slurmdbd, slurmctld and one ``slurmd -N``
per node, all with their configuration, state, sockets and logs under ``workdir``, on free
ports in 16817-16999.  Every daemon runs in the foreground as a child of this process in its
own session, so ``stop()`` can end exactly what it started by pid - never by name: the
daemon, what is left in its session, and every process whose environment names this
cluster's slurm.conf (slurmstepd and the jobs, which leave slurmd's session).  The pids are
also recorded in ``RUN_DIR``; a later ``start()`` ends daemons whose owner process died.

See docs/testbed.md for the layout, the observed prolog environment and the GPU index facts.
"""
from __future__ import annotations

import glob
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import cgroupnest

# Fixed, root-owned directory that outlives a work directory: the registry of live daemons.
RUN_DIR = Path("/run/slurm-gpu-testbed")
REGISTRY = RUN_DIR / "daemons"
def _port_range() -> Tuple[int, int]:
    """16817-16999, or SLURM_TESTBED_PORTS=LO-HI: each suite run at the same time on one machine
    (this one's and a root filesystem's, .ci/rootfs.sh) takes its clusters' ports from its own range."""
    raw = os.environ.get("SLURM_TESTBED_PORTS", "")
    m = re.fullmatch(r"(\d+)-(\d+)", raw.strip())
    return (int(m.group(1)), int(m.group(2))) if m else (16817, 16999)


PORT_RANGE = _port_range()
JOB_USER = "sgtest"
OTHER_USER = "sgtest2"  # a second job user (created by .ci/install-deps.sh), account chem
CLUSTER = "sgtest"
ACCOUNTS = ("physics", "chem")
DB_USER = "slurm"
DB_NAME = "slurm_acct_db"
NVIDIA_MAJOR = 195
CRED_EXPIRE_S = 10  # job credential lifetime; a requeued job waits CRED_EXPIRE_S + 1 s
# A shared cluster runs its health-check link this often (a no-op unless a test points it somewhere).
SWITCHABLE_HEALTH_CHECK_INTERVAL_S = 2
NO_HOOK = "no-hook"

BINARIES = ("munged", "mariadb-install-db", "mariadbd", "mariadb", "slurmdbd", "slurmctld",
            "slurmd", "sbatch", "scontrol", "sinfo", "squeue", "sacct", "sacctmgr", "scancel",
            "runuser")
SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TERMINAL_JOB_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
    "DEADLINE", "OUT_OF_MEMORY", "SPECIAL_EXIT",
})


def unavailable(reason: str) -> None:
    """Skip a test whose prerequisite this machine lacks - except in CI (``CI`` set), where a
    missing prerequisite is a failure: the suite there must run every test."""
    import pytest
    if os.environ.get("CI"):
        pytest.fail(f"prerequisite missing in CI (tests must not skip there): {reason}", pytrace=False)
    pytest.skip(reason)


class TestbedUnavailable(Exception):
    """This machine cannot run the testbed (not root, a package or the job user missing)."""

    __test__ = False  # not a pytest test class

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class TestbedError(RuntimeError):
    """The testbed could run here but something failed; the message carries the log tails."""

    __test__ = False


# --------------------------------------------------------------------------- process helpers

def _proc_stat(pid: int) -> Optional[Tuple[int, int]]:
    """(session id, start time in clock ticks) of a live process, None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = raw[raw.rindex(")") + 2:].split()
    if fields[0] == "Z":
        return None
    return int(fields[3]), int(fields[19])


def _session_members(sid: int, not_before: int) -> List[int]:
    """Live pids in session ``sid`` started at or after tick ``not_before``, the daemon's start.  A
    live process with pid ``sid`` that started at another tick is a new session leader on a reused
    pid: nothing of the daemon's is left then (Linux reuses no pid still naming a live session)."""
    leader = _proc_stat(sid)
    if leader is not None and leader[1] != not_before:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        st = _proc_stat(int(entry))
        if st and st[0] == sid and st[1] >= not_before:
            found.append(int(entry))
    return found


def _terminate(find_pids: Callable[[], List[int]], grace_s: float, kill_wait_s: float) -> None:
    """TERM what find_pids() returns, wait up to grace_s, then KILL what is left and wait kill_wait_s."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, kill_wait_s)):
        pids = find_pids()
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and find_pids():
            time.sleep(0.05)


def _kill_session(sid: int, start_ticks: int, grace_s: float = 5.0) -> None:
    """TERM every process of a daemon's session, then KILL what is left after ``grace_s``."""
    _terminate(lambda: _session_members(sid, start_ticks), grace_s, 2.0)


def _processes_using_conf(conf: Path) -> List[int]:
    """Pids (other than ours) whose environment names this slurm.conf: the daemons, slurmstepd
    (which leaves the slurmd session with setsid) and the job processes below it."""
    needle = b"SLURM_CONF=" + str(conf).encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if needle in env and _proc_stat(int(entry)) is not None:
            found.append(int(entry))
    return found


def _kill_conf_users(conf: Path, grace_s: float = 3.0) -> None:
    _terminate(lambda: _processes_using_conf(conf), grace_s, grace_s)


_Row = Tuple[int, int, int, int, str, str]


class _Registry:
    """Lines ``owner_pid owner_start daemon_pid daemon_start name slurm_conf`` in RUN_DIR/daemons."""

    def __init__(self) -> None:
        RUN_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
        st = _proc_stat(os.getpid())
        assert st is not None
        self.me = (os.getpid(), st[1])

    def _read(self) -> List[_Row]:
        try:
            text = REGISTRY.read_text()
        except FileNotFoundError:
            return []
        rows = []
        for line in text.splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and all(p.isdigit() for p in parts[:4]):
                rows.append((int(parts[0]), int(parts[1]), int(parts[2]), int(parts[3]), parts[4], parts[5]))
        return rows

    def _write(self, rows: Sequence[_Row]) -> None:
        tmp = REGISTRY.with_name(f"{REGISTRY.name}.{os.getpid()}.tmp")
        tmp.write_text("".join(" ".join(map(str, r)) + "\n" for r in rows))
        os.replace(tmp, REGISTRY)

    def add(self, pid: int, start: int, name: str, conf: Path) -> None:
        self._write(self._read() + [(self.me[0], self.me[1], pid, start, name, str(conf))])

    def remove(self, pid: int) -> None:
        self._write([r for r in self._read() if not (r[:2] == self.me and r[2] == pid)])

    def reap_orphans(self) -> List[str]:
        """End daemons (and their jobs) registered by a testbed process that no longer exists."""
        keep, reaped, confs = [], [], set()
        for row in self._read():
            owner = _proc_stat(row[0])
            if owner is not None and owner[1] == row[1]:
                keep.append(row)  # its owner still runs (maybe a concurrent session): leave it
                continue
            if _session_members(row[2], row[3]):
                _kill_session(row[2], row[3])
                reaped.append(f"{row[4]} (pid {row[2]})")
            confs.add(row[5])
        for conf in confs:
            _kill_conf_users(Path(conf))
        self._write(keep)
        return reaped


class _Daemon:
    def __init__(self, name: str, proc: "subprocess.Popen[bytes]", start_ticks: int, log: Path):
        self.name, self.proc, self.start_ticks, self.log = name, proc, start_ticks, log

    @property
    def pid(self) -> int:
        return self.proc.pid


# --------------------------------------------------------------------------- parsing helpers

_KEY_RE = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/.]*)=")


def parse_key_values(line: str) -> Dict[str, str]:
    """Parse one ``scontrol -o show ...`` line; values may contain spaces (Reason=..., Comment=...)."""
    line = line.strip()
    matches = list(_KEY_RE.finditer(line))
    out: Dict[str, str] = {}
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        out[m.group(1)] = line[m.end():end].strip()
    return out


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"({path}: {e.strerror})"
    return "\n".join(text.splitlines()[-lines:])


def _port_free(port: int) -> bool:
    for family, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET, "127.0.0.1")):
        s = socket.socket(family, socket.SOCK_STREAM)
        try:
            s.bind((addr, port))
        except OSError:
            return False
        finally:
            s.close()
    return True


def _free_ports(count: int) -> List[int]:
    # Start at a random place in the range: another cluster on this machine (a developer's,
    # a second session's) may hold fixed ports near 16817, and a bind check is only a snapshot.
    lo, hi = PORT_RANGE
    first = lo + secrets.randbelow(hi - lo + 1)
    candidates = list(range(first, hi + 1)) + list(range(lo, first))
    ports = []
    for p in candidates:
        if _port_free(p):
            ports.append(p)
            if len(ports) == count:
                break
    if len(ports) < count:
        raise TestbedError(f"need {count} free TCP ports in {PORT_RANGE[0]}-{PORT_RANGE[1]}, found {len(ports)}")
    return ports


def _enterable_by_others(path: Path) -> bool:
    """Can other users reach ``path`` (components still to be created will be made 0755)?"""
    for p in [path, *path.parents]:
        try:
            if not os.stat(p).st_mode & stat.S_IXOTH:
                return False
        except FileNotFoundError:
            continue
    return True


def _slurmd_cpus(path: str = SBIN_PATH) -> int:
    """CPUs as slurmd itself counts them (`slurmd -C`), falling back to os.cpu_count()."""
    try:
        slurmd = shutil.which("slurmd", path=path) or "slurmd"
        out = subprocess.run([slurmd, "-C"], capture_output=True, text=True, timeout=10).stdout
        m = re.search(r"\bCPUs=(\d+)", out)
        if m:
            return int(m.group(1))
    except (OSError, subprocess.TimeoutExpired):
        pass
    return os.cpu_count() or 1


# --------------------------------------------------------------------------- slurmd -G alone

def slurm_version() -> Tuple[int, int, int]:
    """This machine's Slurm, from `slurmd -V` ("slurm-wlm 24.11.5"): the one client command that
    answers without a slurm.conf on every version (26.05's `sinfo --version` needs one)."""
    exe = shutil.which("slurmd", path=SBIN_PATH)
    if exe is None:
        raise TestbedUnavailable("slurmd is not installed (run .ci/install-deps.sh)")
    out = subprocess.run([exe, "-V"], capture_output=True, text=True, timeout=30).stdout
    m = re.search(r"(\d+)\.(\d+)\.(\d+)", out)
    if not m:
        raise TestbedError(f"cannot read the Slurm version from `slurmd -V`: {out!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


class Munged:
    """A munged of its own (key, socket, pid) for `slurmd -G`, which from Slurm 24.11 on creates a
    credential at start and so needs munge (22.05 did not). Stopped by pid."""

    def __init__(self) -> None:
        # munged wants every directory above its socket enterable by all (pytest's tmp_path is not).
        self.dir = Path(tempfile.mkdtemp(prefix="slurm-gpu-munge-"))
        self.socket = self.dir / "munge.socket"
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> "Munged":
        exe = shutil.which("munged", path=SBIN_PATH)
        if exe is None:
            raise TestbedUnavailable("munged is not installed (run .ci/install-deps.sh)")
        os.chmod(self.dir, 0o755)
        key = self.dir / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        os.chmod(key, 0o600)
        with open(self.dir / "munged.out", "ab") as out:
            self.proc = subprocess.Popen(
                [exe, "--foreground", f"--socket={self.socket}", f"--key-file={key}",
                 f"--pid-file={self.dir / 'munged.pid'}", f"--seed-file={self.dir / 'munged.seed'}",
                 f"--log-file={self.dir / 'munged.log'}"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 10
        while not self.socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise TestbedError(f"munged did not start: {(self.dir / 'munged.out').read_text()[-2000:]}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=8)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=8)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)


GRES_RECORD = re.compile(r"Gres Name=gpu Type=(\S+) Count=(\d+) Index=(\S+) ID=\S+ File=(\S+)"
                         r"(?: Cores=(\S*))?(?: CoreCnt=\S+)?(?: Links=(\S*))?")


class GresRecordSeen(NamedTuple):
    """One GPU GRES record as `slurmd -G` with DebugFlags=Gres prints it, in index order."""
    type: str          # "" where slurmd says (null)
    files: str         # as printed: /dev/nvidia0 or /dev/nvidia0,/dev/nvidia-caps/nvidia-cap12,...
    cores: str
    links: str         # "" where slurmd says (null)
    line: str


def parse_gres_records(output: str) -> List[GresRecordSeen]:
    out = []
    for line in output.splitlines():
        m = GRES_RECORD.search(line)
        if m:
            def val(v: Optional[str]) -> str:
                return "" if v in (None, "(null)") else v
            out.append(GresRecordSeen(val(m.group(1)), m.group(4), val(m.group(5)), val(m.group(6)), line.strip()))
    return out


# Keys a lone `slurmd -G` needs; a given slurm.conf's own values for them are replaced.
_STANDALONE_KEYS = ("authtype", "authinfo", "credtype", "slurmuser", "slurmduser", "statesavelocation",
                    "slurmdspooldir", "slurmdpidfile", "slurmdlogfile", "proctracktype", "taskplugin", "debugflags")


def run_slurmd_G(slurm_conf: Path, node: str, munge: Munged, *, env: Optional[Mapping[str, str]] = None,
                 mig_minors: Optional[str] = None, timeout: float = 60) -> str:
    """`slurmd -G -N node` on a slurm.conf and the gres.conf beside it; returns its output.

    Both are copied to a directory of their own with what a lone slurmd needs on every version
    (this munged, spool and state directories, linuxproc/none plugins, DebugFlags=Gres).
    `env` reaches slurmd (AutoDetect=nvml: LD_LIBRARY_PATH to a libnvidia-ml.so.1, SIMNVML_STATE).
    `mig_minors`: the text of /proc/driver/nvidia-caps/mig-minors, which Slurm's NVML plugin reads
    for MIG slices; slurmd then runs in a mount namespace of its own with that file on a tmpfs over
    /proc/driver (this machine's /proc is not touched)."""
    src = Path(slurm_conf)
    work = Path(tempfile.mkdtemp(prefix="slurmd-G-", dir=str(src.parent.parent)))
    conf = work / "etc"
    for d in (conf, work / "spool", work / "state"):
        d.mkdir(parents=True)
    if (src.parent / "gres.conf").exists():
        shutil.copyfile(src.parent / "gres.conf", conf / "gres.conf")
    kept = [ln for ln in src.read_text().splitlines()
            if ln.split("=", 1)[0].strip().lower() not in _STANDALONE_KEYS]
    (conf / "slurm.conf").write_text("\n".join(kept + [
        "AuthType=auth/munge", f"AuthInfo=socket={munge.socket}", "CredType=cred/munge",
        "SlurmUser=root", "SlurmdUser=root", f"StateSaveLocation={work}/state", f"SlurmdSpoolDir={work}/spool",
        f"SlurmdPidFile={work}/slurmd.pid", f"SlurmdLogFile={work}/slurmd.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "DebugFlags=Gres", ""]))
    exe = shutil.which("slurmd", path=SBIN_PATH)
    if exe is None:
        raise TestbedUnavailable("slurmd is not installed (run .ci/install-deps.sh)")
    argv: List[str] = [exe, "-G", "-f", str(conf / "slurm.conf"), "-N", node]
    if mig_minors is not None:
        (work / "mig-minors").write_text(mig_minors)
        # Private propagation for /proc in the new namespace: the tmpfs never reaches the host's.
        argv = ["unshare", "--mount", "--propagation", "unchanged", "sh", "-c",
                'mount --make-private /proc && mount -t tmpfs -o mode=755 driver /proc/driver && '
                'mkdir /proc/driver/nvidia-caps && cp "$0" /proc/driver/nvidia-caps/mig-minors && exec "$@"',
                str(work / "mig-minors"), *argv]
    full_env = {"PATH": SBIN_PATH, "SLURM_CONF": str(conf / "slurm.conf"), **(env or {})}
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=full_env)
    return res.stdout + res.stderr


def slurmd_gres(workdir: Path, munge: Munged, node: str, node_gres: str, gres_conf: str, *,
                cpus: Optional[int] = None, **kwargs) -> Tuple[List[GresRecordSeen], str]:
    """(GPU records in slurmd's index order, slurmd's output) for a node declared
    `NodeName=node ... Gres=node_gres` with this gres.conf (keyword arguments: run_slurmd_G's)."""
    conf = Path(workdir) / "etc"
    conf.mkdir(parents=True, exist_ok=True)
    (conf / "gres.conf").write_text(gres_conf)
    (conf / "slurm.conf").write_text("\n".join([
        "ClusterName=gresprobe", "SlurmctldHost=localhost", "SelectType=select/cons_tres", "GresTypes=gpu",
        f"NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus or _slurmd_cpus()} Gres={node_gres}",
        "PartitionName=p Nodes=ALL Default=YES", ""]))
    output = run_slurmd_G(conf / "slurm.conf", node, munge, **kwargs)
    return parse_gres_records(output), output


# --------------------------------------------------------------------------- the testbed

def reap_crashed_runs(registry: Optional[_Registry] = None) -> List[str]:
    """End daemons (and their jobs) whose testbed owner process died; return what was ended."""
    reaped = (registry or _Registry()).reap_orphans()
    if reaped:
        print("testbed: ended daemons left by a crashed run: " + ", ".join(reaped))
    return reaped


# Cluster start-ups, counted for the suite's summary (tests/conftest.py): tests/conftest.py names a
# file in SLURM_TESTBED_STARTS, so the clusters a test's child process starts count too.
STARTS_ENV = "SLURM_TESTBED_STARTS"


def _count_start(bed: "SlurmTestbed") -> None:
    path = os.environ.get(STARTS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {bed.startup_s:.1f} {','.join(bed.nodes)} {bed.workdir}\n")


def started_clusters() -> List[str]:
    """One line per cluster started in this session (pid, seconds, nodes, work directory)."""
    path = os.environ.get(STARTS_ENV)
    try:
        return Path(path).read_text().splitlines() if path else []
    except FileNotFoundError:
        return []


def check_available() -> None:
    """Raise TestbedUnavailable when this machine cannot run the testbed at all."""
    if os.geteuid() != 0:
        raise TestbedUnavailable("the Slurm testbed must run as root (slurmd runs prolog/epilog as root)")
    missing = [b for b in BINARIES if shutil.which(b, path=SBIN_PATH) is None]
    if missing:
        raise TestbedUnavailable(
            "missing programs: " + ", ".join(missing) + " (run .ci/install-deps.sh: "
            "slurmctld slurmd slurm-client munge slurmdbd mariadb-server)")
    try:
        pwd.getpwnam(JOB_USER)
    except KeyError:
        raise TestbedUnavailable(f"user {JOB_USER!r} missing (run .ci/install-deps.sh)") from None


NodeStateTest = Union[str, Callable[[Dict[str, str]], bool]]
_OUT_OF_SERVICE = ("DRAIN", "DOWN", "FAIL", "NOT_RESPONDING", "INVAL")


def _in_service(info: Mapping[str, str]) -> bool:
    """IDLE/MIXED/ALLOCATED without a flag that keeps jobs away."""
    state = info.get("State", "")
    return bool(state) and not any(flag in state for flag in _OUT_OF_SERVICE)


class SlurmTestbed:
    """A real Slurm cluster (accounting included) on 127.0.0.1; see the module docstring."""

    __test__ = False

    def __init__(
        self,
        workdir: Path,
        *,
        nodes: Sequence[str] = ("gpu01", "gpu02"),
        gpus_per_node: int = 4,
        gpu_type: str = "h100",
        prolog: Optional[str] = None,
        epilog: Optional[str] = None,
        slurm_gpu_config: Optional[str] = None,
        prolog_epilog_timeout: int = 60,
        health_check_program: Optional[str] = None,
        extra_slurm_conf: str = "",
        extra_slurmdbd_conf: str = "",
        epilog_slurmctld: Optional[str] = None,
        extra_node_env: Optional[dict] = None,
        gres_conf: Optional[str] = None,
        node_gres: Optional[Mapping[str, str]] = None,
        slurm_prefix: Optional[str] = None,
        on_reboot: Optional[Callable[[str], None]] = None,
        switchable_hooks: bool = False,
        cgroups: Optional[bool] = None,
    ):
        self.workdir = Path(workdir).resolve()
        self.nodes = tuple(nodes)
        self.gpus_per_node = gpus_per_node
        self.gpu_type = gpu_type
        self.prolog = prolog
        self.epilog = epilog
        self.slurm_gpu_config = slurm_gpu_config
        self.prolog_epilog_timeout = prolog_epilog_timeout
        self.health_check_program = health_check_program
        self.extra_slurm_conf = extra_slurm_conf
        self.extra_slurmdbd_conf = extra_slurmdbd_conf  # e.g. PrivateData=jobs (sacct's privacy lives here)
        self.epilog_slurmctld = epilog_slurmctld
        self.extra_node_env = dict(extra_node_env or {})
        self.gres_conf = gres_conf  # verbatim gres.conf instead of the generated one
        # slurm.conf Gres= per node (e.g. {"gpu01": "gpu:a100:1,gpu:v100:2"}) instead of gpu:<type>:<n>
        self.node_gres = dict(node_gres or {})
        # Another Slurm build than Debian's, e.g. /opt/slurm-25.11 (./configure --prefix): its
        # sbin/ and bin/ come first on the daemons' and the clients' PATH (munged and MariaDB
        # still come from the system).  docs/testbed.md#another-slurm-build
        self.sbin_path = (f"{slurm_prefix}/sbin:{slurm_prefix}/bin:" if slurm_prefix else "") + SBIN_PATH
        for hook in (prolog, epilog, health_check_program, epilog_slurmctld):
            if hook is not None and not os.path.isabs(hook):
                raise ValueError(f"hook path must be absolute (slurmd runs it without PATH): {hook!r}")

        # What the job user must reach (slurm.conf, the munge socket, job scripts and output,
        # slurmd's spool from which slurmstepd execs the batch script as that user)
        # lives in the work directory when others can enter it. pytest's tmp_path cannot be
        # entered (/tmp/pytest-of-root is 0700): then a /tmp/slurm-gpu-testbed-* directory,
        # removed by stop(), holds those parts and the rest stays in the work directory.
        if _enterable_by_others(self.workdir):
            self.public_dir = self.workdir
        else:
            self.public_dir = Path(tempfile.mkdtemp(prefix="slurm-gpu-testbed-", dir="/tmp"))
            os.chmod(self.public_dir, 0o755)
        self.conf_dir = self.public_dir / "etc"
        self.slurm_conf = self.conf_dir / "slurm.conf"
        self.log_dir = self.workdir / "log"
        self.jobs_dir = self.public_dir / "jobs"
        self._run_dir = self.workdir / "run"
        self._munge_dir = self.public_dir / "munge"
        self._munge_socket = self._munge_dir / "munge.socket"
        self._db_dir = self.workdir / "mysql"
        self._db_socket = self._db_dir / "mysqld.sock"
        self._db_password = secrets.token_hex(12)

        self.ports: Dict[str, int] = {}
        self.startup_s: Optional[float] = None
        self._daemons: Dict[str, _Daemon] = {}
        self._registry: Optional[_Registry] = None
        self._job_seq = 0
        self._started = False
        # `scontrol reboot`: with on_reboot, slurmd's RebootProgram asks this testbed for a boot,
        # which is: that slurmd stopped, on_reboot(node) (what the boot does to the node's
        # simulated hardware), the slurmd started again with -b ("report node reboot now", so
        # slurmctld sees a boot time after its reboot request). Each boot: (node, time) in reboots.
        self.on_reboot = on_reboot
        self.reboots: List[Tuple[str, float]] = []
        self._boot_thread: Optional[threading.Thread] = None
        self._boot_stop = threading.Event()
        # A shared cluster (docs/testbed.md, "Shared clusters"): slurm.conf names a link per hook,
        # which use_hooks() points at a test's script (or a no-op) without a restart.
        self.switchable_hooks = switchable_hooks
        # The production shape (docs/testbed.md, "Production shape"): proctrack/cgroup, task/cgroup with
        # ConstrainDevices, PrologFlags=Alloc,Contain, jobacct_gather/cgroup, the slurmd's in a cgroup
        # namespace of this testbed's own (tests/cgroupnest.py).  None: wherever this machine has
        # cgroup v1 (required in CI); False: linuxproc and task/none, for what only that shape shows.
        self.cgroups = cgroups
        self._nest: Optional[cgroupnest.CgroupNest] = None
        self.hooks_dir = self.conf_dir / "hooks"
        self._hooks_given = {"prolog": prolog, "epilog": epilog, "health_check_program": health_check_program,
                             "epilog_slurmctld": epilog_slurmctld}
        # A glob (prolog.d/*) slurmd expands itself: it stays in slurm.conf as given, never a link.
        self._hooks_fixed = {k: v for k, v in self._hooks_given.items() if v and glob.has_magic(v)}

    # ----------------------------------------------------------------- context manager
    def __enter__(self) -> "SlurmTestbed":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----------------------------------------------------------------- public properties
    @property
    def env(self) -> Dict[str, str]:
        """Environment for Slurm client commands: SLURM_CONF, a PATH with the sbin dirs, no inherited
        SLURM_*, and no SIMNVML_*: a command run on a node finds that node's simulated GPUs as the
        hooks do (the library's default state), never a state file a test process pointed at."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "SBATCH_", "SQUEUE_", "SINFO_", "SACCT_", "SIMNVML_"))}
        env["SLURM_CONF"] = str(self.slurm_conf)
        env["PATH"] = self.sbin_path + (":" + env["PATH"] if env.get("PATH") else "")
        return env

    @property
    def gpu_minors(self) -> Dict[str, List[int]]:
        """Device minor numbers (= /dev/nvidiaN) that each node's gres.conf names, in order."""
        return {n: list(range(i * self.gpus_per_node, (i + 1) * self.gpus_per_node)) for i, n in enumerate(self.nodes)}

    # ----------------------------------------------------------------- lifecycle
    def check_available(self) -> None:
        """Raise TestbedUnavailable when this machine cannot run the testbed at all."""
        check_available()

    def start(self) -> "SlurmTestbed":
        """Start every daemon and wait until all nodes are IDLE (typically ~10 s)."""
        if self._started:
            return self
        self.check_available()
        t0 = time.monotonic()
        self._registry = _Registry()
        reap_crashed_runs(self._registry)
        self._started = True
        try:
            self._prepare_dirs()
            self._make_devices()
            self._prepare_cgroups()
            ports = _free_ports(4 + len(self.nodes))
            self.ports = {"slurmctld": ports[0], "slurmdbd": ports[1], "mariadb": ports[2]}
            for i, node in enumerate(self.nodes):
                self.ports[node] = ports[3 + i]
            self._write_configs()
            self._start_munged()
            self._start_mariadb()
            self._start_slurmdbd()
            self._setup_accounting()
            self.start_slurmctld()
            for node in self.nodes:
                self._start_slurmd(node)
            self._wait_registered()
            if self.on_reboot is not None:
                self._boot_stop.clear()
                self._boot_thread = threading.Thread(target=self._serve_boots, name="testbed-boots", daemon=True)
                self._boot_thread.start()
        except TestbedUnavailable:
            self.stop()
            raise
        except BaseException as e:
            report = self._failure_report(f"testbed start failed: {e}")
            self.stop()
            if isinstance(e, Exception):
                raise TestbedError(report) from e
            raise
        self.startup_s = time.monotonic() - t0
        _count_start(self)
        return self

    def stop(self) -> None:
        """End every daemon this testbed started (TERM, then KILL), newest first. Idempotent."""
        if not self._started:
            return
        if self._boot_thread is not None:
            self._boot_stop.set()
            self._boot_thread.join(timeout=30)
            self._boot_thread = None
        if "slurmctld" in self._daemons:
            # Cancel jobs first so slurmstepd processes end cleanly with their slurmd.
            try:
                ids = self._live_job_ids()
                if ids:
                    subprocess.run(["scancel", "--quiet", *map(str, ids)], env=self.env,
                                   capture_output=True, timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass  # an unresponsive controller: the kills below end the jobs anyway
        for name in reversed(list(self._daemons)):
            self._stop_daemon(name)
        # slurmstepd and job processes left behind (e.g. a job that ignored SIGTERM).
        _kill_conf_users(self.slurm_conf)
        if self._nest is not None:
            stuck = self._nest.remove()
            if stuck:
                print(f"testbed: cgroups still holding processes, left: {', '.join(stuck)}")
            self._nest = None
        if self.public_dir != self.workdir:
            shutil.rmtree(self.public_dir, ignore_errors=True)
        self._started = False

    def _live_job_ids(self) -> List[int]:
        try:
            out = subprocess.run(["squeue", "-h", "-o", "%A"], env=self.env, capture_output=True,
                                 text=True, timeout=10).stdout
        except subprocess.TimeoutExpired:
            return []
        return [int(x) for x in out.split() if x.isdigit()]

    # ----------------------------------------------------------------- setup steps
    def _prepare_dirs(self) -> None:
        for d in (self.workdir, self.public_dir):
            d.mkdir(mode=0o755, parents=True, exist_ok=True)
            os.chmod(d, 0o755)
        for d in (self.conf_dir, self.log_dir, self._run_dir, self._boot_requests, self._munge_dir, self._db_dir,
                  self.workdir / "state", self.public_dir / "spool"):
            d.mkdir(exist_ok=True)
            os.chown(d, 0, 0)
            os.chmod(d, 0o755)
        self.jobs_dir.mkdir(exist_ok=True)
        user = pwd.getpwnam(JOB_USER)
        os.chown(self.jobs_dir, user.pw_uid, user.pw_gid)
        os.chmod(self.jobs_dir, 0o755)

    def _prepare_cgroups(self) -> None:
        if self.cgroups is None:
            reason = cgroupnest.unavailable_reason()
            if reason and os.environ.get("CI"):
                raise TestbedUnavailable(f"the production-shaped testbed: {reason}")
            self.cgroups = reason is None
        if self.cgroups:
            cgroupnest.remove_orphans()
            self._nest = cgroupnest.CgroupNest().create()

    def escape_cgroups(self, pid: int) -> None:
        """Move a process out of its job's cgroups into this testbed's root ones (what a site script
        or a setuid helper run by the user could do): Slurm no longer ends it with the job."""
        if self._nest is None:
            raise TestbedError("escape_cgroups: this testbed runs without cgroups of its own")
        for d in self._nest.dirs:
            (d / "cgroup.procs").write_text(f"{pid}\n")

    def _make_devices(self) -> None:
        for n in range(self.gpus_per_node * len(self.nodes)):
            dev = f"/dev/nvidia{n}"
            if os.path.exists(dev):
                continue
            try:
                os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(NVIDIA_MAJOR, n))
            except OSError as e:
                raise TestbedUnavailable(f"cannot create GPU device file {dev}: {e.strerror} "
                                         "(the testbed needs mknod, e.g. a privileged container)") from None

    def _write_file(self, path: Path, text: str, mode: int = 0o644) -> None:
        path.write_text(text)
        os.chown(path, 0, 0)
        os.chmod(path, mode)

    def slurm_conf_text(self) -> str:
        host = socket.gethostname().split(".")[0]
        cpus = max(_slurmd_cpus(self.sbin_path), self.gpus_per_node)
        w = self.workdir
        settings: List[Tuple[str, str]] = [
            ("ClusterName", CLUSTER),
            ("SlurmctldHost", f"{host}(127.0.0.1)"),
            ("SlurmctldPort", str(self.ports["slurmctld"])),
            ("AuthType", "auth/munge"),
            # cred_expire also delays a requeued job (e.g. after a prolog failure) by
            # cred_expire + 1 s; Slurm's default 120 s would make requeue tests crawl.
            ("AuthInfo", f"socket={self._munge_socket},cred_expire={CRED_EXPIRE_S}"),
            ("CredType", "cred/munge"),
            ("SlurmUser", "root"),
            ("SlurmdUser", "root"),
            ("StateSaveLocation", str(w / "state")),
            ("SlurmdSpoolDir", str(self.public_dir / "spool" / "%n")),
            ("SlurmctldPidFile", str(self._run_dir / "slurmctld.pid")),
            ("SlurmdPidFile", str(self._run_dir / "slurmd-%n.pid")),
            ("SlurmctldLogFile", str(self.log_dir / "slurmctld.log")),
            ("SlurmdLogFile", str(self.log_dir / "slurmd-%n.log")),
            ("SlurmctldDebug", "info"),
            ("SlurmdDebug", "info"),
            ("PlugStackConfig", str(self.conf_dir / "plugstack.conf")),
            ("MpiDefault", "none"),
            ("SwitchType", "switch/none"),
            *self._process_settings(),
            ("SelectType", "select/cons_tres"),
            ("SelectTypeParameters", "CR_Core"),
            ("GresTypes", "gpu"),
            # The nodes share one machine: slurmd reports the configured CPUs, so each node
            # can run one single-CPU job per GPU even on a 2-core CI runner.
            ("SlurmdParameters", "config_overrides"),
            ("AccountingStorageType", "accounting_storage/slurmdbd"),
            ("AccountingStorageHost", "127.0.0.1"),
            ("AccountingStoragePort", str(self.ports["slurmdbd"])),
            # The slurmdbd connection authenticates through AccountingStoragePass (a munge
            # socket path), not AuthInfo: without it clients look for the system munged.
            ("AccountingStoragePass", str(self._munge_socket)),
            ("AccountingStorageTRES", "gres/gpu"),
            ("JobCompType", "jobcomp/none"),
            ("SchedulerParameters", "nohold_on_prolog_fail,sched_interval=2,batch_sched_delay=0"),
            ("ReturnToService", "2"),
            ("PrologEpilogTimeout", str(self.prolog_epilog_timeout)),
            ("PrologFlags", "Alloc,Contain" if self.cgroups else "Alloc"),
            ("SlurmdTimeout", "30"),
            ("SlurmctldTimeout", "30"),
            ("MessageTimeout", "5"),
            ("InactiveLimit", "0"),
            ("KillWait", "3"),
            ("MinJobAge", "600"),
            ("Waittime", "0"),
        ]
        hooks = {k: (self._hooks_fixed.get(k) or str(self.hooks_dir / k) if self.switchable_hooks else v)
                 for k, v in self._hooks_given.items()}
        if hooks["prolog"]:
            settings.append(("Prolog", hooks["prolog"]))
        if hooks["epilog"]:
            settings.append(("Epilog", hooks["epilog"]))
        if hooks["epilog_slurmctld"]:
            settings.append(("EpilogSlurmctld", hooks["epilog_slurmctld"]))
        if hooks["health_check_program"]:
            interval = SWITCHABLE_HEALTH_CHECK_INTERVAL_S if self.switchable_hooks else 60
            settings += [("HealthCheckProgram", hooks["health_check_program"]), ("HealthCheckInterval", str(interval))]
        if self.on_reboot is not None:
            settings += [("RebootProgram", str(self._reboot_program)), ("ResumeTimeout", "60")]
        # A key repeated in extra_slurm_conf replaces the default (e.g. PrologFlags=, HealthCheckInterval=).
        overridden = {m.group(1).lower() for m in re.finditer(r"^\s*([A-Za-z]+)\s*=", self.extra_slurm_conf, re.M)}
        lines = ["# generated by tests/testbed.py"]
        lines += [f"{k}={v}" for k, v in settings if k.lower() not in overridden]
        if self.extra_slurm_conf.strip():
            lines += ["# extra_slurm_conf", self.extra_slurm_conf.strip()]
        for node in self.nodes:
            # 25.11 refuses one NodeHostname for two nodes ("Duplicated NodeHostName", the second
            # never answers): there each node is its own host name (NodeAddr is what connects).
            if self.sbin_path != SBIN_PATH:
                host = node
            gres = self.node_gres.get(node, f"gpu:{self.gpu_type}:{self.gpus_per_node}")
            lines.append(f"NodeName={node} NodeAddr=127.0.0.1 NodeHostname={host} Port={self.ports[node]} "
                         f"CPUs={cpus} RealMemory=1000 Gres={gres} State=UNKNOWN")
        lines.append(f"PartitionName=gpu Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def _process_settings(self) -> List[Tuple[str, str]]:
        """How slurmd tracks, confines and accounts a job's processes: a GPU site's cgroup plugins, or
        linuxproc and no confinement (cgroups=False)."""
        if not self.cgroups:
            return [("ProctrackType", "proctrack/linuxproc"), ("TaskPlugin", "task/none"),
                    ("JobAcctGatherType", "jobacct_gather/none")]
        return [("ProctrackType", "proctrack/cgroup"), ("TaskPlugin", "task/cgroup,task/affinity"),
                ("JobAcctGatherType", "jobacct_gather/cgroup")]

    def cgroup_conf_text(self) -> str:
        """cgroup.conf of the production shape: v1 (what these machines have), devices confined to the
        job's GPUs (the gres.conf File= nodes)."""
        return "# generated by tests/testbed.py\nCgroupPlugin=cgroup/v1\nConstrainDevices=yes\n"

    def gres_conf_text(self) -> str:
        """gres.conf: each node names its own device minors, gpu01 /dev/nvidia[0-3], gpu02 /dev/nvidia[4-7]."""
        if self.gres_conf is not None:
            return self.gres_conf
        gres = []
        for node, minors in self.gpu_minors.items():
            files = f"/dev/nvidia[{minors[0]}-{minors[-1]}]" if len(minors) > 1 else f"/dev/nvidia{minors[0]}"
            gres.append(f"NodeName={node} Name=gpu Type={self.gpu_type} File={files}")
        return "\n".join(gres) + "\n"

    def _write_configs(self) -> None:
        self._write_file(self.slurm_conf, self.slurm_conf_text())
        self._write_file(self.conf_dir / "gres.conf", self.gres_conf_text())
        if self.cgroups:
            self._write_file(self.conf_dir / "cgroup.conf", self.cgroup_conf_text())
        # Keep the Debian default /etc/slurm/plugstack.conf (and its includes) out of the testbed.
        self._write_file(self.conf_dir / "plugstack.conf", "")
        host = socket.gethostname().split(".")[0]
        dbd = [
            "AuthType=auth/munge", f"AuthInfo=socket={self._munge_socket}",
            f"DbdHost={host}", "DbdAddr=127.0.0.1", f"DbdPort={self.ports['slurmdbd']}",
            "SlurmUser=root", "DebugLevel=info",
            f"LogFile={self.log_dir / 'slurmdbd.log'}", f"PidFile={self._run_dir / 'slurmdbd.pid'}",
            "StorageType=accounting_storage/mysql", "StorageHost=127.0.0.1",
            f"StoragePort={self.ports['mariadb']}", f"StorageUser={DB_USER}",
            f"StoragePass={self._db_password}", f"StorageLoc={DB_NAME}",
            # As sites run it: a user's sacct shows that user's jobs alone (root and SlurmUser see all).
            "PrivateData=jobs",
        ] + [line.strip() for line in self.extra_slurmdbd_conf.splitlines() if line.strip()]
        self._write_file(self.conf_dir / "slurmdbd.conf", "\n".join(dbd) + "\n", 0o600)
        if self.switchable_hooks:
            self.hooks_dir.mkdir(mode=0o755, exist_ok=True)
            self._write_file(self.hooks_dir / NO_HOOK, "#!/bin/sh\n# tests/testbed.py: no hook set (use_hooks)\nexit 0\n", 0o755)
            self.use_hooks(**{k: v for k, v in self._hooks_given.items() if k not in self._hooks_fixed},
                           slurm_gpu_config=self.slurm_gpu_config)
        elif self.slurm_gpu_config is not None:
            self._write_file(self.conf_dir / "slurm-gpu.toml", self.slurm_gpu_config)
        if self.on_reboot is not None:
            # slurmd runs RebootProgram with system(3): up to 24.11 in its own environment (our
            # SLURM_TESTBED_NODE), on 26.05 in a clean one that names the node SLURM_NODE_NAME.
            self._write_file(self._reboot_program, "#!/bin/sh\n# tests/testbed.py: ask the testbed to boot this node\n"
                             f'exec touch "{self._boot_requests}/${{SLURM_NODE_NAME:-$SLURM_TESTBED_NODE}}"\n', 0o755)
            self._build_boot_clock()
        key = self._munge_dir / "munge.key"
        if not key.exists():
            key.write_bytes(secrets.token_bytes(1024))
        os.chmod(key, 0o600)

    def _spawn(self, name: str, argv: Sequence[str], env: Optional[Mapping[str, str]] = None) -> _Daemon:
        log = self.log_dir / f"{name}.out"
        full_env = self.env
        if env:
            full_env.update(env)
        with open(log, "ab") as out:
            proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env=full_env, cwd=str(self.workdir), start_new_session=True)
        st = _proc_stat(proc.pid)
        daemon = _Daemon(name, proc, st[1] if st else 0, log)
        self._daemons[name] = daemon
        assert self._registry is not None
        self._registry.add(proc.pid, daemon.start_ticks, name, self.slurm_conf)
        return daemon

    def _stop_daemon(self, name: str, grace_s: float = 8.0) -> None:
        daemon = self._daemons.pop(name, None)
        if daemon is None:
            return
        if daemon.proc.poll() is None:
            daemon.proc.terminate()
            try:
                daemon.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                daemon.proc.kill()
                daemon.proc.wait(timeout=5)
        # Whatever the daemon left in its session (slurmstepd, job processes) goes too.
        _kill_session(daemon.pid, daemon.start_ticks, grace_s=2.0)
        if self._registry is not None:
            self._registry.remove(daemon.pid)

    def _wait(self, what: str, ready: Callable[[], bool], timeout: float, daemon: Optional[str] = None) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if ready():
                return
            if daemon is not None and self._daemons[daemon].proc.poll() is not None:
                code = self._daemons[daemon].proc.returncode
                raise TestbedError(f"{daemon} exited with status {code} while waiting for {what}")
            if time.monotonic() > deadline:
                raise TestbedError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(0.1)

    def _ok(self, argv: Sequence[str], timeout: float = 10) -> bool:
        try:
            return subprocess.run(list(argv), env=self.env, capture_output=True, timeout=timeout).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def _start_munged(self) -> None:
        m = self._munge_dir
        self._spawn("munged", ["munged", "--foreground", f"--socket={self._munge_socket}",
                               f"--key-file={m / 'munge.key'}", f"--pid-file={m / 'munged.pid'}",
                               f"--seed-file={m / 'munged.seed'}", f"--log-file={self.log_dir / 'munged.log'}",
                               "--num-threads=4"])
        self._wait("the munge socket", self._munge_socket.exists, 10, "munged")

    def _mariadb_opts(self) -> List[str]:
        # Durability is worthless for a throwaway database; these make startup and slurmdbd's
        # schema creation fast on slow CI disks.  The redo log's size is the template's
        # (tests/mariadb.py LOG_FILE_SIZE): another would be a second template, or a resize.
        # Slurm's accounting needs innodb_snapshot_isolation off, as its log says ("not supported by
        # Slurm and will cause slurmdbd to fatal when a write conflicts with a concurrent
        # transaction"); MariaDB turned it on by default in 11.6.2, so Debian 13's 11.8 has it on, and
        # slurmdbd 26.05 died on error 1020 when `sacctmgr modify job` raced its own job update.
        # `loose-`: servers before 10.6.18/10.11.8 do not know the variable (and behave as off).
        return ["--innodb-buffer-pool-size=32M", "--innodb-log-file-size=16M",
                "--innodb-flush-log-at-trx-commit=0", "--innodb-doublewrite=0", "--sync-binlog=0",
                "--innodb-flush-method=nosync", "--loose-innodb-snapshot-isolation=OFF"]

    def _start_mariadb(self) -> None:
        data = self._db_dir / "data"
        if not (data / "mysql").exists():
            # A copy of what mariadb-install-db writes, built once per machine (tests/mariadb.py).
            from mariadb import copy_template
            try:
                copy_template(data, self._mariadb_opts())
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                raise TestbedError(f"the MariaDB data directory: {e}") from e
        self._spawn("mariadbd", ["mariadbd", "--no-defaults", "--user=root", f"--datadir={data}",
                                 f"--socket={self._db_socket}", f"--port={self.ports['mariadb']}",
                                 "--bind-address=127.0.0.1", "--skip-name-resolve", "--skip-log-bin",
                                 f"--pid-file={self._run_dir / 'mariadbd.pid'}",
                                 f"--log-error={self.log_dir / 'mariadbd.log'}", *self._mariadb_opts()])
        self._wait("MariaDB", lambda: self._ok(["mariadb-admin", "--no-defaults", f"--socket={self._db_socket}",
                                                "ping"]), 60, "mariadbd")
        # The database exists before slurmdbd's first start, as Slurm's accounting guide sets it up.
        # Without it slurmdbd 24.11 and 26.05 die on their first start against Debian 13's
        # libmariadb3 3.4.10: Slurm reuses its connection handle after the failed connect
        # (ER_BAD_DB_ERROR), and on that handle the first result set fails with 5027 "Number of
        # columns in result (=1) set exceeds maximum allowed number of columns (=0)"
        # (_check_mysql_concat_is_sane: fatal). docs/testbed.md, "Slurm versions".
        sql = (f"CREATE DATABASE IF NOT EXISTS {DB_NAME};"
               f"CREATE USER IF NOT EXISTS '{DB_USER}'@'127.0.0.1' IDENTIFIED BY '{self._db_password}';"
               f"ALTER USER '{DB_USER}'@'127.0.0.1' IDENTIFIED BY '{self._db_password}';"
               f"GRANT ALL ON *.* TO '{DB_USER}'@'127.0.0.1'; FLUSH PRIVILEGES;")
        r = subprocess.run(["mariadb", "--no-defaults", f"--socket={self._db_socket}", "-u", "root"], input=sql,
                           capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise TestbedError(f"creating the MariaDB user for slurmdbd failed: {r.stderr.strip()}")

    def sql(self, statements: str, database: str = "") -> str:
        """SQL as MariaDB's root over the testbed server's socket (tab-separated, no headers); through
        stdin, never the command line: it may hold an account's password."""
        args = ["mariadb", "--no-defaults", f"--socket={self._db_socket}", "-u", "root", "-N", "-B"]
        r = subprocess.run(args + ([database] if database else []), input=statements,
                           capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise TestbedError(f"mariadb: {r.stderr.strip()}")
        return r.stdout

    @property
    def mariadb_port(self) -> int:
        return self.ports["mariadb"]

    def _start_slurmdbd(self) -> None:
        self._spawn("slurmdbd", ["slurmdbd", "-D"])
        self._wait("slurmdbd", lambda: self._ok(["sacctmgr", "-n", "-P", "show", "cluster"]), 60, "slurmdbd")

    def _setup_accounting(self) -> None:
        self.run("sacctmgr", "-i", "add", "cluster", CLUSTER, check=False)
        self.run("sacctmgr", "-i", "add", "account", *ACCOUNTS, f"cluster={CLUSTER}", check=False)
        # Associated with every account, default physics: jobs can charge `-A chem` too.
        self.run("sacctmgr", "-i", "add", "user", JOB_USER, f"account={','.join(ACCOUNTS)}",
                 f"defaultaccount={ACCOUNTS[0]}", f"cluster={CLUSTER}", check=False)
        try:
            pwd.getpwnam(OTHER_USER)
            self.run("sacctmgr", "-i", "add", "user", OTHER_USER, f"account={ACCOUNTS[1]}",
                     f"defaultaccount={ACCOUNTS[1]}", f"cluster={CLUSTER}", check=False)
        except KeyError:
            pass  # tests that need the second user say so (install-deps.sh creates it)
        out = self.run("sacctmgr", "-n", "-P", "show", "assoc", f"user={JOB_USER}", "format=account").stdout
        if ACCOUNTS[0] not in out.split():
            raise TestbedError(f"accounting setup failed: association {JOB_USER}/{ACCOUNTS[0]} missing ({out!r})")

    def start_slurmctld(self) -> None:
        """Start (or restart after stop_slurmctld) the controller; keeps its saved state.  A restart
        returns once every slurmd has registered again (_wait_registered)."""
        if "slurmctld" in self._daemons:
            return
        restart = any(n.startswith("slurmd-") for n in self._daemons)
        self._spawn("slurmctld", ["slurmctld", "-D"])
        self._wait("slurmctld to answer", lambda: self._ok(["scontrol", "ping"]) and self._ok(["sinfo", "-h"]),
                   30, "slurmctld")
        if restart:
            self._wait_registered()

    def _wait_registered(self, timeout: float = 30) -> None:
        """Until every node is IDLE *and* its slurmd has registered with this slurmctld.  Observed on
        22.05 with a HealthCheckProgram: a restarted slurmctld shows the nodes IDLE from its saved
        state ~3 s before their slurmd registers (SlurmdStartTime=None until then), and a GPU job it
        starts in that window gets its GPUs counted but none named (SLURM_JOB_GPUS empty)."""
        def ready(node: str) -> bool:
            info = self.node_info(node)
            return info.get("State", "") == "IDLE" and info.get("SlurmdStartTime", "") not in ("None", "(null)")
        for node in self.nodes:
            self._wait(f"node {node} to become IDLE and registered", lambda: ready(node), timeout, f"slurmd-{node}")

    def stop_slurmctld(self) -> None:
        """Stop the controller (TERM: it saves state), e.g. to test 'slurmctld unreachable' paths."""
        self._stop_daemon("slurmctld")

    def stop_slurmd(self, node: str) -> None:
        """Stop one node's slurmd (TERM), e.g. a node that cannot start jobs; start_slurmd(node) brings it back."""
        self._stop_daemon(f"slurmd-{node}")

    def start_slurmd(self, node: str, timeout: float = 30) -> None:
        """Start a node's slurmd stopped by stop_slurmd; returns once slurmctld hears from it again (the
        node's State no longer NOT_RESPONDING; a drain or a DOWN state is left for the test)."""
        if f"slurmd-{node}" in self._daemons:
            return
        self._start_slurmd(node)
        self._wait(f"slurmd of {node} to register", lambda: "NOT_RESPONDING" not in self.node_info(node).get("State", "")
                   and "*" not in self.node_info(node).get("State", ""), timeout, f"slurmd-{node}")

    def _start_slurmd(self, node: str, booted_at: Optional[int] = None) -> None:
        """booted_at: the simulated boot's time (whole seconds), which slurmd reports through
        tests/bootclock.c; None: the machine's own boot."""
        env = {k: v for k, v in self.extra_node_env.items() if not isinstance(v, dict)}
        env.update(self.extra_node_env.get(node, {}) if isinstance(self.extra_node_env.get(node), dict) else {})
        env["SLURM_TESTBED_NODE"] = node
        if booted_at is not None:
            env["LD_PRELOAD"] = str(self._boot_clock)
            env["SLURM_TESTBED_BOOT_EPOCH"] = str(booted_at)
        (self.public_dir / "spool" / node).mkdir(exist_ok=True)
        argv = ["slurmd", "-D", "-N", node]
        self._spawn(f"slurmd-{node}", self._nest.wrap(argv) if self._nest is not None else argv, env=env)

    @property
    def _reboot_program(self) -> Path:
        return self.conf_dir / "reboot-program"

    @property
    def _boot_requests(self) -> Path:
        return self._run_dir / "boot-requests"

    @property
    def _boot_clock(self) -> Path:
        return self._run_dir / "bootclock.so"

    def _build_boot_clock(self) -> None:
        """tests/bootclock.c, built here for this machine's (or root filesystem's) C library."""
        cmd = ["cc", "-O2", "-shared", "-fPIC", "-Wall", "-Werror", "-o", str(self._boot_clock),
               str(Path(__file__).resolve().parent / "bootclock.c")]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise TestbedError(f"building the simulated boot clock failed ({' '.join(cmd)}): {r.stderr.strip()}")

    def _serve_boots(self) -> None:
        """The simulated boot, for each request RebootProgram left (see on_reboot)."""
        while not self._boot_stop.wait(0.2):
            for request in sorted(self._boot_requests.iterdir()):
                node = request.name
                request.unlink()
                if node not in self.nodes:
                    continue
                if self._boot_stop.is_set():  # stop() joins this thread before it stops the daemons
                    return
                self._stop_daemon(f"slurmd-{node}")
                assert self.on_reboot is not None
                self.on_reboot(node)
                booted_at = self._boot_after_the_request(node)
                self._start_slurmd(node, booted_at=booted_at)
                self.reboots.append((node, time.time()))

    def _boot_after_the_request(self, node: str, timeout: float = 20) -> int:
        """The simulated boot's time: a real boot takes minutes; ours must still come after
        slurmctld has marked the reboot issued, in a later second (it compares whole-second times:
        seen under load on 22.05, a slurmd started 15 ms after RebootProgram registered before
        slurmctld had taken the reboot as issued, and slurmctld waited for a boot that had happened
        until ResumeTimeout, 'reboot timed out'), and slurmd must start at least two seconds after it
        (slurmctld's "now - uptime" may land a second late; a boot time after the node's first
        response would make the next registration an unexpected reboot: tests/bootclock.c).
        Returns once slurmd may start."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._boot_stop.is_set():
            try:
                if "REBOOT_ISSUED" in self.node_info(node).get("State", ""):
                    break
            except TestbedError:
                pass
            time.sleep(0.2)
        booted_at = int(time.time()) + 1
        time.sleep(max(0.0, booted_at + 2.05 - time.time()))
        return booted_at

    # ----------------------------------------------------------------- diagnostics
    def _failure_report(self, headline: str) -> str:
        return "\n".join([headline] + self._log_tails())

    def _log_tails(self, lines: int = 25) -> List[str]:
        """'--- LOG (tail) ---' and its last lines, for every daemon log that has any."""
        logs = sorted(self.log_dir.glob("*")) if self.log_dir.exists() else []
        tails = ((log, _tail(log, lines)) for log in logs)
        return [f"--- {log} (tail) ---\n{text}" for log, text in tails if text.strip()]

    def diagnostics(self, lines: int = 40) -> str:
        """What a failed test's report carries (tests/integration/conftest.py): each daemon alive or
        with its exit status, the nodes and jobs as slurmctld has them, and the tail of every log."""
        parts = [f"testbed {self.workdir}"]
        for name, d in sorted(self._daemons.items()):
            rc = d.proc.poll()
            parts.append(f"  {name}: pid {d.pid} " + ("running" if rc is None else f"EXITED with {rc}"))
        for argv in (("scontrol", "-o", "show", "node"), ("squeue", "-a", "-o", "%i %T %r %N")):
            try:
                r = self.run(*argv, check=False, timeout=10)
                parts.append(f"--- {' '.join(argv)} (rc {r.returncode}) ---\n{r.stdout}{r.stderr}")
            except Exception as e:  # slurmctld gone: the logs below say why
                parts.append(f"--- {' '.join(argv)}: {e} ---")
        return "\n".join(parts + self._log_tails(lines))

    def slurmd_log(self, node: str) -> str:
        return (self.log_dir / f"slurmd-{node}.log").read_text(errors="replace")

    def slurmctld_log(self) -> str:
        return (self.log_dir / "slurmctld.log").read_text(errors="replace")

    def slurmdbd_log(self) -> str:
        return (self.log_dir / "slurmdbd.log").read_text(errors="replace")

    # ----------------------------------------------------------------- client commands
    def run(self, *argv: str, check: bool = True, timeout: float = 30, user: Optional[str] = None,
            cwd: Optional[Path] = None) -> "subprocess.CompletedProcess[str]":
        """Run a Slurm client command with this cluster's environment (as ``user`` if given)."""
        cmd = list(argv)
        if user and user != "root":
            cmd = ["runuser", "-u", user, "--"] + cmd
        r = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout,
                           cwd=str(cwd) if cwd else None)
        if check and r.returncode != 0:
            raise TestbedError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr.strip() or r.stdout.strip()}")
        return r

    def sbatch(self, script_body: str, *, user: str = JOB_USER, args: Sequence[str] = ()) -> int:
        """Submit a batch script as ``user``; output goes to jobs/slurm-<id>.out. Returns the job id."""
        self._job_seq += 1
        script = self.jobs_dir / f"job-{self._job_seq}.sh"
        if not script_body.startswith("#!"):
            script_body = "#!/bin/bash\n" + script_body
        script.write_text(script_body)
        pw = pwd.getpwnam(user)
        os.chown(script, pw.pw_uid, pw.pw_gid)
        os.chmod(script, 0o755)
        r = self.run("sbatch", "--parsable", f"--chdir={self.jobs_dir}",
                     f"--output={self.jobs_dir / 'slurm-%j.out'}", *args, str(script),
                     user=user, cwd=self.jobs_dir)
        return int(r.stdout.strip().split(";")[0])

    def job_output(self, job_id: int) -> str:
        return (self.jobs_dir / f"slurm-{job_id}.out").read_text(errors="replace")

    def job_info(self, job_id: int) -> Dict[str, str]:
        """``scontrol -o show job`` as a dict; {} when slurmctld no longer knows the job."""
        r = self.run("scontrol", "-o", "show", "job", str(job_id), check=False)
        if r.returncode != 0 or not r.stdout.strip():
            return {}
        return parse_key_values(r.stdout.splitlines()[0])

    def sacct_job(self, job_id: int) -> Dict[str, str]:
        """The allocation line of ``sacct -j`` (State, Account, User, NodeList, ExitCode, AllocTRES, ...)."""
        fields = "JobID,State,Account,User,Partition,NodeList,ExitCode,AllocTRES"
        r = self.run("sacct", "-n", "-P", "-X", "-j", str(job_id), f"--format={fields}")
        for line in r.stdout.splitlines():
            values = line.split("|")
            if values and values[0] == str(job_id):
                return dict(zip(fields.split(","), values))
        return {}

    def wait_sacct(self, job_id: int, timeout: float = 15) -> Dict[str, str]:
        """``sacct_job`` once slurmdbd has the job's final state (slurmctld sends it asynchronously)."""
        deadline = time.monotonic() + timeout
        while True:
            row = self.sacct_job(job_id)
            if row and row.get("State", "").split()[0] in TERMINAL_JOB_STATES:
                return row
            if time.monotonic() > deadline:
                raise TimeoutError(f"sacct has no final record of job {job_id} after {timeout:.0f} s: {row}")
            time.sleep(0.3)

    def wait_job(self, job_id: int, timeout: float = 60) -> str:
        """Wait until the job ends (requeues and pending restarts are waited through); return its state."""
        deadline = time.monotonic() + timeout
        state = ""
        while True:
            info = self.job_info(job_id)
            state = info.get("JobState", "")
            if not info:  # slurmctld forgot the job (MinJobAge, restart): ask the database
                state = (self.sacct_job(job_id).get("State", "").split() or [""])[0]
            if state in TERMINAL_JOB_STATES:
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(self._failure_report(
                    f"job {job_id} still {state or 'unknown'} after {timeout:.0f} s: {info}"))
            time.sleep(0.2)

    def node_info(self, name: str) -> Dict[str, str]:
        r = self.run("scontrol", "-o", "show", "node", name)
        return parse_key_values(r.stdout.splitlines()[0])

    def sinfo_reasons(self) -> List[Dict[str, str]]:
        """One dict per node with a reason: node, state, user, timestamp, reason."""
        r = self.run("sinfo", "-R", "-N", "-h", "-o", "%N|%T|%u|%H|%E")
        rows = []
        for line in r.stdout.splitlines():
            if line.strip():
                node, state, user, ts, reason = line.split("|", 4)
                rows.append({"node": node.strip(), "state": state.strip(), "user": user.strip(),
                             "timestamp": ts.strip(), "reason": reason.strip()})
        return rows

    def wait_node_state(self, name: str, test: NodeStateTest, timeout: float = 30) -> Dict[str, str]:
        """Poll ``scontrol show node`` until ``test`` holds: a substring of State, or a predicate on the info dict."""
        deadline = time.monotonic() + timeout
        info: Dict[str, str] = {}
        while True:
            try:
                info = self.node_info(name)
            except TestbedError:
                info = {}
            ok = test(info) if callable(test) else (test in info.get("State", ""))
            if info and ok:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(self._failure_report(
                    f"node {name} not in the expected state after {timeout:.0f} s: State={info.get('State')} "
                    f"Reason={info.get('Reason')}"))
            time.sleep(0.2)

    def cancel_all(self, timeout: float = 30) -> None:
        """Cancel every job and wait until none is left running or pending."""
        ids = self._live_job_ids()
        if ids:
            self.run("scancel", *[str(i) for i in ids], check=False)
        deadline = time.monotonic() + timeout
        while self.run("squeue", "-h", "-t", "PD,R,CG,CF,S,RQ,RS,RH,SE,SO,ST", "-o", "%A").stdout.strip():
            if time.monotonic() > deadline:
                raise TimeoutError(self._failure_report("jobs did not end after scancel"))
            time.sleep(0.2)

    def resume_all(self, timeout: float = 30) -> None:
        """Undrain/resume every node (test isolation) and wait until each is back in service.

        RESUME leaves a node IDLE+NOT_RESPONDING until slurmctld's next contact with its slurmd
        (~1 s here), and such a node is neither scheduled nor resumable: wait for that too."""
        for node in self.nodes:
            state = self.node_info(node).get("State", "")
            if any(flag in state for flag in ("DRAIN", "DOWN", "FAIL")):
                self.run("scontrol", "update", f"NodeName={node}", "State=RESUME", check=False)
        for node in self.nodes:
            self.wait_node_state(node, _in_service, timeout=timeout)

    def reset(self) -> None:
        """Cancel all jobs and resume all nodes: a clean cluster for the next test."""
        self.cancel_all()
        self.resume_all()

    # ----------------------------------------------------------------- hooks of a shared cluster
    def use_hooks(self, *, prolog: Optional[str] = None, epilog: Optional[str] = None,
                  health_check_program: Optional[str] = None, epilog_slurmctld: Optional[str] = None,
                  slurm_gpu_config: Optional[str] = None) -> None:
        """Point the cluster's hooks at these scripts (None: a no-op) and write slurm-gpu.toml beside
        slurm.conf (None: no file), without a restart: slurm.conf names a link per hook
        (hooks/prolog, hooks/epilog, hooks/health_check_program, hooks/epilog_slurmctld), and slurmd and
        slurmctld exec the link's target afresh each time. A link, not a wrapper script: the hook
        gets exactly the environment slurmd gives it. Only with switchable_hooks=True; a hook the
        testbed was built with as a glob stays as it is."""
        if not self.switchable_hooks:
            raise TestbedError("use_hooks() needs a testbed started with switchable_hooks=True")
        given = {"prolog": prolog, "epilog": epilog, "health_check_program": health_check_program,
                 "epilog_slurmctld": epilog_slurmctld}
        for name, target in given.items():
            if name in self._hooks_fixed:
                if target is not None:
                    raise TestbedError(f"{name} is {self._hooks_fixed[name]} in this cluster's slurm.conf")
                continue
            if target is not None and not os.path.isabs(target):
                raise ValueError(f"hook path must be absolute (slurmd runs it without PATH): {target!r}")
            link = self.hooks_dir / name
            tmp = self.hooks_dir / f".{name}.{os.getpid()}.tmp"
            tmp.unlink(missing_ok=True)
            os.symlink(target or str(self.hooks_dir / NO_HOOK), tmp)
            os.replace(tmp, link)  # atomic: slurmd sees the old target or the new one
        for name, target in given.items():
            setattr(self, name, self._hooks_fixed.get(name, target))
        toml = self.conf_dir / "slurm-gpu.toml"
        if slurm_gpu_config is None:
            toml.unlink(missing_ok=True)
        else:
            tmp = self.conf_dir / f".slurm-gpu.toml.{os.getpid()}.tmp"
            self._write_file(tmp, slurm_gpu_config)
            os.replace(tmp, toml)
        self.slurm_gpu_config = slurm_gpu_config

    def hook_processes(self) -> List[int]:
        """Pids of hooks this cluster's daemons run now (prolog, epilog, health check, controller
        epilog): their descendants, not the daemons' own helpers (slurmstepd and the jobs below it,
        slurmscriptd itself)."""
        children: Dict[int, List[int]] = {}
        comm: Dict[int, str] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                raw = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            pid = int(entry)
            comm[pid] = raw[raw.index("(") + 1:raw.rindex(")")]
            fields = raw[raw.rindex(")") + 2:].split()
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(pid)
        found: List[int] = []
        todo = [d.pid for n, d in self._daemons.items() if n == "slurmctld" or n.startswith("slurmd-")]
        while todo:
            for child in children.get(todo.pop(), []):
                if comm.get(child) == "slurmstepd":
                    continue  # a job's step: cancel_all() ends it
                if comm.get(child) != "slurmscriptd":
                    found.append(child)
                todo.append(child)
        return found

    def wait_hooks_idle(self, timeout: float = 90) -> None:
        """Until no hook of this cluster runs: after use_hooks() a run that started before (a
        health check about to drain a node, an epilog writing a record) must not outlive its test."""
        deadline = time.monotonic() + timeout
        while True:
            pids = self.hook_processes()
            if not pids:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(self._failure_report(f"hooks still running after {timeout:.0f} s: pids {pids}"))
            time.sleep(0.1)


_USER_CLI_DIR: Optional[Path] = None


def user_cli(user: str, args: Sequence[str], env: Mapping[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    """`slurm-gpu ARGS` run as an unprivileged user, the way a user on a login node runs it.

    The user cannot read root's interpreter or checkout, so a world-readable copy of the
    package (and of click, its one import on this path) runs under the system python3."""
    global _USER_CLI_DIR
    import click

    import slurm_gpu
    if _USER_CLI_DIR is None or not _USER_CLI_DIR.exists():
        d = Path(tempfile.mkdtemp(prefix="slurm-gpu-usercli-", dir="/tmp"))
        for mod in (slurm_gpu, click):
            src = Path(mod.__file__).parent
            shutil.copytree(src, d / src.name, ignore=shutil.ignore_patterns("__pycache__"))
        for p in [d, *d.rglob("*")]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        _USER_CLI_DIR = d
    py = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    full = {k: v for k, v in env.items() if k in ("SLURM_CONF", "PATH", "LANG", "TZ", "TERM")}
    full.update(PYTHONPATH=str(_USER_CLI_DIR), HOME="/tmp")
    return subprocess.run(["runuser", "-u", user, "--", "env", *(f"{k}={v}" for k, v in full.items()),
                           py, "-m", "slurm_gpu.cli", *args], capture_output=True, text=True, timeout=timeout)
