"""The one deadline runner for calls that may hang (a wedged driver, an unanswering slurmctld).

A call runs in a daemon thread; the caller waits at most ``timeout_s``.  A call that overruns is
abandoned (Python cannot kill a thread stuck in C); it dies with the process.  Used by
``gpu/nvml.py`` (NVML calls), ``slurm/pyslurm_backend.py`` (pyslurm RPCs) and
``hooks/healthcheck.py`` (the whole GPU check).  Standard library only.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Optional, Tuple


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
