#!/usr/bin/env bash
# Runs inside a test root filesystem (.ci/rootfs.sh run SUITE ...), in the checkout at /src:
# installs this checkout into the root filesystem's own venv, then runs the unit suite and the
# Slurm-facing integration tests against that Debian's Slurm. Extra arguments go to pytest.
#
# Left to the host run (Debian 12): the HTML report in Chromium (tests/test_report_html.py), the
# alert rules and dashboards against Prometheus (tests/test_monitoring.py) and the central server's
# tests (tests/test_central.py; the MariaDB they start is the host's), and mypy and ruff over the
# source (tests/test_typecheck.py). Nothing of those depends on the Slurm version.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${SLURM_GPU_ROOTFS:-}" ] || { echo "rootfs-tests.sh: run me through .ci/rootfs.sh run SUITE" >&2; exit 2; }

bash .ci/install-deps.sh
py="$SLURM_GPU_VENV/bin/python"
echo "rootfs-tests.sh: $SLURM_GPU_ROOTFS: $(slurmd -V), $("$py" -V), $(mariadbd --version 2>/dev/null | awk '{print $3}')"
exec "$py" -m pytest -q -p no:cacheprovider \
    --ignore=tests/test_report_html.py --ignore=tests/test_monitoring.py --ignore=tests/test_central.py \
    --ignore=tests/test_typecheck.py "$@"
