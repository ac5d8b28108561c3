"""The release artifact: `python -m build` makes a wheel and an sdist that `twine check` passes, the
wheel holds every package, the templates and the entry points, and installs into a fresh
virtual environment (dependencies from the package index) where its commands run.

One build per session (~20-40 s: build and twine in a tools venv of their own, the build itself
isolated as in a release job), from a copy of the checkout's files, never in the checkout.
"""
from __future__ import annotations

import configparser
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from checkout import copy_checkout

import slurm_gpu

pytestmark = pytest.mark.host_only  # neither Slurm's version nor Python's: once, on the host (docs/testbed.md)

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
VERSION = slurm_gpu.__version__


def _run(argv, **kw) -> subprocess.CompletedProcess:
    kw.setdefault("timeout", 600)
    r = subprocess.run([str(a) for a in argv], capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{' '.join(map(str, argv))} exited {r.returncode}\n{r.stdout[-4000:]}{r.stderr[-4000:]}"
    return r


def _venv(path: Path) -> Path:
    _run([sys.executable, "-m", "venv", path])
    return path / "bin"


@pytest.fixture(scope="module")
def tools(tmp_path_factory) -> Path:
    """build and twine, in a venv of their own (twine's dependencies would not fit the test env's)."""
    bin_dir = _venv(tmp_path_factory.mktemp("tools") / "venv")
    _run([bin_dir / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check", "build>=1", "twine>=6.1"])
    return bin_dir


@pytest.fixture(scope="module")
def dist(tools, tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("release")
    src = copy_checkout(work / "src")
    out = work / "dist"
    # Run from the work directory: the checkout's build/ folder would shadow the `build` module.
    _run([tools / "python", "-m", "build", "--outdir", out, src], cwd=work)
    return out


def _wheel(dist: Path) -> Path:
    return dist / f"slurm_gpu-{VERSION}-py3-none-any.whl"


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_build_makes_one_wheel_and_one_sdist_of_the_package_version(dist):
    assert sorted(p.name for p in dist.iterdir()) == sorted([_wheel(dist).name, f"slurm_gpu-{VERSION}.tar.gz"])
    # The version is set in one place: pyproject.toml reads it from slurm_gpu/__init__.py.
    project = _pyproject()["project"]
    assert "version" not in project and "version" in project["dynamic"]


def test_twine_check_passes(tools, dist):
    r = _run([tools / "twine", "check", "--strict", *sorted(dist.iterdir())])
    assert r.stdout.count("PASSED") == 2, r.stdout


def test_wheel_holds_every_package_the_templates_and_the_entry_points(dist):
    with zipfile.ZipFile(_wheel(dist)) as z:
        names = set(z.namelist())
        meta = z.read(f"slurm_gpu-{VERSION}.dist-info/METADATA").decode()
        entry_points = z.read(f"slurm_gpu-{VERSION}.dist-info/entry_points.txt").decode()
    # Every package of the source tree: one left out of pyproject's list would import-fail on nodes.
    packages = {str(p.parent.relative_to(REPO)) for p in (REPO / "slurm_gpu").rglob("__init__.py")
                if "__pycache__" not in p.parts}
    assert {p for p in packages if f"{p}/__init__.py" not in names} == set()
    templates = {f"slurm_gpu/templates/{p.name}" for p in (REPO / "templates").iterdir()
                 if p.suffix in (".j2", ".css", ".js")}
    assert templates and templates <= names, templates - names
    assert not [n for n in names if n.startswith(("tests/", "deploy/", "docs/"))]
    assert re.search(rf"^Version: {re.escape(VERSION)}$", meta, re.M)
    assert re.search(r"^Requires-Dist: nvidia-ml-py", meta, re.M) and "Provides-Extra: central" in meta
    scripts = configparser.ConfigParser(interpolation=None)
    scripts.optionxform = str
    scripts.read_string(entry_points)
    assert dict(scripts["console_scripts"]) == _pyproject()["project"]["scripts"]
    assert {"slurm-gpu", "slurm-gpu-prolog", "slurm-gpu-epilog", "slurm-gpu-epilog-ctld",
            "slurm-gpu-healthcheck"} <= set(scripts["console_scripts"])


def test_sdist_carries_what_the_wheel_is_built_from(dist):
    with tarfile.open(dist / f"slurm_gpu-{VERSION}.tar.gz") as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {"pyproject.toml", "README.md", "slurm_gpu/__init__.py", "templates/gres.conf.j2",
            "templates/report.html.j2"} <= names


def test_wheel_installs_into_a_fresh_venv_and_its_commands_run(dist, tmp_path):
    bin_dir = _venv(tmp_path / "venv")  # no system site-packages: dependencies come from the index
    _run([bin_dir / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check", _wheel(dist)])
    for script in _pyproject()["project"]["scripts"]:
        assert os.access(bin_dir / script, os.X_OK), script
    version = _run([bin_dir / "slurm-gpu", "--version"])
    assert version.stdout.strip() == f"slurm-gpu, version {VERSION}"
    where = _run([bin_dir / "python", "-I", "-c", "import slurm_gpu; print(slurm_gpu.__file__)"], cwd=tmp_path)
    assert where.stdout.startswith(str(tmp_path / "venv") + "/"), where.stdout

    # The templates load from the installed package: gres.conf from saved inventories, the same
    # text as the checkout's own code makes.
    inventories = REPO / "tests" / "golden" / "gres" / "inventory"
    args = ["gres-conf", "--inventory", inventories, "--slurm-version", "22.05.8"]
    config = tmp_path / "config.toml"
    config.write_text("[log]\nsyslog = false\n")
    os.chmod(config, 0o644)
    env = dict(os.environ, SLURM_GPU_CONFIG=str(config))
    installed = _run([bin_dir / "slurm-gpu", *args], env=env)
    here = _run([sys.executable, "-m", "slurm_gpu.cli", *args], env=env, cwd=REPO)
    assert installed.stdout == here.stdout and "NodeName=" in installed.stdout

    # The hook entry points start and finish: a job without GPUs is left alone at once.
    fallback = tmp_path / "hooks-error.log"
    hook_env = {"SLURM_GPU_CONFIG": str(config), "SLURM_GPU_FALLBACK_LOG": str(fallback), "SLURM_JOB_ID": "7",
                "SLURM_JOB_UID": str(os.getuid()), "SLURMD_NODENAME": "n1"}
    for hook in ("slurm-gpu-prolog", "slurm-gpu-epilog"):
        r = subprocess.run([str(bin_dir / hook)], env=hook_env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, (hook, r.stdout, r.stderr)
    assert not fallback.exists() or "internal-error" not in fallback.read_text()
