"""The spool directory as root may trust it: safe directory and file operations.

An unprivileged user must not be able to make root write through a symlink or ingest a record
they wrote.  So a directory is opened with O_DIRECTORY|O_NOFOLLOW and refused when someone other
than root owns it or may write to it; everything in it is then created, read, claimed and moved
relative to that descriptor, never through a path that could be swapped; a file is read only if
root owns it and nobody else may write it.

File names: ``<ns>-<pid>-[j<job id>-]<kind>.json`` (the job id lets the epilog find a job's
records without opening every file); ``.<name>.<pid>.claim`` while an ingest holds it;
``.<name>.tmp`` while it is being written.  Standard library only: the hooks import it.
"""
from __future__ import annotations

import errno
import os
import re
import stat
import time
from typing import Any, FrozenSet, List, Optional

from slurm_gpu.errors import StoreError

QUARANTINE = "quarantine"
MAX_FILE_BYTES = 4 << 20  # a record is a few KiB; anything this big was not written by us
STALE_CLAIM_S = 3600.0  # a claim this old is stale even if a process with its pid exists (pid reuse)


def trusted_uids() -> FrozenSet[int]:
    """Who may own what root reads and writes here: root (and the user running an admin command)."""
    return frozenset((0, os.geteuid()))


def refuse_unsafe(st: os.stat_result, path: str, what: str, fix: str) -> None:
    """Refuse what an unprivileged user owns or may write: they could forge records with it."""
    if st.st_uid not in trusted_uids():
        raise StoreError(f"refusing {what} {path}: owned by uid {st.st_uid}, not root (an unprivileged user could "
                         f"have written it)", f"check what is in it, then {fix}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise StoreError(f"refusing {what} {path}: writable by group or others (mode {stat.S_IMODE(st.st_mode):o}; "
                         f"an unprivileged user could have written it)", f"check what is in it, then {fix}")


def open_dir(path: str, mode: int = 0o700, create: bool = True, dir_fd: Optional[int] = None) -> int:
    """A descriptor of a directory we may trust: created with `mode` when missing, never
    reached through a symlink at its last component, owned by root and writable by nobody else."""
    if create:
        if dir_fd is None:
            parent = os.path.dirname(os.path.abspath(path))
            os.makedirs(parent, mode=0o755, exist_ok=True)
        try:
            os.mkdir(path, mode, dir_fd=dir_fd)
        except FileExistsError:
            pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and _is_symlink(path, dir_fd):
            raise StoreError(f"refusing directory {path}: it is a symbolic link (root never follows one here)",
                             f"replace it with a real directory: rm {path}; mkdir -m {mode:o} {path}") from None
        raise
    try:
        refuse_unsafe(os.fstat(fd), path, "directory", f"chown root:root {path}; chmod {mode:o} {path}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _is_symlink(name: str, dir_fd: Optional[int]) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


class Untrusted(Exception):
    """A spool file we must not ingest (not ours, or not a plain file)."""


def read_json(dfd: int, name: str) -> Any:
    """A spool file's JSON, if root wrote it: never through a symlink, never another uid's or a
    group/world-writable file, never a FIFO or device, never more than MAX_FILE_BYTES."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Untrusted("a symbolic link: not followed") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Untrusted("not a regular file")
        if st.st_uid not in trusted_uids():
            raise Untrusted(f"owned by uid {st.st_uid}, not root: not ingested (an unprivileged user could have forged it)")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise Untrusted(f"writable by group or others (mode {stat.S_IMODE(st.st_mode):o}): not ingested")
        if st.st_size > MAX_FILE_BYTES:
            raise Untrusted(f"{st.st_size} bytes, larger than any record we write")
        chunks = []
        while True:
            b = os.read(fd, 1 << 16)
            if not b:
                break
            chunks.append(b)
    finally:
        os.close(fd)
    import json  # here: a hook whose spool is empty never needs it
    return json.loads(b"".join(chunks).decode("utf-8"))


# The file names of the module docstring, as patterns for re.match: compiled (and cached by re)
# on first use, so a hook that finds the spool empty never compiles them.
NAME = r"^(\d+)-(\d+)-(?:j(\d+)-)?([a-z_]+)\.json$"
CLAIM = r"^\.(.+\.json)\.(\d+)\.claim$"
TMP = r"^\.((\d+)-(\d+)-.+\.json)\.tmp$"


def pid_gone(pid: int) -> bool:
    """The process that claimed or is writing a file is gone (a pid of this machine)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: it exists
        return False
    return False


def age_s(dfd: int, name: str) -> float:
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return 0.0
    return time.time() - max(st.st_mtime, st.st_ctime)  # rename (a claim) sets ctime


def quarantine_reason(qfd: int, name: str) -> str:
    """Why a quarantined file is there, as far as the file itself shows it."""
    try:
        st = os.stat(name, dir_fd=qfd, follow_symlinks=False)
    except OSError as e:
        return e.strerror or str(e)
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid not in trusted_uids():
        return f"owned by uid {st.st_uid}, not root"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return "refused by the database (the hook log's spool-quarantined line says why)"


def exists(dfd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dfd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def write_file(dfd: int, name: str, data: bytes) -> None:
    """Create `name` (mode 600) in the directory, atomically: written, synced, then renamed."""
    tmp = "." + name + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    os.fsync(dfd)  # the rename itself survives a crash


def waiting(dfd: int) -> List[str]:
    """Spool files waiting for ingest, oldest first (names start with the time in ns)."""
    names = [n for n in os.listdir(dfd) if n.endswith(".json") and not n.startswith(".")]
    return sorted(names, key=lambda n: (len(n.split("-", 1)[0]), n))


def reclaim(dfd: int) -> int:
    """Put back claims whose process is gone and temp files whose writer died."""
    n = 0
    for name in os.listdir(dfd):
        m = re.match(CLAIM, name)
        if m is not None:
            if not (pid_gone(int(m.group(2))) or age_s(dfd, name) > STALE_CLAIM_S):
                continue
            target = m.group(1)
        else:
            t = re.match(TMP, name)
            if t is None or not pid_gone(int(t.group(3))):
                continue
            target = t.group(1)  # ingest checks it: a torn write ends as .bad, never lost silently
        if exists(dfd, target):
            target = f"{time.time_ns()}-reclaimed-{target}"
        try:
            os.rename(name, target, src_dir_fd=dfd, dst_dir_fd=dfd)
            n += 1
        except FileNotFoundError:
            continue
    return n
