"""Structured decision log for hooks: one line per decision, to syslog and/or a file.

Line format: ``<event> key=value ...`` (values with spaces quoted), e.g.
``drain job=4711 node=gpu01 gpu=GPU-8f2c... reason="slurm-gpu: ..."``.
Uses the C `syslog` module, not `logging`, to keep hook start-up cheap.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any

_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}


def _quote(v: Any) -> str:
    s = str(v)
    if s == "" or any(c in s for c in ' "=\n\t'):
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return s


class HookLog:
    def __init__(self, hook: str, syslog_on: bool = True, path: str = "", level: str = "info", stderr: bool = False):
        self.hook = hook
        self.level = _LEVELS.get(level, 20)
        self.path = path
        self.stderr = stderr
        self._syslog = None
        self.problems: list = []
        if syslog_on:
            try:
                import syslog
                syslog.openlog("slurm-gpu", syslog.LOG_PID, syslog.LOG_DAEMON)
                self._syslog = syslog
            except Exception as e:  # no syslog on this platform: the file still works
                self.problems.append(f"syslog unavailable: {e}")

    @classmethod
    def from_config(cls, hook: str, cfg: Any, stderr: bool = False) -> "HookLog":
        return cls(hook, cfg.get("log", "syslog"), cfg.path_value("log", "file") if cfg.get("log", "file") else "",
                   cfg.get("log", "level"), stderr)

    def event(self, event: str, level: str = "info", **fields: Any) -> str:
        parts = [f"{self.hook}", event] + [f"{k}={_quote(v)}" for k, v in fields.items() if v is not None]
        line = " ".join(parts)
        lv = _LEVELS.get(level, 20)
        if lv < self.level:
            return line
        if self._syslog is not None:
            prio = {10: self._syslog.LOG_DEBUG, 20: self._syslog.LOG_INFO, 30: self._syslog.LOG_WARNING,
                    40: self._syslog.LOG_ERR}[lv]
            self._syslog.syslog(prio, line)
        file_failed = False
        if self.path:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime())
            data = f"{stamp} pid={os.getpid()} {level.upper()} {line}\n".encode("utf-8", "replace")
            try:
                self._append(data)
            except OSError as e:
                file_failed = True
                if not self.problems:
                    self.problems.append(f"cannot write log file {self.path}: {e.strerror}")
                    print(f"slurm-gpu {self.hook} log-file-error path={self.path} error={_quote(e.strerror)}",
                          file=sys.stderr)
        if self.stderr or lv >= 40 or (file_failed and self._syslog is None):
            print(f"slurm-gpu {line}", file=sys.stderr)
        return line

    def _append(self, data: bytes) -> None:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(self.path) or ".", mode=0o755, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        try:
            os.write(fd, data)  # one write per line: concurrent hooks never interleave a line
        finally:
            os.close(fd)

    def info(self, event: str, **f: Any) -> str:
        return self.event(event, "info", **f)

    def warning(self, event: str, **f: Any) -> str:
        return self.event(event, "warning", **f)

    def error(self, event: str, **f: Any) -> str:
        return self.event(event, "error", **f)


def null_log(hook: str = "test") -> HookLog:
    return HookLog(hook, syslog_on=False)


