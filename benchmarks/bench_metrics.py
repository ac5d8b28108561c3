"""What the Prometheus metrics cost a hook on 8 simulated GPUs (issue 14: "a few milliseconds").

    python3 benchmarks/bench_metrics.py [runs]

A simulated 8-GPU node with metrics.textfile_dir and metrics.dcgm_job_mapping_dir set; one
`slurm-gpu healthcheck` first, so that the node file holds every GPU (as on a node in service).
Then, interleaved over `runs` jobs: a prolog and an epilog (the installed console scripts, as
slurmd runs them) with metrics on, and the same with metrics off.  Prints

- the time the hook spends in its metrics step (the `metrics` debug line of the hook log:
  node file merge, job info file, dcgm mapping; for the epilog also the usage counters read
  from the node database and the stale-job sweep), median and min;
- the whole hook's wall time with and without metrics, median, and the difference;
- the size of the node file.
"""
from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys

from _common import SimNode, console_script, wall
from bench_hooks import job_env


def metrics_ms(log: str, hook: str) -> list:
    return [float(m) for m in re.findall(rf"{hook}.*? metrics .*?ms=([0-9.]+)", log)]


def main(runs: int) -> None:
    on, off = SimNode(8), SimNode(8)
    textfile, mapping = on.dir / "textfile", on.dir / "dcgm"
    for node, extra in ((on, f'[metrics]\ntextfile_dir = "{textfile}"\ndcgm_job_mapping_dir = "{mapping}"\n'),
                        (off, "")):
        node.config.write_text(node.config.read_text().replace("[log]\n", '[log]\nlevel = "debug"\n') + extra)
    prolog, epilog = console_script("slurm-gpu-prolog"), console_script("slurm-gpu-epilog")
    cli = console_script("slurm-gpu")
    try:
        subprocess.run([*cli, "healthcheck"], env=on.env(SLURMD_NODENAME="bench01"),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall(prolog, job_env(on, 1))
        wall(epilog, job_env(on, 1))
        times = {("prolog", True): [], ("epilog", True): [], ("prolog", False): [], ("epilog", False): []}
        for i in range(runs):
            for node, is_on in ((on, True), (off, False)):
                node.reset()
                env = job_env(node, 100 + i)
                times[("prolog", is_on)].append(wall(prolog, env))
                times[("epilog", is_on)].append(wall(epilog, env))
        log = (on.dir / "hooks.log").read_text()
        for hook in ("prolog", "epilog"):
            ms = metrics_ms(log, hook)[2:] if hook == "prolog" else metrics_ms(log, hook)[1:]
            with_m = statistics.median(times[(hook, True)]) * 1000
            without = statistics.median(times[(hook, False)]) * 1000
            print(f"{hook}: metrics step median {statistics.median(ms):5.2f} ms (min {min(ms):.2f}, n={len(ms)});"
                  f" hook wall median {with_m:6.1f} ms with metrics, {without:6.1f} ms without"
                  f" (difference {with_m - without:+.1f} ms)")
        node_file = textfile / "slurm_gpu_node.prom"
        lines = node_file.read_text().count("\n") if node_file.exists() else 0
        print(f"node file: {lines} lines, {node_file.stat().st_size if node_file.exists() else 0} bytes")
        errors = [line for line in log.splitlines() if " ERROR " in line]
        if errors:
            print("hook errors:", *errors[:5], sep="\n  ")
    finally:
        on.cleanup()
        off.cleanup()


if __name__ == "__main__":
    os.environ.pop("SLURM_GPU_CONFIG", None)
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 21)
