"""The prolog and `slurm-gpu check` reading XIDs from a 1 GB kernel log (file source) against an
empty one, 8 simulated GPUs, alternated in one run: added wall time (median) and peak memory (the
child's max RSS, median).

Target (issue 39): at most 20 ms and 30 MB added when the window holds no XID.
Usage: python3 benchmarks/bench_xid.py [--venv] [--size-mb N] [runs]
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


def main(runs: int, size_mb: int) -> None:
    node = SimNode(8)
    try:
        big, empty = node.dir / "kern-big.log", node.dir / "kern-empty.log"
        write_log(str(big), size_mb)
        empty.write_bytes(b"")
        text = node.config.read_text()
        configs = {}
        for name, log in (("empty", empty), ("big", big)):
            configs[name] = node.dir / f"config-{name}.toml"
            configs[name].write_text(text.replace('source = "none"', f'source = "file:{log}"'))
        prolog, check = console_script("slurm-gpu-prolog"), console_script("slurm-gpu") + ["check"]
        res: Dict[Tuple[str, str], List[Tuple[float, int]]] = {}
        for i in range(runs + 1):
            for what, argv in (("prolog", prolog), ("check", check)):
                for name in ("empty", "big"):
                    node.reset()
                    env = dict(job_env(node, 100 + i), SLURM_GPU_CONFIG=str(configs[name]))
                    got = run(argv, env)
                    if i:  # the first round warms the page cache
                        res.setdefault((what, name), []).append(got)
        print(f"kernel log: {big.stat().st_size / (1 << 20):,.0f} MiB of lines, the last hour without an XID")
        for what in ("prolog", "check"):
            (w0, m0), (w1, m1) = ((statistics.median(x[0] for x in res[(what, n)]),
                                   statistics.median(x[1] for x in res[(what, n)])) for n in ("empty", "big"))
            print(f"{what:7} empty log {w0 * 1000:6.1f} ms {m0 / 1024:6.1f} MiB   big log {w1 * 1000:6.1f} ms "
                  f"{m1 / 1024:6.1f} MiB   added {1000 * (w1 - w0):+6.1f} ms {(m1 - m0) / 1024:+6.1f} MiB   (n={runs})")
    finally:
        node.cleanup()


if __name__ == "__main__":
    argv = args_or_clean_venv(__file__)
    size = 1024
    if "--size-mb" in argv:
        i = argv.index("--size-mb")
        size = int(argv[i + 1])
        del argv[i:i + 2]
    main(int(argv[0]) if argv else 11, size)
