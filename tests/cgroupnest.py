"""A testbed's own cgroup v1 subtree, and the cgroup namespace its slurmd's run in.

Sites run slurmd with proctrack/cgroup and task/cgroup: each slurmd makes ``slurm_<node>/`` at the root
of every v1 hierarchy and ``uid_<uid>/job_<id>/step_<step>/`` below it.  The testbed runs several
clusters at once on one machine (a shared two-node cluster beside a four-node one, this machine's suite
beside a root filesystem's), all with nodes named gpu01..., all numbering their jobs from 1: on the
machine's own hierarchies they would share ``/slurm_gpu01/uid_1001/job_1/``.  So each testbed gets a
directory of its own in every v1 hierarchy (below the cgroup this process is in), and its slurmd's start
in a cgroup namespace rooted there, with the hierarchies mounted afresh in a private mount namespace:
slurmd, its prolog and epilog and its jobs see ``/slurm_gpu01/uid_1001/job_1/step_batch`` as on a real
node (``/proc/PID/cgroup`` is relative to the reader's namespace), and a reader outside sees
``.../slurm-gpu-testbed-<pid>-<n>/slurm_gpu01/...``.

Linux cgroup v1 only (``/sys/fs/cgroup`` a tmpfs of v1 hierarchies, as on these machines and on CI's).
"""
from __future__ import annotations

import itertools
import os
import shlex
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = "/sys/fs/cgroup"
TAG_PREFIX = "slurm-gpu-testbed-"
# What Slurm's cgroup/v1 plugin uses: proctrack/cgroup (freezer), ConstrainDevices (devices), task/cgroup
# (cpuset, memory), jobacct_gather/cgroup (cpuacct, memory).
NEEDED = ("freezer", "devices", "cpuset", "memory", "cpuacct")
_SEQ = itertools.count(1)


def _subsystems() -> List[str]:
    """The kernel's cgroup controllers (/proc/cgroups)."""
    try:
        with open("/proc/cgroups") as f:
            return [line.split()[0] for line in f if line.strip() and not line.startswith("#")]
    except OSError:
        return []


def v1_mounts(mountinfo: str = "/proc/self/mountinfo") -> List[Tuple[str, str]]:
    """(mount point, hierarchy options: "freezer", "cpu,cpuacct", "none,name=systemd") of each cgroup v1
    hierarchy mounted directly below /sys/fs/cgroup, in mount order."""
    known = set(_subsystems())
    out = []
    with open(mountinfo) as f:
        for line in f:
            head, _, tail = line.partition(" - ")
            fields, extra = head.split(), tail.split()
            if len(fields) < 5 or len(extra) < 3 or extra[0] != "cgroup" or os.path.dirname(fields[4]) != ROOT:
                continue
            opts = [o for o in extra[2].split(",") if o in known or o.startswith("name=")]
            if opts and all(o.startswith("name=") for o in opts):
                opts = ["none", *opts]
            if opts:
                out.append((fields[4], ",".join(opts)))
    return out


def _controllers(opts: str) -> List[str]:
    return [o for o in opts.split(",") if o != "none"]


def unavailable_reason() -> Optional[str]:
    """Why this machine cannot give a testbed cgroup v1 hierarchies of its own; None when it can."""
    if not os.path.isdir(ROOT):
        return f"{ROOT} does not exist"
    have = {c for _, opts in v1_mounts() for c in _controllers(opts)}
    missing = [c for c in NEEDED if c not in have]
    if missing:
        return (f"no cgroup v1 hierarchy for {', '.join(missing)} under {ROOT} (a cgroup v2 machine: "
                "the testbed's production shape needs v1 here, docs/testbed.md)")
    return None


def _own_paths() -> Dict[str, str]:
    """{hierarchy options as /proc/self/cgroup names them: path} of this process."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            if names:
                out[names] = path
    return out


class CgroupNest:
    """The testbed's directory in every v1 hierarchy (create, wrap a daemon's argv, remove)."""

    def __init__(self, tag: Optional[str] = None):
        self.tag = tag or f"{TAG_PREFIX}{os.getpid()}-{next(_SEQ)}"
        self.mounts = v1_mounts()
        self.dirs: List[Path] = []

    def create(self) -> "CgroupNest":
        own = _own_paths()
        for point, opts in self.mounts:
            names = ",".join(_controllers(opts))
            rel = own.get(names, "/")
            parent = Path(point + rel.rstrip("/")) if rel != "/" else Path(point)
            d = parent / self.tag
            d.mkdir(exist_ok=True)
            if "cpuset" in names.split(","):
                # A new cpuset has no CPUs and no memory nodes: no process could enter it.
                for key in ("cpuset.cpus", "cpuset.mems"):
                    (d / key).write_text((parent / key).read_text())
            self.dirs.append(d)
        return self

    def wrap(self, argv: List[str]) -> List[str]:
        """argv that enters the testbed's cgroups, then a cgroup and a mount namespace of its own with
        every hierarchy mounted at its usual place (rooted at the testbed's directory), then execs argv.
        The pid stays the same throughout (sh, unshare and sh exec)."""
        enter = "; ".join(f"echo $$ > {shlex.quote(str(d / 'cgroup.procs'))}" for d in self.dirs)
        links = [(p.name, os.readlink(p)) for p in sorted(Path(ROOT).iterdir()) if p.is_symlink()]
        # Not `unshare --propagation private`: it remounts /, which fails in a chroot (a root
        # filesystem of .ci/rootfs.sh, where / is no mount point).  /sys is one in both places.
        inner = ["mount --make-rprivate /sys", f"mount -t tmpfs -o mode=755 cgroup_root {ROOT}"]
        for point, opts in self.mounts:
            inner.append(f"mkdir -p {shlex.quote(point)} && mount -t cgroup -o {shlex.quote(opts)} cgroup "
                         f"{shlex.quote(point)}")
        inner += [f"ln -s {shlex.quote(target)} {shlex.quote(ROOT + '/' + name)}" for name, target in links]
        inner.append('exec "$@"')
        script = (f"set -e; {enter}; exec unshare --cgroup --mount --propagation unchanged sh -c "
                  f"{shlex.quote('set -e; ' + '; '.join(inner))} sh \"$@\"")
        return ["sh", "-c", script, "sh", *argv]

    def remove(self, wait_s: float = 5.0) -> List[str]:
        """Remove the testbed's directories, deepest first (Slurm leaves slurm_<node>/ and its system/
        directory behind).  A directory that still holds a process is retried for wait_s; what could not
        be removed is returned."""
        deadline = time.monotonic() + wait_s
        left: List[str] = []
        for d in self.dirs:
            while True:
                stuck = _rmtree_cgroup(d)
                if not stuck or time.monotonic() > deadline:
                    left += stuck
                    break
                time.sleep(0.1)
        return left


def _rmtree_cgroup(d: Path) -> List[str]:
    if not d.exists():
        return []
    stuck: List[str] = []
    for sub, dirs, _ in os.walk(d, topdown=False):
        for name in dirs:
            try:
                os.rmdir(os.path.join(sub, name))
            except FileNotFoundError:
                pass
            except OSError:
                stuck.append(os.path.join(sub, name))
    try:
        os.rmdir(d)
    except FileNotFoundError:
        pass
    except OSError:
        stuck.append(str(d))
    return stuck


def remove_orphans() -> List[str]:
    """Directories of testbeds whose process is gone (a crashed run), removed where empty."""
    removed = []
    own = _own_paths()
    for point, opts in v1_mounts():
        rel = own.get(",".join(_controllers(opts)), "/")
        for d in Path(point + rel.rstrip("/")).glob(f"{TAG_PREFIX}*"):
            try:
                pid = int(d.name[len(TAG_PREFIX):].split("-")[0])
            except ValueError:
                continue
            if not os.path.exists(f"/proc/{pid}") and not _rmtree_cgroup(d):
                removed.append(str(d))
    return removed
