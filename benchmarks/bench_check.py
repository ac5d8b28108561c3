"""`slurm-gpu check` on 8 simulated GPUs vs a bare `python3 -c pass`, interleaved in one run.

Target (issue 37): median ratio <= 3.5 in a clean virtual environment with a regular install.
Usage: python3 benchmarks/bench_check.py [--venv] [runs]
  --venv   `pip install` this repository (not editable) into a fresh virtual environment and run
           with its console script and its python (also the baseline): a development venv's
           bare interpreter is slower (its .pth files), which flatters the ratio.
"""
from __future__ import annotations

import sys

from _common import SimNode, console_script, in_clean_venv, report, wall


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
    argv = sys.argv[1:]
    if "--venv" in argv:
        sys.exit(in_clean_venv(__file__, [a for a in argv if a != "--venv"]))
    main(int(argv[0]) if argv else 21)
