"""`slurm-gpu check` on 8 simulated GPUs vs a bare `python3 -c pass`, interleaved in one run.

Target (issue 37): median ratio <= 3.5 in a clean virtual environment with a regular install.
Also timed: the floor, `python -c "import ..."` of the modules not ours that `check` imports (with
and without click): what `check` would cost if slurm-gpu's own code and the NVML calls cost nothing.
Usage: python3 benchmarks/bench_check.py [--venv] [runs]
  --venv   `pip install` this repository (not editable) into a fresh virtual environment and run
           with its console script and its python (also the baseline): a development venv's
           bare interpreter is slower (its .pth files), which flatters the ratio.
"""
from __future__ import annotations

import sys

from _common import SimNode, args_or_clean_venv, console_script, foreign_modules, report, wall


def main(runs: int = 21) -> float:
    node = SimNode(8)
    try:
        env = node.env()
        check = console_script("slurm-gpu") + ["check"]
        wall(check, env)  # warm the page cache and __pycache__
        # The floor: `python -c "import ..."` of the standard library, click and pynvml that `check`
        # imports, timed in the same alternation (bench_hooks.py says more).
        foreign = foreign_modules(check[1:] if check[0] == sys.executable else check, env)
        # Without click: also without every module click imports, even those check needs anyway (re,
        # typing, enum): a floor lower than any click-free `check` could reach.
        clicks = set(foreign_modules(["-c", "import click"], env))
        floors = {"floor: its stdlib + click + pynvml": foreign,
                  "floor without click's imports": [m for m in foreign if m not in clicks]}
        base, samples = [], []
        floor: dict = {name: [] for name in floors}
        for _ in range(runs):
            base.append(wall([sys.executable, "-c", "pass"], env))
            for name, mods in floors.items():
                floor[name].append(wall([sys.executable, "-c", "import " + ", ".join(mods)], env))
            samples.append(wall(check, env))
        ratio = report("slurm-gpu check (8 GPUs)", samples, base)
        for name in floors:
            report(name, floor[name], base)
        return ratio
    finally:
        node.cleanup()


if __name__ == "__main__":
    argv = args_or_clean_venv(__file__)
    main(int(argv[0]) if argv else 21)
