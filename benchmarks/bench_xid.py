"""The prolog and `slurm-gpu check` reading XIDs from a kernel log (file source) against an empty one,
8 simulated GPUs, alternated in one run: added wall time (median) and peak memory (the child's max
RSS, median).  Logs:

- big: 1 GB of kernel lines, the last hour without an XID (issue 39, item 1);
- flood: 800,000 identical XID lines in the window, syslog dates (whole seconds), the last 50 minutes;
- flood-us: the same with a date to the microsecond on every line (rsyslog high precision), so
  that no two lines are the same text (issue 39, item 3: floods counted, not stored).

The floods are XID 13 on GPU 0 (an application XID, ignored by default: the node keeps taking jobs,
so every job start pays for reading them); a critical code costs the same to read and FAILs.

Target (issue 39): at most 20 ms added when the window holds no XID; peak memory at most 30 MB over
the empty-log run.
Usage: python3 benchmarks/bench_xid.py [--venv] [--size-mb N] [--logs big,flood,flood-us] [runs]
  --venv   run with a fresh virtual environment's regular install (see bench_hooks.py)
"""
from __future__ import annotations

import os
import statistics
import subprocess
import time
from typing import Dict, List, Tuple

from _common import SimNode, args_or_clean_venv, console_script
from bench_hooks import job_env


def _syslog_date(t: float) -> str:
    return time.strftime("%b %e %H:%M:%S", time.localtime(t))


def write_log(path: str, size_mb: int) -> None:
    """size_mb of kernel lines two days old (an XID among them), then the last hour's chatter, no XID."""
    now = time.time()
    old = "".join(f"{_syslog_date(now - 2 * 86400)} node01 kernel: usb 1-1: reset high-speed USB device number {i}\n"
                  for i in range(9000))
    old += f"{_syslog_date(now - 2 * 86400)} node01 kernel: NVRM: Xid (PCI:0000:18:00): 79, GPU has fallen off the bus.\n"
    chunk = old.encode()
    with open(path, "wb") as f:
        written = 0
        while written < size_mb << 20:
            f.write(chunk)
            written += len(chunk)
        f.write("".join(f"{_syslog_date(now - 3600 + i)} node01 kernel: eth0: link up {i}\n"
                        for i in range(0, 3600, 3)).encode())


FLOOD_LINES = 800_000
FLOOD_XID = ("kernel: NVRM: Xid (PCI:0000:18:00): 13, pid=4242, name=python3, Graphics SM Warp Exception on "
             "(GPC 7, TPC 7, SM 0): Illegal Instruction Parameter")


def write_flood(path: str, precise: bool, lines: int = FLOOD_LINES, span_s: float = 3000.0) -> None:
    """`lines` identical XID lines over the span_s seconds before now, after an hour of other lines."""
    now = time.time()
    step = span_s / lines

    def date(t: float) -> str:
        if precise:
            return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1e6):06d}+00:00"
        return _syslog_date(t)
    with open(path, "w") as f:
        f.write("".join(f"{date(now - span_s - 3600 + i)} node01 kernel: eth0: link up {i}\n" for i in range(0, 3600, 3)))
        for i in range(0, lines, 10_000):
            f.write("".join(f"{date(now - span_s + (i + k) * step)} node01 {FLOOD_XID}\n"
                            for k in range(min(10_000, lines - i))))


def run(argv: List[str], env: Dict[str, str]) -> Tuple[float, int]:
    """(wall seconds, peak RSS in KiB) of one run."""
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(p.pid, 0)
    took = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode not in (0, 1):
        raise RuntimeError(f"{argv} exited {p.returncode}")
    return took, usage.ru_maxrss


def main(runs: int, size_mb: int, logs: List[str]) -> None:
    node = SimNode(8)
    try:
        paths = {"empty": node.dir / "kern-empty.log"}
        paths["empty"].write_bytes(b"")
        for name in logs:
            paths[name] = node.dir / f"kern-{name}.log"
            if name == "big":
                write_log(str(paths[name]), size_mb)
            else:
                write_flood(str(paths[name]), precise=name == "flood-us")
        text = node.config.read_text()
        configs = {}
        for name, log in paths.items():
            configs[name] = node.dir / f"config-{name}.toml"
            configs[name].write_text(text.replace('source = "none"', f'source = "file:{log}"'))
        prolog, check = console_script("slurm-gpu-prolog"), console_script("slurm-gpu") + ["check"]
        res: Dict[Tuple[str, str], List[Tuple[float, int]]] = {}
        for i in range(runs + 1):
            for what, argv in (("prolog", prolog), ("check", check)):
                for name in paths:
                    node.reset()
                    env = dict(job_env(node, 100 + i), SLURM_GPU_CONFIG=str(configs[name]))
                    got = run(argv, env)
                    if i:  # the first round warms the page cache
                        res.setdefault((what, name), []).append(got)
        for name in logs:
            size = paths[name].stat().st_size / (1 << 20)
            print(f"{name}: {size:,.0f} MiB" + (", the last hour without an XID" if name == "big" else
                                                f", {FLOOD_LINES:,} XID lines in the window"))
        for what in ("prolog", "check"):
            w0, m0 = (statistics.median(x[0] for x in res[(what, "empty")]),
                      statistics.median(x[1] for x in res[(what, "empty")]))
            for name in logs:
                w1, m1 = (statistics.median(x[0] for x in res[(what, name)]),
                          statistics.median(x[1] for x in res[(what, name)]))
                print(f"{what:7} empty log {w0 * 1000:6.1f} ms {m0 / 1024:6.1f} MiB   {name:8} {w1 * 1000:7.1f} ms "
                      f"{m1 / 1024:6.1f} MiB   added {1000 * (w1 - w0):+7.1f} ms {(m1 - m0) / 1024:+6.1f} MiB   (n={runs})")
    finally:
        node.cleanup()


if __name__ == "__main__":
    argv = args_or_clean_venv(__file__)
    size = 1024
    if "--size-mb" in argv:
        i = argv.index("--size-mb")
        size = int(argv[i + 1])
        del argv[i:i + 2]
    which = ["big", "flood", "flood-us"]
    if "--logs" in argv:
        i = argv.index("--logs")
        which = argv[i + 1].split(",")
        del argv[i:i + 2]
    main(int(argv[0]) if argv else 11, size, which)
