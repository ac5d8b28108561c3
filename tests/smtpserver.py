"""A real SMTP server on 127.0.0.1 for the tests: aiosmtpd's own server process (`python -m aiosmtpd`,
the test extra) delivering into a Maildir the test reads.  Started on a free port of its own, stopped by
pid; stop() and start() again on the same port is a mail server that was down and came back."""
from __future__ import annotations

import mailbox
import os
import signal
import socket
import subprocess
import sys
import time
from email.message import Message
from pathlib import Path
from typing import List, Optional


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SmtpServer:
    def __init__(self, workdir: Path, port: Optional[int] = None):
        self.workdir = Path(workdir)
        self.maildir = self.workdir / "maildir"
        self.port = port or free_port()
        self.proc: Optional[subprocess.Popen] = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> "SmtpServer":
        try:
            import aiosmtpd  # noqa: F401
        except ImportError:
            from testbed import unavailable
            unavailable("aiosmtpd is not installed (pip install -e '.[test]')")
        self.workdir.mkdir(parents=True, exist_ok=True)
        mailbox.Maildir(str(self.maildir), create=True)
        log = open(self.workdir / "smtpd.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "aiosmtpd", "-n", "-l", self.address,
                                      "-c", "aiosmtpd.handlers.Mailbox", str(self.maildir)],
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"aiosmtpd exited {self.proc.returncode}: "
                                   + (self.workdir / "smtpd.log").read_text()[-2000:])
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    if s.recv(100).startswith(b"220"):
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"aiosmtpd did not answer on {self.address} within {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.proc = None

    def messages(self) -> List[Message]:
        return [m for _, m in sorted(mailbox.Maildir(str(self.maildir), create=True).items(),
                                     key=lambda kv: kv[1].get("Date", ""))]

    def wait_for(self, count: int, timeout: float = 10.0) -> List[Message]:
        end = time.monotonic() + timeout
        while True:
            got = self.messages()
            if len(got) >= count or time.monotonic() > end:
                return got
            time.sleep(0.05)
