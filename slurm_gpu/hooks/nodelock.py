"""A per-node lock for the flows that act on a node's Slurm state (healthcheck, remediate): a flock
on a file, released when the process ends however it ends, so a killed run never leaves it held."""
from __future__ import annotations

import fcntl
import os
import time
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def node_lock(path: str, wait_s: float = 0.0) -> Iterator[bool]:
    """Hold the lock at `path` (created 0600, never through a symlink); yields False when another
    process still holds it after `wait_s` seconds."""
    os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.05)
        yield True
    finally:
        os.close(fd)
