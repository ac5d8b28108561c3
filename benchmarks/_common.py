"""Shared helpers for the benchmarks: the simulated node and timing of whole processes."""
from __future__ import annotations

import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import simgpu  # noqa: E402

# What a copy of the repository for a regular install leaves out: build outputs (a stale
# build/lib would end up in the wheel), caches, the simulated driver's build.
_NOT_INSTALLED = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                        ".demo", ".venv", ".gl")


def clean_venv(where: pathlib.Path, extras: str = "") -> pathlib.Path:
    """A fresh virtual environment under `where` with this repository installed the way a site
    installs it (regular, not editable, its modules compiled: pip writes the bytecode even where
    PYTHONDONTWRITEBYTECODE is set, as it is on some build hosts, and every run of a source
    checkout then compiles each module it imports again): returns its python.  `extras`: e.g.
    "central" for PyMySQL.  No site-packages of ours leak in."""
    src, venv = where / "src", where / "venv"
    shutil.copytree(ROOT, src, ignore=_NOT_INSTALLED)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    what = f"{src}[{extras}]" if extras else str(src)
    cp = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-warn-script-location", what],
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if cp.returncode != 0:
        raise RuntimeError(f"pip install into {venv} failed:\n{cp.stdout[-2000:]}")
    return python


def in_clean_venv(script: str, args: Sequence[str]) -> int:
    """Install into a fresh venv (clean_venv), then run `script` again with that venv's python."""
    with tempfile.TemporaryDirectory(prefix="slurm-gpu-bench-venv-") as tmp:
        python = clean_venv(pathlib.Path(tmp))
        version = subprocess.run([str(python), "-c", "import sys; print(sys.version.split()[0])"],
                                 stdout=subprocess.PIPE, text=True).stdout.strip()
        print(f"clean venv {python.parent.parent} (Python {version}), regular install of {ROOT}")
        # Not exec: the temporary directory must outlive the run.
        return subprocess.run([str(python), os.path.abspath(script), *args]).returncode


def args_or_clean_venv(script: str) -> List[str]:
    """A benchmark's arguments; with --venv, the benchmark runs again in a fresh virtual
    environment (in_clean_venv) and this process exits with its status."""
    argv = sys.argv[1:]
    if "--venv" in argv:
        sys.exit(in_clean_venv(script, [a for a in argv if a != "--venv"]))
    return argv


def imported_ms(argv: Sequence[str], env: Dict[str, str], python: str = sys.executable) -> Dict[str, float]:
    """{top-level module: cumulative import ms} of one run under `-X importtime`, counting only
    what a bare `python -c pass` does not import already (site, encodings, ...)."""
    def top_level(cmd: Sequence[str]) -> Dict[str, float]:
        cp = subprocess.run(list(cmd), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        out: Dict[str, float] = {}
        for line in cp.stderr.splitlines():
            if not line.startswith("import time:") or "cumulative" in line:
                continue
            _, cumulative, name = line[len("import time:"):].split("|")
            if name.startswith("  "):  # nested (indented) imports count in their parent's cumulative
                continue
            out[name.strip()] = out.get(name.strip(), 0.0) + int(cumulative) / 1000.0
        return out

    bare = top_level([python, "-X", "importtime", "-c", "pass"])
    run = top_level([python, "-X", "importtime", *argv])
    return {k: v for k, v in run.items() if k not in bare}


def foreign_modules(argv: Sequence[str], env: Dict[str, str], python: str = sys.executable) -> List[str]:
    """Every module one run of `argv` imports that is not ours (slurm_gpu) and that a bare
    `python -c pass` does not import: the standard library and pynvml it cannot do without, in
    import order.  `python -c "import <these>"` is the floor a hook could reach if its own code
    cost nothing."""
    def names(cmd: Sequence[str]) -> List[str]:
        cp = subprocess.run(list(cmd), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        return [line.rsplit("|", 1)[1].strip() for line in cp.stderr.splitlines()
                if line.startswith("import time:") and "cumulative" not in line]

    bare = set(names([python, "-X", "importtime", "-c", "pass"]))
    return [m for m in names([python, "-X", "importtime", *argv])
            if m not in bare and m.split(".")[0] != "slurm_gpu"]


def console_script(name: str) -> List[str]:
    """The installed console script next to this interpreter (what Slurm runs), else -c fallback."""
    path = os.path.join(os.path.dirname(sys.executable), name)
    if os.path.exists(path):
        return [path]
    module, func = {"slurm-gpu": ("slurm_gpu.cli", "main"), "slurm-gpu-prolog": ("slurm_gpu.hooks.main", "prolog_main"),
                    "slurm-gpu-epilog": ("slurm_gpu.hooks.main", "epilog_main")}[name]
    return [sys.executable, "-c", f"from {module} import {func}; {func}()"]


class SimNode:
    def __init__(self, gpus: int = 8):
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="slurm-gpu-bench-"))
        self.lib = simgpu.build()
        self.state = self.dir / "gpus.state"
        simgpu.write_state(self.state, simgpu.h100_sxm(gpus))
        self._pristine = self.state.read_bytes()
        self.config = self.dir / "config.toml"
        self.config.write_text(
            f'nvml_library = "{self.lib}"\n'
            f'[store]\ndatabase = "{self.dir}/usage.db"\nspool_dir = "{self.dir}/spool"\nbusy_timeout_s = 30.0\n'
            f'[log]\nsyslog = false\nfile = "{self.dir}/hooks.log"\n'
            '[xid]\nsource = "none"\n[hooks]\nepilog_deadline_s = 120\n')
        os.chmod(self.config, 0o644)
        # The node's Slurm configuration, as slurmd hands it to the hooks: they read it to map
        # SLURM_JOB_GPUS to devices, so its cost is part of every job start.
        self.slurm_conf = self.dir / "slurm.conf"
        self.slurm_conf.write_text(f"ClusterName=bench\nGresTypes=gpu\n"
                                   f"NodeName=bench[01-64] CPUs=112 RealMemory=2000000 Gres=gpu:h100:{gpus}\n"
                                   "PartitionName=gpu Nodes=bench[01-64] Default=YES\n")
        (self.dir / "gres.conf").write_text(f"NodeName=bench[01-64] Name=gpu Type=h100 File=/dev/nvidia[0-{gpus - 1}]\n")

    def env(self, **extra: str) -> Dict[str, str]:
        env = {"SIMNVML_STATE": str(self.state), "SLURM_GPU_CONFIG": str(self.config), "SLURM_CONF": str(self.slurm_conf)}
        env.update(extra)  # nothing else, like slurmd's minimal environment
        return env

    def reset(self) -> None:
        """The GPUs as they were at the start.  The simulated driver appends every write (a clock
        reset, accounting on) to its state file and parses the whole file on every write and every
        nvmlInit, so without this each hook run would be slower than the one before: a simulator
        artifact, not the driver's behaviour."""
        self.state.write_bytes(self._pristine)
        simgpu.action_log_path(self.state).unlink(missing_ok=True)

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def wall(argv: Sequence[str], env: Dict[str, str]) -> float:
    t0 = time.perf_counter()
    cp = subprocess.run(list(argv), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    took = time.perf_counter() - t0
    if cp.returncode not in (0, 1):
        raise RuntimeError(f"{argv} failed ({cp.returncode}): {cp.stderr.decode()[-500:]}")
    return took


def report(name: str, samples: List[float], base: List[float]) -> float:
    m, b = statistics.median(samples), statistics.median(base)
    print(f"{name:<28} median {m * 1000:7.1f} ms   python3 -c pass {b * 1000:6.1f} ms   ratio {m / b:5.2f}"
          f"   (n={len(samples)}, min {min(samples) * 1000:.1f} ms)")
    return m / b
