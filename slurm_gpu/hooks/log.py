"""Structured decision log for hooks: one line per decision, to syslog and/or a file.

Line format: ``<event> key=value ...`` (values with spaces quoted), e.g.
``drain job=4711 node=gpu01 gpu=GPU-8f2c... reason="slurm-gpu: ..."``.
Uses the C `syslog` module, not `logging`, to keep hook start-up cheap.

Values come from Slurm's environment and may hold anything, including bytes that are not
UTF-8 (surrogates in os.environ): every line is escaped to printable text before it goes to
syslog, stderr or a file, because a log line must never be the thing that crashes a hook.

``write_fallback`` appends fail-open events to a fixed, config-independent file
(FALLBACK_LOG): when the config itself is broken, it is the one place an admin can look.
"""
from __future__ import annotations

import abc
import errno
import os
import stat
import sys
import time
from typing import TYPE_CHECKING, Any, List, Mapping, Optional

from slurm_gpu.config import Config

if TYPE_CHECKING:  # types only: deps.py imports this module
    from slurm_gpu.hooks.deps import EventLog

# Fixed on purpose: it must not depend on the config it reports. slurmd passes hooks none of
# our environment, so in production only the constant is used; the variable is for tests.
FALLBACK_LOG = "/var/log/slurm-gpu/hooks-error.log"
FALLBACK_ENV = "SLURM_GPU_FALLBACK_LOG"

_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}


def _quote(v: Any) -> str:
    s = str(v)
    if s and s.isprintable() and not any(c in s for c in ' "='):
        return s
    s = s.replace("\\", "\\\\").replace('"', '\\"')
    # Control characters, line separators and lone surrogates become escapes: one event, one line.
    return '"' + "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in s) + '"'


def _printable(line: str) -> str:
    """Belt and braces: whatever is left that UTF-8 cannot encode becomes a backslash escape."""
    return line.encode("utf-8", "backslashreplace").decode("utf-8")


def _why(e: OSError) -> str:
    if e.errno == errno.ELOOP:
        return "it is a symbolic link (refused: root never writes through one)"
    return e.strerror or str(e)


def _to_stderr(text: str) -> None:
    try:
        print(text, file=sys.stderr)
    except Exception:  # closed or strict stderr: the log line is not worth a crash
        pass


class _Levels(abc.ABC):
    """info / warning / error: event() at that level."""

    @abc.abstractmethod
    def event(self, event: str, level: str = "info", **fields: Any) -> str:
        """Write one decision line at level; returns the line."""

    def info(self, event: str, **f: Any) -> str:
        return self.event(event, "info", **f)

    def warning(self, event: str, **f: Any) -> str:
        return self.event(event, "warning", **f)

    def error(self, event: str, **f: Any) -> str:
        return self.event(event, "error", **f)


class BoundLog(_Levels):
    """A log whose every line starts with fields bound once: a hook run's job and node."""

    def __init__(self, log: EventLog, **bound: Any):
        self.log, self.bound = log, bound
        self.hook = getattr(log, "hook", "hook")

    def event(self, event: str, level: str = "info", **fields: Any) -> str:
        return self.log.event(event, level, **{**self.bound, **fields})


class HookLog(_Levels):
    def __init__(self, hook: str, syslog_on: bool = True, path: str = "", level: str = "info", stderr: bool = False):
        self.hook = hook
        self.level = _LEVELS.get(level, 20)
        self.path = path
        self.stderr = stderr
        self._syslog = None
        self.problems: List[str] = []
        if syslog_on:
            try:
                import syslog
                syslog.openlog("slurm-gpu", syslog.LOG_PID, syslog.LOG_DAEMON)
                self._syslog = syslog
            except Exception as e:  # no syslog on this platform: the file still works
                self.problems.append(f"syslog unavailable: {e}")

    @classmethod
    def from_config(cls, hook: str, cfg: Config, stderr: bool = False) -> "HookLog":
        return cls(hook, cfg.log.syslog, cfg.path_value("log", "file") if cfg.log.file else "",
                   cfg.log.level, stderr)

    def event(self, event: str, level: str = "info", **fields: Any) -> str:
        parts = [f"{self.hook}", event] + [f"{k}={_quote(v)}" for k, v in fields.items() if v is not None]
        line = _printable(" ".join(parts))
        lv = _LEVELS.get(level, 20)
        if lv < self.level:
            return line
        if self._syslog is not None:
            prio = {10: self._syslog.LOG_DEBUG, 20: self._syslog.LOG_INFO, 30: self._syslog.LOG_WARNING,
                    40: self._syslog.LOG_ERR}[lv]
            try:
                self._syslog.syslog(prio, line)
            except Exception as e:  # syslog trouble must not stop the hook; the file/stderr still get it
                self.problems.append(f"syslog failed: {e}")
        file_failed = False
        if self.path:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime())
            data = f"{stamp} pid={os.getpid()} {level.upper()} {line}\n".encode("utf-8", "backslashreplace")
            try:
                self._append(data)
            except OSError as e:
                file_failed = True
                if not self.problems:
                    why = _why(e)
                    self.problems.append(f"cannot write log file {self.path}: {why}")
                    _to_stderr(f"slurm-gpu {self.hook} log-file-error path={_quote(self.path)} error={_quote(why)}")
        if self.stderr or lv >= 40 or (file_failed and self._syslog is None):
            _to_stderr(f"slurm-gpu {line}")
        return line

    def _append(self, data: bytes) -> None:
        # Never through a symlink (root would append to whatever it points at), and a FIFO
        # without reader must not hang us.
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o640)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(self.path) or ".", mode=0o755, exist_ok=True)
            fd = os.open(self.path, flags, 0o640)
        try:
            st = os.fstat(fd)
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
                raise OSError(0, "not a regular file")
            if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                raise OSError(0, "a hard link to another file: refused")
            os.write(fd, data)  # one write per line: concurrent hooks never interleave a line
        finally:
            os.close(fd)



def fallback_path(env: Optional[Mapping[str, str]] = None) -> str:
    env = os.environ if env is None else env
    return env.get(FALLBACK_ENV) or FALLBACK_LOG


def write_fallback(path: str, hook: str, event: str, **fields: Any) -> str:
    """Append one line ``<time> <hook> <event> key=value ...`` to the fallback log.

    Returns "" or what went wrong; never raises (it runs inside the last-resort handlers).
    """
    try:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime())
        parts = [stamp, hook, event] + [f"{k}={_quote(v)}" for k, v in fields.items() if v is not None]
        _append_private(path, (_printable(" ".join(parts)) + "\n").encode("utf-8", "backslashreplace"))
        return ""
    except OSError as e:
        return f"cannot write the fallback log {path}: {e.strerror or e}"
    except Exception as e:  # a bug here must not hide the original problem
        return f"cannot write the fallback log {path}: {type(e).__name__}: {e}"


def _append_private(path: str, data: bytes) -> None:
    """Root-only (0600 file, 0700 new directory); never through a symlink, never into a FIFO."""
    parent = os.path.dirname(path)
    if parent and not os.path.isdir(parent):
        os.makedirs(parent, mode=0o700, exist_ok=True)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
    fd = os.open(path, flags, 0o600)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(0, "not a regular file")
        os.write(fd, data)  # one write per line: concurrent hooks never interleave a line
    finally:
        os.close(fd)
