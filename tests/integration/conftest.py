"""Fixtures for tests against a real Slurm 22.05 cluster (tests/testbed.py).

* Every test under tests/integration is marked ``slurm`` (deselect with ``-m "not slurm"``).
* Where the testbed cannot run (not root, packages or the user sgtest missing) the tests
  skip - except when ``CI`` is set: there a missing testbed is an error, never a skip.
* ``slurm_testbed_factory(**kwargs)`` returns a running cluster configured with ``kwargs``
  (SlurmTestbed's keyword arguments, e.g. prolog=, epilog=, slurm_gpu_config=). One cluster
  runs at a time: asking again with the same arguments returns the same cluster, reset
  (jobs cancelled, nodes resumed); other arguments stop it and start a new one.
* ``slurm_testbed``: the cluster without prolog/epilog, reset for each test.

Work directories live in /tmp/slurm-gpu-testbed-<random>/ (enterable by the job user). They
are removed at the end of a session without failures, kept otherwise (or when
SLURM_TESTBED_KEEP=1) so the daemon logs can be read.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import pytest

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from testbed import Munged, SlurmTestbed, TestbedUnavailable, check_available, unavailable  # noqa: E402

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.slurm)


def _unavailable(reason: str) -> None:
    unavailable(f"Slurm testbed unavailable: {reason}")


def _key(kwargs: Dict[str, Any]) -> str:
    return repr(sorted((k, sorted(v.items()) if isinstance(v, dict) else v) for k, v in kwargs.items()))


class _Factory:
    """Starts clusters on request; keeps at most one running."""

    def __init__(self, base: Path, session: pytest.Session):
        self.base = base
        self.session = session
        self.current: Optional[Tuple[str, SlurmTestbed]] = None
        self.failed: Dict[str, BaseException] = {}
        self.count = 0
        self.keep_dirs = bool(os.environ.get("SLURM_TESTBED_KEEP"))

    def __call__(self, **kwargs: Any) -> SlurmTestbed:
        key = _key(kwargs)
        if key in self.failed:  # do not pay a second start-up timeout for a known-bad config
            raise self.failed[key]
        if self.current is not None:
            cur_key, bed = self.current
            if cur_key == key:
                bed.reset()
                return bed
            self.stop_current(remove=self.session.testsfailed == 0)
        self.count += 1
        workdir = self.base / f"cluster{self.count}"
        bed = SlurmTestbed(workdir, **kwargs)
        try:
            bed.start()
        except TestbedUnavailable as e:
            self.failed[key] = e
            _unavailable(e.reason)
        except Exception as e:
            self.failed[key] = e
            raise
        self.current = (key, bed)
        return bed

    def stop_current(self, remove: bool = True) -> None:
        if self.current is None:
            return
        _, bed = self.current
        self.current = None
        bed.stop()
        if remove and not self.keep_dirs:
            # MariaDB's data directory is ~100 MB per cluster.
            shutil.rmtree(bed.workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_testbed_factory(request: pytest.FixtureRequest) -> Callable[..., SlurmTestbed]:
    try:
        check_available()
    except TestbedUnavailable as e:
        _unavailable(e.reason)
    base = Path(tempfile.mkdtemp(prefix="slurm-gpu-testbed-", dir="/tmp"))
    os.chmod(base, 0o755)
    factory = _Factory(base, request.session)
    yield factory
    failed = request.session.testsfailed > 0
    factory.stop_current(remove=not failed)
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
