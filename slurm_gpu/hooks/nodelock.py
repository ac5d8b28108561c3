"""A per-node lock for the flows that act on a node's Slurm state (healthcheck, remediate): a flock
on a file, released when the last process holding it ends however it ends, so a killed run never
leaves it held.  A child given the lock's descriptor (Held.fd, subprocess pass_fds) holds it too:
remediate's reset command keeps the node's lock for its whole life, even past a killed parent."""
from __future__ import annotations

import fcntl
import os
import time
from contextlib import contextmanager
from typing import Iterator, Union


class Held:
    """The lock, held: true, with the descriptor a child may inherit to hold it as well."""

    def __init__(self, fd: int):
        self.fd = fd

    def __bool__(self) -> bool:
        return True


@contextmanager
def node_lock(path: str, wait_s: float = 0.0) -> Iterator[Union[Held, bool]]:
    """Hold the lock at `path` (created 0600, never through a symlink); yields a Held, or False when
    another process still holds it after `wait_s` seconds."""
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
        yield Held(fd)
    finally:
        os.close(fd)
