"""A burst of concurrent epilogs on one node: how many metric updates the directory lock drops.

    python3 benchmarks/bench_metrics_burst.py [epilogs] [rounds]

A simulated 8-GPU node with metrics.textfile_dir set; `epilogs` epilogs (default 64, the console
script slurmd runs, one job per GPU slot) are started at once, as when a job array ends, and
each merges its view into slurm_gpu_node.prom and the usage counters into slurm_gpu_usage.prom
under the directory's lock (metrics/textfile.py DirLock).  A merge that cannot get the lock in
time is dropped: the hook logs `metrics-write-failed ... locked by another writer`.  Prints,
per round and over all rounds: node-file and usage-file updates lost, the epilog's metrics
step (the `metrics` debug line: median and max) and the burst's wall time.
"""
from __future__ import annotations

import re
import statistics
import subprocess
import sys
import time

from _common import SimNode, console_script
from bench_hooks import job_env


def burst(node: SimNode, epilog, n: int, first_job: int) -> float:
    t0 = time.perf_counter()
    procs = [subprocess.Popen(list(epilog), env=job_env(node, first_job + i, gpus=str(i % 8)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(n)]
    codes = [p.wait() for p in procs]
    if any(c not in (0, 1) for c in codes):
        raise RuntimeError(f"epilog exit codes {sorted(set(codes))}")
    return time.perf_counter() - t0


def counts(log: str) -> dict:
    locked = [line for line in log.splitlines() if "metrics-write-failed" in line and "locked by another writer" in line]
    return {"node": sum(" what=node " in line for line in locked), "usage": sum(" what=usage " in line for line in locked),
            "steps": [float(m) for m in re.findall(r"epilog.*? metrics .*?ms=([0-9.]+)", log)]}


def main(n: int, rounds: int) -> None:
    node = SimNode(8)
    textfile = node.dir / "textfile"
    node.config.write_text(node.config.read_text().replace("[log]\n", '[log]\nlevel = "debug"\n')
                           + f'[metrics]\ntextfile_dir = "{textfile}"\n')
    epilog = console_script("slurm-gpu-epilog")
    log_path = node.dir / "hooks.log"
    lost_node, lost_usage, steps = [], [], []
    try:
        for r in range(rounds):
            node.reset()
            log_path.write_text("")
            took = burst(node, epilog, n, 1000 * (r + 1))
            c = counts(log_path.read_text())
            lost_node.append(c["node"])
            lost_usage.append(c["usage"])
            steps.extend(c["steps"])
            print(f"round {r + 1}: {n} epilogs in {took:5.2f} s; lost node-file updates {c['node']}/{n}, "
                  f"usage {c['usage']}/{n}; metrics step median {statistics.median(c['steps']):.1f} ms, "
                  f"max {max(c['steps']):.1f} ms")
        print(f"all {rounds} rounds: lost node-file updates {sum(lost_node)}/{n * rounds} "
              f"(per round {min(lost_node)}-{max(lost_node)}), usage {sum(lost_usage)}/{n * rounds}; "
              f"metrics step median {statistics.median(steps):.1f} ms, max {max(steps):.1f} ms")
    finally:
        node.cleanup()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 64, int(sys.argv[2]) if len(sys.argv) > 2 else 3)
