"""Prolog and epilog wall time on 8 simulated GPUs vs `python3 -c pass`, and 64 epilogs at once.

Targets: prolog and epilog <= 5x a bare `python3 -c pass` of the same interpreter, measured in a
clean virtual environment with a regular install (issue 11; `--venv` does that set-up); 64
concurrent epilogs against one database: records written / expected == 1.0 with zero errors.

Usage: python3 benchmarks/bench_hooks.py [--venv] [--no-concurrent] [runs]
  --venv            create a virtual environment in a temporary directory, `pip install` this
                    repository into it (not editable), and run everything with its console
                    scripts and its python (also the baseline)
  --no-concurrent   skip the 64-epilog run
It also prints the hook path's import time (`-X importtime`: every module the prolog imports
that a bare interpreter does not, at start-up and lazily during the run), and the floor: `python
-c "import ..."` of the standard-library modules and pynvml the prolog imports (foreign_modules),
timed in the same alternation: what the prolog would cost if slurm-gpu's own code cost nothing.
"""
from __future__ import annotations

import sqlite3
import subprocess
import sys
import time

from _common import SimNode, console_script, foreign_modules, imported_ms, in_clean_venv, report, wall


def job_env(node, job_id, gpus="0-7"):
    return node.env(SLURM_JOB_ID=str(job_id), SLURM_JOB_GPUS=gpus, SLURMD_NODENAME="bench01",
                    SLURM_CLUSTER_NAME="bench", SLURM_JOB_USER="alice", SLURM_JOB_UID="2501",
                    SLURM_JOB_ACCOUNT="physics", SLURM_JOB_PARTITION="gpu", SLURM_JOB_RESTART_COUNT="0",
                    SLURM_JOB_EXIT_CODE="0")


def sequential(runs: int):
    node = SimNode(8)
    prolog, epilog = console_script("slurm-gpu-prolog"), console_script("slurm-gpu-epilog")
    try:
        wall(prolog, job_env(node, 1))
        wall(epilog, job_env(node, 1))
        node.reset()
        argv = prolog[1:] if prolog[0] == sys.executable else prolog
        floor_cmd = [sys.executable, "-c", "import " + ", ".join(foreign_modules(argv, job_env(node, 2)))]
        base, pro, epi, floor = [], [], [], []
        for i in range(runs):
            node.reset()
            env = job_env(node, 100 + i)
            base.append(wall([sys.executable, "-c", "pass"], env))
            floor.append(wall(floor_cmd, env))
            pro.append(wall(prolog, env))
            epi.append(wall(epilog, env))
        r1 = report("prolog (8 GPUs)", pro, base)
        r2 = report("epilog (8 GPUs)", epi, base)
        report("floor: its stdlib + pynvml", floor, base)
        print(f"{'':28} ({floor_cmd[-1][7:][:150]}{'...' if len(floor_cmd[-1]) > 157 else ''})")
        log = (node.dir / "hooks.log").read_text()
        errors = [line for line in log.splitlines() if " ERROR " in line]
        if errors:
            print("hook errors:", *errors[:5], sep="\n  ")
        return r1, r2
    finally:
        node.cleanup()


def import_time(runs: int = 5) -> None:
    """Median over `runs` prologs of the summed import time of what the hook imports."""
    node = SimNode(8)
    prolog = console_script("slurm-gpu-prolog")
    argv = prolog[1:] if prolog[0] == sys.executable else prolog  # without the interpreter
    try:
        totals, samples = [], []
        for i in range(runs):
            node.reset()
            mods = imported_ms(argv, job_env(node, 500 + i), sys.executable)
            totals.append(sum(mods.values()))
            samples.append(mods)
        totals_sorted = sorted(range(runs), key=lambda k: totals[k])
        mid = samples[totals_sorted[runs // 2]]
        top = sorted(mid.items(), key=lambda kv: -kv[1])[:8]
        print(f"{'prolog import time':<28} median {sorted(totals)[runs // 2]:7.1f} ms   (n={runs}; largest: "
              + ", ".join(f"{k} {v:.1f}" for k, v in top) + ")")
    finally:
        node.cleanup()


def concurrent(n: int = 64):
    node = SimNode(8)
    prolog, epilog = console_script("slurm-gpu-prolog"), console_script("slurm-gpu-epilog")
    try:
        # n single-GPU jobs started (prologs in sequence), then all ending at the same moment.
        for j in range(n):
            subprocess.run(prolog, env=job_env(node, 1000 + j, str(j % 8)), check=True)
        t0 = time.perf_counter()
        procs = [subprocess.Popen(epilog, env=job_env(node, 1000 + j, str(j % 8)), stderr=subprocess.PIPE)
                 for j in range(n)]
        codes = [p.wait(timeout=300) for p in procs]
        took = time.perf_counter() - t0
        conn = sqlite3.connect(str(node.dir / "usage.db"))
        written = conn.execute("SELECT count(*) FROM job_gpus WHERE job_id >= 1000").fetchone()[0]
        conn.close()
        spooled = len(list((node.dir / "spool").glob("*.json"))) if (node.dir / "spool").exists() else 0
        log = (node.dir / "hooks.log").read_text()
        errors = sum(1 for line in log.splitlines() if " ERROR " in line) + sum(1 for c in codes if c != 0)
        print(f"{n} concurrent epilogs: {took:.2f} s wall, records written {written}/{n} = {written / n:.3f}, "
              f"spooled {spooled}, errors {errors}")
        return written / n, errors
    finally:
        node.cleanup()


def main(argv) -> int:
    if "--venv" in argv:
        return in_clean_venv(__file__, [a for a in argv if a != "--venv"])
    numbers = [a for a in argv if not a.startswith("--")]
    runs = int(numbers[0]) if numbers else 15
    sequential(runs)
    import_time()
    if "--no-concurrent" not in argv:
        concurrent(64)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
