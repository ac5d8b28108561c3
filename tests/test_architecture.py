"""The layers of docs/architecture.md hold: import-linter checks the contracts in .importlinter."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.host_only  # neither Slurm's version nor Python's: once, on the host (docs/testbed.md)

ROOT = Path(__file__).resolve().parents[1]


def test_imports_point_down_and_the_hook_path_stays_light():
    # The interpreter's own first: another installation on PATH may be an older version.
    exe = str(Path(sys.executable).with_name("lint-imports"))
    exe = exe if os.access(exe, os.X_OK) else (shutil.which("lint-imports") or exe)
    if not os.path.exists(exe):
        from testbed import unavailable
        unavailable("import-linter is not installed (pip install -e '.[test]')")
    cp = subprocess.run([exe, "--config", str(ROOT / ".importlinter")], cwd=str(ROOT), capture_output=True,
                        text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert cp.returncode == 0, cp.stdout[-4000:] + cp.stderr[-2000:]
    assert cp.stdout.count("KEPT") == 5, cp.stdout


def test_no_module_imports_one_that_imports_it_back():
    """Issue 37: no import cycle between the package's modules, lazy imports included (an import
    that only type checkers see is no cycle: it never runs)."""
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("slurm_gpu", exclude_type_checking_imports=True)
    index: dict = {}
    low: dict = {}
    stack: list = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.find_modules_directly_imported_by(v):
            if not w.startswith("slurm_gpu"):
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                cycles.append(sorted(part))

    for m in sorted(graph.modules):
        if m not in index:
            visit(m)
    assert cycles == []


def test_checks_run_in_the_order_of_families_whatever_imported_them_first():
    """The first FAIL is the drain reason, so the order is behaviour; it must not depend on which
    family some module happened to import first."""
    code = ("import slurm_gpu.policy.checks.xids, slurm_gpu.policy.checks.memory\n"
            "from slurm_gpu.policy import checks\nfrom slurm_gpu.policy.checks import registry\nchecks.load()\n"
            "print(' '.join(f.__module__.rsplit('.', 1)[-1] for f in registry.GPU_CHECKS))")
    cp = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                        env=dict(os.environ, PYTHONPATH=str(ROOT)))
    families = cp.stdout.split()
    from slurm_gpu.policy.checks import FAMILIES
    assert families == sorted(families, key=FAMILIES.index)
    assert families[0] == "thermal" and families[-1] == "xids"
