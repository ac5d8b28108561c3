"""Issue 39, item 2, end to end: a line an unprivileged user logs with `logger` is written by a real
syslog daemon (Debian's rsyslog, its two file formats) and is never an XID event.  rsyslogd runs in
the foreground on a socket and files of its own, started and stopped by pid; the user is the
testbed's job user, sgtest."""
from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest
from testbed import JOB_USER, unavailable

from slurm_gpu.gpu import xid

pytestmark = pytest.mark.host_only

FORGED = "NVRM: Xid (PCI:0000:3a:00): 79, GPU has fallen off the bus."
FORMATS = {"syslog": "RSYSLOG_TraditionalFileFormat", "syslog.iso": "RSYSLOG_FileFormat"}  # Debian 12's default: the ISO one


@pytest.fixture
def rsyslog() -> Iterator[Path]:
    if os.geteuid() != 0 or shutil.which("rsyslogd") is None or shutil.which("logger") is None:
        unavailable("needs root, rsyslogd (Debian package rsyslog) and logger")
    try:
        pwd.getpwnam(JOB_USER)
    except KeyError:
        unavailable(f"needs the user {JOB_USER} (.ci/install-deps.sh creates it)")
    d = Path(tempfile.mkdtemp(prefix="slurm-gpu-rsyslog-"))
    d.chmod(0o755)  # the user reaches the socket
    conf = d / "rsyslog.conf"
    conf.write_text(f'global(workDirectory="{d}")\nmodule(load="imuxsock" SysSock.Use="off")\n'
                    f'input(type="imuxsock" Socket="{d}/log.sock" CreatePath="on")\n'
                    + "".join(f'*.* action(type="omfile" file="{d}/{name}" template="{t}")\n' for name, t in FORMATS.items()))
    proc = subprocess.Popen(["rsyslogd", "-n", "-f", str(conf), "-i", str(d / "rsyslogd.pid")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        end = time.monotonic() + 10
        while not (d / "log.sock").exists():
            assert proc.poll() is None and time.monotonic() < end, "rsyslogd did not create its socket"
            time.sleep(0.05)
        yield d
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
        shutil.rmtree(d, ignore_errors=True)


def test_an_xid_line_a_user_logs_through_rsyslog_is_never_an_event(rsyslog):
    r = subprocess.run(["runuser", "-u", JOB_USER, "--", "logger", "-u", str(rsyslog / "log.sock"), FORGED],
                       capture_output=True, text=True, timeout=10)
    assert r.returncode == 0, r.stderr
    for name in FORMATS:
        log = rsyslog / name
        end = time.monotonic() + 10
        while FORGED not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < end, f"rsyslogd wrote no line to {log}"
            time.sleep(0.05)
        assert f" {JOB_USER}: {FORGED}" in log.read_text() or f" {JOB_USER}[" in log.read_text(), log.read_text()
        reading = xid.read(f"file:{log}", 3600)
        assert reading.events == [] and reading.undated == 0 and reading.problem == "", (name, reading, log.read_text())
