#!/usr/bin/env bash
# Prepare a fresh Debian 12 machine (as root) for the full test suite:
#   - Slurm 22.05 daemons + clients, munge, slurmdbd, MariaDB (the integration testbed),
#   - gcc (tests/simnvml builds a fake libnvidia-ml.so.1), procps (ps/pgrep used by tests),
#   - the project itself with its test extras, in its own virtual environment (.venv),
#   - the unprivileged user `sgtest` that integration-test jobs run as.
# Idempotent and quick when everything is already there. Starts no service:
# tests/testbed.py starts its own throwaway daemons and stops them again.
set -euo pipefail

SGTEST_UID=2501
# chromium: the HTML report is checked in a headless browser (tests/test_report_html.py).
# systemd: `systemd-analyze verify` checks the shipped units (deploy/systemd, tests/test_central.py).
# prometheus (with promtool), prometheus-node-exporter: the alert rules and dashboards are checked
# against a real Prometheus scraping node_exporter's textfile collector (tests/test_monitoring.py).
# debootstrap: the root filesystems of the Slurm version axis (.ci/rootfs.sh).
# ansible-core (2.14), ansible-lint (6.13, has --profile production), python3-venv: the Ansible role
# runs against this machine and is linted (tests/integration/test_ansible_slurm.py); the release
# wheel installs into fresh virtual environments (tests/test_release.py).
# rsyslog: a user's `logger` line written by a real syslog daemon is never an XID (tests/test_xid_syslog.py).
# galera-4, rsync (its state transfer) and iproute2 (`ss`, which the transfer's script asks for its ports): the
# central server as a three-node Galera cluster (tests/test_central_galera.py).
APT_PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server build-essential procps make chromium systemd
              prometheus prometheus-node-exporter ansible-core ansible-lint python3-venv debootstrap faketime rsyslog
              galera-4 rsync iproute2)

cd "$(dirname "$0")/.."

if [ "$(id -u)" -ne 0 ]; then
    echo "install-deps.sh: must run as root (installs Debian packages, creates user sgtest)" >&2
    exit 1
fi

# --- Debian packages ----------------------------------------------------------------------
# Inside a test root filesystem (.ci/rootfs.sh) the Debian packages are that script's own list.
missing=()
[ -n "${SLURM_GPU_ROOTFS:-}" ] && APT_PACKAGES=()
for p in "${APT_PACKAGES[@]}"; do
    # "install ok installed" is the only status that means the package is really there.
    if [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" != "install ok installed" ]; then
        missing+=("$p")
    fi
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "install-deps.sh: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # Package postinst scripts must not start daemons on the CI machine: the testbed
    # starts its own on its own ports. policy-rc.d exit 101 = "action forbidden".
    policy=/usr/sbin/policy-rc.d
    created_policy=0
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' > "$policy"
        chmod 755 "$policy"
        created_policy=1
    fi
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
    if [ "$created_policy" -eq 1 ]; then
        rm -f "$policy"
    fi
else
    echo "install-deps.sh: Debian packages already installed"
fi

# --- Python package with test extras, in a virtual environment of its own ------------------
# Never over Debian's Python packages: on Debian 13 pip cannot replace Debian's python3-click
# (no RECORD file), and a site's system Python is not ours to change. The venv is $SLURM_GPU_VENV
# (inside a test root filesystem, .ci/rootfs.sh sets it) or .venv in this checkout; `make` uses it.
PY=${PYTHON:-python3}
VENV=${SLURM_GPU_VENV:-$PWD/.venv}
if ! "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; then
    if ! "$PY" -c 'import ensurepip, venv' >/dev/null 2>&1; then
        echo "install-deps.sh: installing python3-venv"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv
    fi
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    echo "install-deps.sh: created the virtual environment $VENV ($("$VENV/bin/python" -V))"
fi
# Skip the pip run when this checkout is already installed with the same pyproject.toml
# (-I: the import check must not find the package through the current directory).
stamp="$VENV/.slurm-gpu-install.stamp"
want="$PWD $(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
   && "$VENV/bin/python" -I -c 'import slurm_gpu, pytest, hypothesis, os, sys; sys.exit(0 if os.path.dirname(os.path.dirname(os.path.abspath(slurm_gpu.__file__))) == sys.argv[1] else 1)' "$PWD" 2>/dev/null; then
    echo "install-deps.sh: slurm-gpu already installed from this checkout in $VENV"
else
    "$VENV/bin/python" -m pip install -q --root-user-action=ignore -e '.[test]'
    echo "$want" > "$stamp"
fi

# --- test user --------------------------------------------------------------------------------
if ! getent passwd sgtest >/dev/null; then
    if getent passwd "$SGTEST_UID" >/dev/null; then
        useradd --create-home --shell /bin/bash sgtest   # uid taken: any free uid will do
    else
        useradd --create-home --shell /bin/bash --uid "$SGTEST_UID" sgtest
    fi
    echo "install-deps.sh: created user sgtest (uid $(id -u sgtest))"
fi
# A second job user: `slurm-gpu job` must not show one user's job to another (PrivateData=jobs).
if ! getent passwd sgtest2 >/dev/null; then
    if getent passwd "$((SGTEST_UID + 1))" >/dev/null; then
        useradd --create-home --shell /bin/bash sgtest2
    else
        useradd --create-home --shell /bin/bash --uid "$((SGTEST_UID + 1))" sgtest2
    fi
    echo "install-deps.sh: created user sgtest2 (uid $(id -u sgtest2))"
fi

echo "install-deps.sh: done"
