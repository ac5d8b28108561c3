"""Fixtures for tests against a real Slurm cluster (tests/testbed.py); docs/testbed.md, "Shared clusters".

* Every test under tests/integration is marked ``slurm`` (deselect with ``-m "not slurm"``).
* Where the testbed cannot run (not root, packages or the user sgtest missing) the tests
  skip - except when ``CI`` is set: there a missing testbed is an error, never a skip.
* ``slurm_testbed_factory(**kwargs)`` returns a running cluster configured with ``kwargs``
  (SlurmTestbed's keyword arguments). Clusters are shared by **shape**: the keyword arguments other
  than the hooks (nodes, GRES, extra slurm.conf lines, ...). A second request for a shape that runs
  gets the same cluster, reset: its hooks switched off and idle, jobs cancelled, nodes resumed; then
  the request's **state** is applied: ``prolog``, ``epilog``, ``health_check_program``,
  ``epilog_slurmctld`` (links that slurm.conf names, pointed at the test's scripts) and
  ``slurm_gpu_config`` (slurm-gpu.toml beside slurm.conf). A hook path with a glob (``prolog.d/*``,
  which slurmd itself expands) is part of the shape. The ``KEEP`` shapes used last keep running.
* ``slurm_testbed``: the two-node cluster without hooks, reset for each test.

Work directories live in /tmp/slurm-gpu-testbed-<random>/ (enterable by the job user). They
are removed at the end of a session without failures, kept otherwise (or when
SLURM_TESTBED_KEEP=1) so the daemon logs can be read.
"""
from __future__ import annotations

import glob
import inspect
import os
import re
import shutil
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from testbed import Munged, SlurmTestbed, TestbedUnavailable, check_available, unavailable  # noqa: E402

from .sites import FACTORIES, Site, hooked_cluster, hooks_off_everywhere, site_fixture  # noqa: E402

HERE = Path(__file__).resolve().parent

# What a test sets on a shared cluster (SlurmTestbed.use_hooks); every other keyword is the shape.
STATE_KEYS = ("prolog", "epilog", "health_check_program", "epilog_slurmctld", "slurm_gpu_config")
# Shapes kept running at once (least recently used stopped first): the two-node cluster most modules
# share stays up between the modules of other shapes, which come one or two in a row (with 2 the
# Ansible and the breaker modules pushed it out: 12 start-ups instead of 10).
KEEP = 3


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.slurm)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    """A failed test's report carries its clusters' state and daemon logs (SlurmTestbed.diagnostics):
    a flake seen once in CI is then read from CI's output, not guessed at."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed or call.when == "teardown":
        return
    beds = {id(v): v for v in getattr(item, "funcargs", {}).values() if isinstance(v, SlurmTestbed)}
    for bed in beds.values():
        try:
            text = bed.diagnostics(lines=30)
        except Exception as e:  # the report must still be written
            text = f"(no diagnostics: {type(e).__name__}: {e})"
        report.sections.append((f"Slurm testbed {bed.workdir.name}", text))


def _unavailable(reason: str) -> None:
    unavailable(f"Slurm testbed unavailable: {reason}")


def _key(kwargs: Dict[str, Any]) -> str:
    return repr(sorted((k, sorted(v.items()) if isinstance(v, dict) else v) for k, v in kwargs.items()))


_DEFAULTS = {k: p.default for k, p in inspect.signature(SlurmTestbed).parameters.items()
             if p.default is not inspect.Parameter.empty}


def split_state(kwargs: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(shape, state) of a request's keyword arguments; a shape argument given at its default is
    no argument (prolog_epilog_timeout=60 is the same cluster as none)."""
    shape = {k: v for k, v in kwargs.items() if k in STATE_KEYS or k not in _DEFAULTS or v != _DEFAULTS[k]}
    state = {}
    for k in STATE_KEYS:
        if k in shape and not (k != "slurm_gpu_config" and shape[k] and glob.has_magic(shape[k])):
            state[k] = shape.pop(k)
    return shape, state


class _Factory:
    """Starts clusters on request, one per shape; keeps the last KEEP shapes running."""

    def __init__(self, base: Path, session: pytest.Session):
        self.base = base
        self.session = session
        self.running: List[Tuple[str, SlurmTestbed]] = []  # least recently used first
        self.failed: Dict[str, BaseException] = {}
        self.count = 0
        self.keep_dirs = bool(os.environ.get("SLURM_TESTBED_KEEP"))

    def __call__(self, **kwargs: Any) -> SlurmTestbed:
        shape, state = split_state(kwargs)
        key = _key(shape)
        if key in self.failed:  # do not pay a second start-up timeout for a known-bad config
            raise self.failed[key]
        bed = self._running(key)
        if bed is not None:
            bed.use_hooks()           # the last test's hooks off ...
            bed.wait_hooks_idle()     # ... and none of their runs left (a health check about to drain)
            bed.reset()
        else:
            while len(self.running) >= KEEP:
                self._stop(self.running.pop(0)[1])
            bed = self._start(key, shape)
        bed.use_hooks(**state)
        return bed

    def _running(self, key: str) -> Any:
        for i, (k, bed) in enumerate(self.running):
            if k == key:
                self.running.append(self.running.pop(i))
                return bed
        return None

    def _start(self, key: str, shape: Dict[str, Any]) -> SlurmTestbed:
        self.count += 1
        bed = SlurmTestbed(self.base / f"cluster{self.count}", switchable_hooks=True, **shape)
        try:
            bed.start()
        except TestbedUnavailable as e:
            self.failed[key] = e
            _unavailable(e.reason)
        except Exception as e:
            self.failed[key] = e
            raise
        self.running.append((key, bed))
        return bed

    def _stop(self, bed: SlurmTestbed) -> None:
        bed.stop()
        if self.session.testsfailed == 0 and not self.keep_dirs:
            # MariaDB's data directory is ~100 MB per cluster.
            shutil.rmtree(bed.workdir, ignore_errors=True)

    def stop_all(self) -> None:
        while self.running:
            self._stop(self.running.pop()[1])

    def hooks_off(self) -> None:
        """Every running cluster's hooks off, and idle: a module's health check must not go on
        running (and draining) on an idle cluster after its module, nor its scripts outlive their
        files."""
        for _, bed in self.running:
            bed.use_hooks()
            bed.wait_hooks_idle()


@pytest.fixture(scope="module", autouse=True)
def _shared_cluster_hooks_off_after_each_module():
    yield
    hooks_off_everywhere()


@pytest.fixture(scope="session")
def slurm_testbed_factory(request: pytest.FixtureRequest) -> Callable[..., SlurmTestbed]:
    try:
        check_available()
    except TestbedUnavailable as e:
        _unavailable(e.reason)
    base = Path(tempfile.mkdtemp(prefix="slurm-gpu-testbed-", dir="/tmp"))
    os.chmod(base, 0o755)
    factory = _Factory(base, request.session)
    FACTORIES.append(factory)
    yield factory
    FACTORIES.remove(factory)
    failed = request.session.testsfailed > 0
    factory.stop_all()
    if failed or factory.keep_dirs:
        print(f"\nSlurm testbed work directories kept in {base}")
    else:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def slurm_testbed(slurm_testbed_factory: Callable[..., SlurmTestbed]) -> SlurmTestbed:
    """A clean two-node cluster (gpu01, gpu02; 4 h100 each) without prolog or epilog."""
    return slurm_testbed_factory()


@pytest.fixture
def cfg_file(tmp_path: Path) -> Path:
    """A slurm-gpu config for admin commands run against the testbed (CLI backend, files in tmp_path)."""
    p = tmp_path / "slurm-gpu.toml"
    p.write_text('slurm_backend = "cli"\nslurm_timeout_s = 5.0\n[log]\nsyslog = false\nfile = "%s"\n'
                 '[store]\ndatabase = "%s"\nspool_dir = "%s"\n'
                 % (tmp_path / "admin.log", tmp_path / "usage.db", tmp_path / "spool"))
    return p


@pytest.fixture(scope="session")
def slurmd_munge():
    """A munged of the session's own for lone `slurmd -G` runs (testbed.run_slurmd_G): from
    Slurm 24.11 on, slurmd -G creates a credential at start and fails without munge."""
    try:
        m = Munged().start()
    except TestbedUnavailable as e:
        _unavailable(e.reason)
    yield m
    m.stop()


# --------------------------------------------------------------------------- the hooks' shared site

site = site_fixture(Site, "hooks")


@pytest.fixture
def cluster(site: Site, slurm_testbed_factory: Callable[..., SlurmTestbed]) -> SlurmTestbed:
    """The two-node cluster with slurm-gpu's prolog and epilog on the module's `site`."""
    return hooked_cluster(site, slurm_testbed_factory)


NVIDIA_MAJOR = 195
CAPS_MAJOR = 511  # any char major works: slurmd only stat()s the files


@pytest.fixture
def device_files():
    """mknod the device files a test names; remove exactly those it created."""
    created: List[str] = []

    def make(paths):
        for p in paths:
            if os.path.exists(p):
                continue
            os.makedirs(os.path.dirname(p), exist_ok=True)
            m = re.search(r"(\d+)$", p)
            major = CAPS_MAJOR if "nvidia-caps" in p else NVIDIA_MAJOR
            try:
                os.mknod(p, 0o666 | stat.S_IFCHR, os.makedev(major, int(m.group(1))))
            except OSError as e:
                unavailable(f"cannot create {p}: {e.strerror} (needs mknod)")
            created.append(p)

    yield make
    for p in reversed(created):
        try:
            os.unlink(p)
        except OSError:
            pass
