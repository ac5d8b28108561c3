"""No user can freeze or forge the metrics (issue 23): the lock, the directories, the temp files.

The hooks run as root and write into directories that node_exporter and dcgm-exporter read.
An unprivileged user (the testbed's job user `sgtest`) must not be able to stop those writes
(by holding the lock) or to steer them (FIFOs and files planted at the temporary names).
"""
from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from test_hooks import deps_for, job_env
from test_metrics import metrics_node

from slurm_gpu.hooks import flows as hooks
from slurm_gpu.metrics import textfile as T
from slurm_gpu.metrics.catalog import NODE_FILE
from slurm_gpu.metrics.serve import collect, scrapes
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


# ------------------------------------------------------------------ the exporter


class _Serving:
    """make_server(...) serving in a thread, stopped on exit."""

    def __init__(self, body, **kw):
        from slurm_gpu.metrics.serve import make_server
        self.server = make_server("127.0.0.1", 0, body, **kw)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self.server.server_address[1]

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def _slow_client(port: int, every_s: float, lines: int, closed: list) -> None:
    """A client that sends its request one header line every `every_s` seconds; `closed` gets
    the number of lines sent when the server hung up (nothing if it never did)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        for i in range(lines):
            time.sleep(every_s)
            try:
                s.sendall(f"X-Slow-{i}: 1\r\n".encode())
                s.settimeout(0.01)
                if s.recv(1) == b"":
                    closed.append(i)
                    return
            except socket.timeout:
                pass
            except OSError:
                closed.append(i)
                return
            finally:
                s.settimeout(60)


def test_slow_client_sending_a_header_line_every_5s_does_not_fail_other_scrapes(tmp_path):
    tf = tmp_path / "textfile"
    T.ensure_dir(str(tf))
    _merge(tf)
    with _Serving(lambda: collect(str(tf), dict)) as port:
        slow = threading.Thread(target=_slow_client, args=(port, 5.0, 2, []), daemon=True)
        slow.start()
        time.sleep(0.5)  # the slow client is connected and holds its request open
        for _ in range(3):  # the old single-threaded server: each of these timed out
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=4) as r:
                assert "slurm_gpu_node_drained" in r.read().decode()
        assert slow.is_alive()  # all three while the slow client was still sending
        slow.join(60)


def test_slow_client_is_cut_off_at_the_request_deadline(tmp_path):
    tf = tmp_path / "textfile"
    T.ensure_dir(str(tf))
    closed: list = []
    with _Serving(lambda: collect(str(tf), dict), deadline_s=1.0) as port:
        # Each line comes well within the per-read timeout, so only a total deadline ends it.
        _slow_client(port, 0.2, 100, closed)
    assert closed and closed[0] < 50, closed  # hung up after about 5 lines, not after all 100


def test_symlink_to_an_unreadable_file_is_skipped_counted_and_the_rest_served(tmp_path):
    tf = tmp_path / "textfile"
    T.ensure_dir(str(tf))
    _merge(tf)
    os.symlink("/etc/shadow", tf / "slurm_gpu_evil.prom")
    (tf / "slurm_gpu_dir.prom").mkdir()  # a file the exporter cannot read, even as root
    skipped: dict = {}
    text = collect(str(tf), dict, skipped)
    assert sorted(skipped) == ["slurm_gpu_dir.prom", "slurm_gpu_evil.prom"], skipped
    assert "root:" not in text
    assert T.parse(text)["slurm_gpu_node_drained"] == {(("reason", ""),): 0.0}
    assert T.parse(text)["slurm_gpu_exporter_unreadable_files"] == {(): 2.0}
    warned: list = []
    with _Serving(scrapes(str(tf), dict, warned.append)) as port:
        for _ in range(2):  # the old exporter: HTTP 500 at every scrape
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                assert r.status == 200 and "slurm_gpu_node_drained" in r.read().decode()
    assert len(warned) == 2 and "slurm_gpu_evil.prom skipped: a symbolic link" in warned[1], warned  # once per file
