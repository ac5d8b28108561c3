"""`slurm-gpu check` on 8 simulated GPUs vs a bare `python3 -c pass`, interleaved in one run.

Target (issue 2): median ratio <= 3.   Usage: python3 benchmarks/bench_check.py [runs]
"""
from __future__ import annotations

import sys

from _common import SimNode, console_script, report, wall


def main(runs: int = 21) -> float:
    node = SimNode(8)
    try:
        env = node.env()
        check = console_script("slurm-gpu") + ["check"]
        wall(check, env)  # warm the page cache and __pycache__
        base, samples = [], []
        for _ in range(runs):
            base.append(wall([sys.executable, "-c", "pass"], env))
            samples.append(wall(check, env))
        return report("slurm-gpu check (8 GPUs)", samples, base)
    finally:
        node.cleanup()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 21)
