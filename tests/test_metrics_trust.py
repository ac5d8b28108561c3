"""No user can freeze or forge the metrics (issue 23): the lock, the directories, the temp files.

The hooks run as root and write into directories that node_exporter and dcgm-exporter read.
An unprivileged user (the testbed's job user `sgtest`) must not be able to stop those writes
(by holding the lock) or to steer them (FIFOs and files planted at the temporary names).
"""
from __future__ import annotations

import fcntl
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from test_hooks import deps_for, job_env
from test_metrics import metrics_node
from slurm_gpu.hooks import flows as hooks
from slurm_gpu.metrics import textfile as T
from slurm_gpu.metrics.catalog import NODE_FILE
from slurm_gpu.slurm.jobenv import from_env

USER = "sgtest"  # the testbed's job user (tests/testbed.py JOB_USER)


def _user():
    try:
        return pwd.getpwnam(USER)
    except KeyError:
        from testbed import unavailable
        unavailable(f"user {USER} missing (.ci/install-deps.sh creates it)")
    if os.geteuid() != 0:
        from testbed import unavailable
        unavailable("needs root: the hooks' directories are root's")


@pytest.fixture
def shared_dir():
    """A root-owned 0755 directory that the unprivileged user can reach (pytest's tmp_path is
    under a 0700 directory)."""
    _user()
    d = Path(tempfile.mkdtemp(prefix="sg-metrics-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _as_user(code: str) -> subprocess.Popen:
    """python3 -c code as the unprivileged user; its stdout is a pipe."""
    return subprocess.Popen(["/usr/bin/python3", "-I", "-c", code], user=USER, group=USER, extra_groups=[],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _merge(directory: Path) -> None:
    T.merge(str(directory), NODE_FILE, lambda old: {"slurm_gpu_node_drained": {(("reason", ""),): 0.0}})


# ------------------------------------------------------------------ the lock


def test_user_cannot_open_the_lock_file_to_freeze_the_metrics(shared_dir):
    tf = shared_dir / "textfile"
    T.ensure_dir(str(tf))
    _merge(tf)
    lock = tf / T.DirLock.NAME
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600 and lock.stat().st_uid == 0
    p = _as_user(f"import os\ntry:\n    os.open({str(lock)!r}, os.O_RDONLY)\n    print('opened')\n"
                 "except PermissionError:\n    print('refused')\n")
    out, err = p.communicate(timeout=60)
    assert out.strip() == "refused", (out, err)


def test_user_holding_flock_on_an_old_0644_lock_file_does_not_stop_updates(shared_dir):
    # The lock file as earlier versions left it: root's, mode 0644, so any user could open it.
    tf = shared_dir / "textfile"
    T.ensure_dir(str(tf))
    lock = tf / T.DirLock.NAME
    lock.touch()
    lock.chmod(0o644)
    p = _as_user(f"import fcntl, os, time\nfd = os.open({str(lock)!r}, os.O_RDONLY)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
                 "print('locked', flush=True)\ntime.sleep(120)\n")
    try:
        assert p.stdout.readline().strip() == "locked"
        _merge(tf)  # the old code: LockTimeout, "locked by another writer for over 0.1 s"
        assert T.parse((tf / NODE_FILE).read_text()) == {"slurm_gpu_node_drained": {(("reason", ""),): 0.0}}
        assert stat.S_IMODE(lock.stat().st_mode) == 0o600
    finally:
        p.kill()
        p.communicate(timeout=60)


# ------------------------------------------------------------------ the directories


def test_world_writable_textfile_directory_is_refused_with_one_line(sim_node):
    node, tf, mp = metrics_node(sim_node)
    for d in (tf, mp):
        d.mkdir()
        d.chmod(0o777)
    assert hooks.prolog(from_env(job_env(gpus="0")), deps_for(node)) == 0
    lines = [line for line in node.log_text().splitlines() if "metrics" in line]
    assert len(lines) == 2, lines  # one per directory
    for d, line in zip((tf, mp), sorted(lines, key=lambda x: str(mp) in x)):
        assert "metrics-write-failed" in line and str(d) in line and "writable by group or others" in line, line
        assert "chmod 755" in line, line
    assert not (tf / NODE_FILE).exists() and os.listdir(mp) == []


def test_textfile_directory_owned_by_a_user_is_refused(shared_dir):
    tf = shared_dir / "textfile"
    tf.mkdir()
    os.chown(tf, _user().pw_uid, -1)
    with pytest.raises(T.UnsafeDirectory, match=r"owned by uid \d+, not root"):
        T.ensure_dir(str(tf))


def test_fifo_planted_at_the_temp_name_cannot_block_a_hook(shared_dir):
    # Planted while the directory was still writable by others, then the directory was fixed.
    tf = shared_dir / "textfile"
    T.ensure_dir(str(tf))
    os.mkfifo(tf / f".{NODE_FILE}.{os.getpid()}.tmp")

    def hang(signum, frame):
        raise TimeoutError("the write blocked on the FIFO")
    old = signal.signal(signal.SIGALRM, hang)
    signal.setitimer(signal.ITIMER_REAL, 10.0)  # a guard against hanging the suite, not a timing
    try:
        _merge(tf)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert stat.S_ISREG((tf / NODE_FILE).lstat().st_mode)
    assert not any(n.endswith(".tmp") for n in os.listdir(tf))


def test_planted_plain_file_cannot_make_the_node_file_someone_elses(shared_dir):
    tf = shared_dir / "textfile"
    T.ensure_dir(str(tf))
    uid = _user().pw_uid
    for name in (f".{NODE_FILE}.{os.getpid()}.tmp", f".{NODE_FILE}.state.{os.getpid()}.tmp"):
        (tf / name).write_text("slurm_gpu_node_drained{reason=\"forged\"} 1\n")
        os.chown(tf / name, uid, -1)
        (tf / name).chmod(0o666)
    _merge(tf)
    st = (tf / NODE_FILE).stat()
    assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o644
    assert "forged" not in (tf / NODE_FILE).read_text()
    assert (tf / f".{NODE_FILE}.state").stat().st_uid == 0
