"""The one deadline runner for calls that may hang (a wedged driver, an unanswering slurmctld).

A call runs in a daemon thread; the caller waits at most ``timeout_s``.  A call that overruns is
abandoned (Python cannot kill a thread stuck in C); it dies with the process.  Used by
``gpu/nvml.py`` (NVML calls), ``slurm/pyslurm_backend.py`` (pyslurm RPCs) and
``hooks/healthcheck.py`` (the whole GPU check).  Standard library only.

A C call that keeps the interpreter lock while it waits cannot be outwaited by a thread: the
waiting thread needs the lock to notice its deadline.  pyslurm's RPCs are such calls (observed
with pyslurm 25.11.2: slurmctld stopped, a 2 s deadline ended after Slurm's MessageTimeout, 5 s).
``call_in_child`` runs those in a forked child process that is killed at the deadline.
"""
from __future__ import annotations

import os
import select
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple


class DeadlineExceeded(TimeoutError):
    """The call did not return in time (it may still be running in its abandoned thread)."""


def call_with_deadline(fn: Callable[[], Any], timeout_s: float, name: str
                       ) -> Tuple[bool, Any, Optional[BaseException]]:
    """Run fn in a daemon thread named ``name``: (finished, value, exception raised by fn).

    Whatever fn raises — BaseException included — is handed back, not raised, so the caller
    decides; ``finished`` is False when fn is still running after ``timeout_s``."""
    box: Dict[str, Any] = {}

    def target() -> None:
        try:
            box["v"] = fn()
        except BaseException as e:  # handed to the caller
            box["e"] = e

    t = threading.Thread(target=target, name=name, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        return False, None, None
    return True, box.get("v"), box.get("e")


def run_with_deadline(fn: Callable[[], Any], timeout_s: float, name: str, message: str = "") -> Any:
    """fn()'s value; re-raises what fn raised; DeadlineExceeded(message) when it overruns."""
    finished, value, error = call_with_deadline(fn, timeout_s, name)
    if not finished:
        raise DeadlineExceeded(message or f"{name} timed out after {timeout_s:g}s")
    if error is not None:
        raise error
    return value


class ChildCallError(RuntimeError):
    """A call run in a child process died, or raised something that cannot cross the pipe."""


def _send_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _child(fn: Callable[[], Any], fd: int) -> None:
    """In the forked child: fn()'s value or exception, pickled, down the pipe; never returns."""
    import pickle  # here and in call_in_child: only pyslurm's calls come this way, never the hooks' NVML reads
    try:
        try:
            payload = pickle.dumps((True, fn()))
        except BaseException as e:  # handed to the parent
            try:
                payload = pickle.dumps((False, e))
            except Exception:
                payload = pickle.dumps((False, ChildCallError(f"{type(e).__name__}: {e}")))
        _send_all(fd, payload)
    finally:
        os._exit(0)  # no atexit handlers, no flushing of the parent's buffers


def _read_until(fd: int, deadline: float) -> Optional[bytes]:
    """Everything the child writes up to its end of the pipe; None when the deadline passes first."""
    chunks: List[bytes] = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def call_in_child(fn: Callable[[], Any], timeout_s: float, name: str
                  ) -> Tuple[bool, Any, Optional[BaseException]]:
    """Like call_with_deadline, but fn runs in a forked child process: for a C call that holds
    the interpreter lock while it waits (pyslurm's RPCs), which no thread of ours could outwait.
    fn's value (or exception) must pickle.  A child still running after ``timeout_s`` is
    killed (SIGKILL) and reaped: nothing is left behind.  ``name`` goes into error texts."""
    import pickle
    import signal  # both here: the hooks never fork (pyslurm's calls do), and signal's IntEnum costs 1.7 ms
    deadline = time.monotonic() + timeout_s
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        _child(fn, wfd)
    os.close(wfd)
    try:
        data = _read_until(rfd, deadline)
    finally:
        os.close(rfd)
        if data is None:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    if data is None:
        return False, None, None
    if not data:
        return True, None, ChildCallError(f"{name}: the child process died ({_status_text(status)})")
    ok, value = pickle.loads(data)
    return (True, value, None) if ok else (True, None, value)


def _status_text(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"exit status {os.WEXITSTATUS(status)}"
