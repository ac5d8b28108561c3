"""The Prometheus text exposition format (0.0.4) as node_exporter's textfile collector reads it.

A small writer of our own rather than prometheus_client: its import costs 50-90 ms on the
hook path (docs/prometheus.md, "Why not prometheus_client"), ours about 1 ms.  The tests
check every file we write with prometheus_client's parser and `promtool check metrics`.

Samples are held as {family name: {labels: value}}, labels a tuple of (name, value) pairs in
the catalog's order.  Files are written atomically (a temporary file in the same directory,
rename; mode 0644) with # HELP and # TYPE once per family and no timestamps.  The hooks' files
are not fsync'd: on a node whose jobs write heavily an fsync can wait for seconds, and a file
lost in a crash only resets counters (Prometheus' rate() takes resets) or shows a state
that the next hook run corrects.  Only our
own files are read back (to merge what an earlier writer wrote): parse() reads the format
render() writes.  Standard library only.

A file that writers merge into (merge()) has a sidecar, `.<name>.state`: its samples and label
texts in marshal's format, written after the file and trusted only while the file is exactly the
one it was written with (inode, size, modification time) and it belongs to us (owner, not
writable by others).  Reading it is about 20 times faster than parsing the text, which was most
of a prolog's metrics cost; whenever the sidecar does not match, the text is parsed instead.
"""
from __future__ import annotations

import errno
import fcntl
import marshal
import os
import re
import stat
import time
from typing import Callable, Dict, Iterator, Mapping, Optional, Tuple, Union

from slurm_gpu.metrics.catalog import BY_NAME, FAMILIES

Labels = Tuple[Tuple[str, str], ...]
Samples = Dict[str, Dict[Labels, float]]

_ORDER = {f.name: i for i, f in enumerate(FAMILIES)}
_LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = re.compile(r"\\(.)")


def escape_label(value: str) -> str:
    """A label value as the format wants it: backslash, double quote and newline escaped."""
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return value


def escape_help(text: str) -> str:
    """HELP text: backslash and newline escaped (a double quote stays as it is)."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(v: float) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) < 1e15):
        return str(int(v))
    return repr(float(v))


def sample_line(name: str, labels: Labels, value: float, inner: Optional[str] = None) -> str:
    if not labels:
        return f"{name} {format_value(value)}"
    if inner is None:
        inner = ",".join([f'{k}="{escape_label(v)}"' for k, v in labels])
    return f"{name}{{{inner}}} {format_value(value)}"


def render(samples: Mapping[str, Mapping[Labels, float]], meta: Optional[Mapping[str, Tuple[str, str]]] = None,
           raw: Optional[Dict[Labels, str]] = None) -> str:
    """The exposition text: families in catalog order, each with # HELP and # TYPE once, then
    its samples sorted by labels.  meta gives (type, help) of families outside the catalog;
    raw, the label text parse() read for a label set (written again as it was, unescaped once);
    the label texts render() makes are added to it."""
    raw = {} if raw is None else raw
    out = []
    for name in sorted(samples, key=lambda n: (_ORDER.get(n, len(_ORDER)), n)):
        series = samples[name]
        if not series:
            continue
        fam = BY_NAME.get(name)
        kind, text = (fam.type, fam.help) if fam is not None else (meta or {}).get(name, ("untyped", ""))
        out.append(f"# HELP {name} {escape_help(text)}")
        out.append(f"# TYPE {name} {kind}")
        for labels in sorted(series, key=_sort_key):
            inner = raw.get(labels)
            if inner is None and labels:
                inner = raw[labels] = ",".join([f'{k}="{escape_label(v)}"' for k, v in labels])
            out.append(sample_line(name, labels, series[labels], inner))
    return "\n".join(out) + "\n" if out else ""


def _sort_key(labels: Labels) -> Tuple[str, ...]:
    # GPU indices as numbers: GPU 10 after GPU 9.
    return tuple([v.zfill(8) if v.isdigit() else v for _, v in labels])


def _unescape(text: str) -> str:
    return _UNESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), text)


def _labels(inner: str) -> Labels:
    if "\\" in inner:  # escapes: the careful way
        return tuple([(k, _unescape(v)) for k, v in _LABEL.findall(inner)])
    out = []
    for part in inner.split('",'):  # without escapes '",' only ever ends a value
        k, eq, v = part.partition('="')
        if eq:
            out.append((k.strip(), v[:-1] if v.endswith('"') else v))
    return tuple(out)


def parse(text: str, meta: Optional[Dict[str, Tuple[str, str]]] = None, raw: Optional[Dict[Labels, str]] = None) -> Samples:
    """Samples of text in the format render() writes; lines it cannot read are skipped.
    meta, when given, receives {family: (type, help)} of the # TYPE / # HELP lines; raw, the
    label text of each label set (render() reuses it instead of escaping again)."""
    out: Samples = {}
    for line in text.split("\n"):
        if not line or line[0] == "#":
            if line and meta is not None:
                _meta_line(line, meta)
            continue
        brace = line.find("{")
        if brace < 0:
            name, _, rest = line.strip().partition(" ")
            labels: Labels = ()
        else:
            end = line.rfind("}")
            if end < brace:
                continue
            inner = line[brace + 1:end]
            name, rest, labels = line[:brace], line[end + 1:], _labels(inner)
            if raw is not None:
                raw[labels] = inner
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        out.setdefault(name.strip(), {})[labels] = value
    return out


def _meta_line(line: str, meta: Dict[str, Tuple[str, str]]) -> None:
    parts = line.split(None, 3)
    if len(parts) < 3 or parts[1] not in ("HELP", "TYPE"):
        return
    kind, text = meta.get(parts[2], ("untyped", ""))
    rest = parts[3] if len(parts) > 3 else ""
    meta[parts[2]] = (rest.strip() or kind, text) if parts[1] == "TYPE" else (kind, _unescape(rest))


# --- files ---------------------------------------------------------------------------------


class UnsafeDirectory(PermissionError):
    """A metrics directory that someone other than root owns or may write to: refused, since
    they could plant FIFOs and files at our temporary names, hold our lock or forge the files."""

    def __init__(self, message: str, hint: str):
        super().__init__(errno.EPERM, message)
        self.hint = hint


def ensure_dir(directory: str) -> None:
    """The directory, created (0755) when missing; a file in its place raises OSError, one that
    someone other than root owns or group or others may write to, UnsafeDirectory."""
    try:
        os.makedirs(directory, mode=0o755, exist_ok=True)
    except FileExistsError:
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", directory) from None
    st = os.stat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", directory)
    fix = f"check what is in it, then chown root:root {directory}; chmod 755 {directory}"
    if st.st_uid not in (0, os.geteuid()):
        raise UnsafeDirectory(f"refusing metrics directory {directory}: owned by uid {st.st_uid}, not root "
                              "(its owner could forge or freeze the metrics)", fix)
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeDirectory(f"refusing metrics directory {directory}: writable by group or others (mode "
                              f"{stat.S_IMODE(st.st_mode):o}; a user could forge or freeze the metrics)", fix)


def read(directory: str, name: str) -> str:
    """A file of ours ("" when there is none); never follows a symlink, never waits on a FIFO."""
    def opener(path: str, flags: int) -> int:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        with open(os.path.join(directory, name), "rb", opener=opener) as f:
            return f.read().decode("utf-8", "replace")
    except (FileNotFoundError, NotADirectoryError):
        return ""


def write_atomic(directory: str, name: str, text: Union[str, bytes], mode: int = 0o644,
                 sync: bool = True) -> os.stat_result:
    """Replace directory/name with text in one step: readers see the old file or the new one.
    sync: fsync before the rename, so that a crash leaves the old file or the new one whole.
    Returns the new file's stat."""
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
    fd = _create(tmp, mode)
    try:
        try:
            data = text.encode("utf-8") if isinstance(text, str) else text
            while data:
                data = data[os.write(fd, data):]
            os.fchmod(fd, mode)  # whatever the umask
            if sync:
                os.fsync(fd)
            st = os.fstat(fd)
        finally:
            os.close(fd)
        os.rename(tmp, os.path.join(directory, name))
        return st
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _create(path: str, mode: int) -> int:
    """A new file of ours at path: never an existing one (a file planted there, owned by someone
    else), never through a symlink, never waiting on a FIFO.  What is already at path is the
    leftover of a killed writer with our pid, or was planted before the directory was made
    safe: it is removed, once."""
    try:
        return os.open(path, _CREATE, mode)
    except FileExistsError:
        os.unlink(path)
        return os.open(path, _CREATE, mode)


_STATE_VERSION = 1


def _identity(st: os.stat_result) -> Tuple[int, int, int]:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _state_name(name: str) -> str:
    return f".{name}.state"


def _load(directory: str, name: str) -> Tuple[Samples, Dict[Labels, str]]:
    """The samples of our file `name` and their label texts: from its sidecar when that was
    written with the file as it is now, else parsed from the text ({} when there is no file)."""
    try:
        current = _identity(os.stat(os.path.join(directory, name), follow_symlinks=False))
    except (FileNotFoundError, NotADirectoryError):
        return {}, {}
    try:
        fd = os.open(os.path.join(directory, _state_name(name)), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
                raise ValueError("not ours")
            with open(fd, "rb", closefd=False) as f:
                version, ident, samples, raw = marshal.loads(f.read())
        finally:
            os.close(fd)
        if version == _STATE_VERSION and tuple(ident) == current and isinstance(samples, dict) and isinstance(raw, dict):
            return samples, raw
    except (OSError, ValueError, EOFError, TypeError):
        pass
    raw = {}
    return parse(read(directory, name), raw=raw), raw


def merge(directory: str, name: str, change: Callable[[Samples], Samples], sync: bool = False) -> None:
    """Replace our file `name` with render(change(its samples)), under the directory's lock,
    and its sidecar with what the next merge needs to skip parsing."""
    with DirLock(directory):
        old, raw = _load(directory, name)
        new = change(old)
        st = write_atomic(directory, name, render(new, raw=raw), sync=sync)
        used = {labels: raw[labels] for series in new.values() for labels in series if labels in raw}
        try:
            write_atomic(directory, _state_name(name), marshal.dumps((_STATE_VERSION, _identity(st), new, used)),
                         mode=0o600, sync=False)
        except ValueError:  # a value marshal cannot write: the next merge parses the text
            remove(directory, _state_name(name))


def remove(directory: str, name: str) -> bool:
    try:
        os.unlink(os.path.join(directory, name))
        return True
    except FileNotFoundError:
        return False


def listing(directory: str) -> Iterator[str]:
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return iter(())
    return iter(sorted(names))


class LockTimeout(OSError):
    pass


# How long a writer waits for the directory's lock.  A merge holds it for a few ms, but a burst
# of hooks (a job array ending: 64 epilogs at once) queues them all: with 0.1 s, 40-45 of 64
# node-file updates were dropped on the 2-core development VM, where each holder, sharing the
# CPUs with 63 others, keeps the lock for up to ~250 ms (benchmarks/bench_metrics_burst.py).
# 10 s lets such a burst through whole and stays well inside the hooks' budgets (prolog 30 s,
# epilog 60 s by default); without contention nobody waits at all.
LOCK_WAIT_S = 10.0


class DirLock:
    """An exclusive flock on `.slurm-gpu.lock` in a directory, waited for at most wait_s.

    Prologs and epilogs of jobs sharing a node run at once: each reads, merges and replaces
    the node file under this lock.  Neither node_exporter (it reads *.prom) nor dcgm-exporter
    (digits only) looks at the lock file.  It is root's and mode 0600 in a directory only root
    may write (ensure_dir): a user cannot open it, so cannot hold the lock to freeze the metrics."""

    NAME = ".slurm-gpu.lock"
    _OPEN = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

    def __init__(self, directory: str, wait_s: float = LOCK_WAIT_S):
        self.path = os.path.join(directory, self.NAME)
        self.wait_s = wait_s
        self.fd = -1

    def __enter__(self) -> "DirLock":
        self.fd = self._open()
        end = time.monotonic() + self.wait_s
        pause = 0.002
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() >= end:
                    os.close(self.fd)
                    self.fd = -1
                    raise LockTimeout(errno.EAGAIN, f"locked by another writer for over {self.wait_s:g} s", self.path) from None
                time.sleep(pause)
                pause = min(pause * 2, 0.02)  # dozens of waiters in a burst: polling must not eat the CPUs

    def _open(self) -> int:
        """The lock file, when only we can open it.  One that others could open (mode 0644 as
        earlier versions made it, another owner, not a regular file, a symlink) is replaced by a
        new one: whoever holds a flock on the old one then holds nothing a writer waits for."""
        try:
            fd = os.open(self.path, self._OPEN, 0o600)
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077:
                return fd
            os.close(fd)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
        tmp = f"{self.path}.{os.getpid()}.tmp"
        os.close(_create(tmp, 0o600))
        os.rename(tmp, self.path)
        return os.open(self.path, self._OPEN, 0o600)

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing drops the lock
            self.fd = -1
