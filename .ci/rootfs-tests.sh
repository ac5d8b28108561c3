#!/usr/bin/env bash
# Runs inside a test root filesystem (.ci/rootfs.sh run SUITE ...), in the checkout at /src:
# installs this checkout into the root filesystem's own venv, then runs what depends on Slurm's or
# Python's version against that Debian's Slurm and Python: every test but those marked host_only
# (docs/testbed.md, "Markers": the release artifact, the HTML report in Chromium, the alert rules
# against Prometheus, mypy, ruff and the import contracts, which run once, on the host); a module
# marked once_on(SUITE) runs in SUITE's root filesystem only (tests/conftest.py). Extra arguments go
# to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${SLURM_GPU_ROOTFS:-}" ] || { echo "rootfs-tests.sh: run me through .ci/rootfs.sh run SUITE" >&2; exit 2; }

bash .ci/install-deps.sh
py="$SLURM_GPU_VENV/bin/python"
echo "rootfs-tests.sh: $SLURM_GPU_ROOTFS: $(slurmd -V), $("$py" -V), $(mariadbd --version 2>/dev/null | awk '{print $3}')"
exec "$py" -m pytest -q -p no:cacheprovider -m "not host_only" "$@"
