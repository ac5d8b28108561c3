#!/usr/bin/env bash
# The Slurm version axis (docs/testbed.md, "Slurm versions"): on each Slurm that is not this
# machine's, the unit suite and the Slurm-facing integration tests run against that version's real
# daemons, inside a cached Debian root filesystem (.ci/rootfs.sh).
#
#   .ci/test-versions.sh                 both: trixie (Slurm 24.11) and sid (Slurm 26.05)
#   .ci/test-versions.sh sid             one of them
#   .ci/test-versions.sh trixie -k gres  extra pytest arguments after the suite
set -euo pipefail
cd "$(dirname "$0")/.."

suites=(trixie sid)
if [ $# -gt 0 ] && [[ "$1" != -* ]]; then
    suites=("$1"); shift
fi

rc=0
for suite in "${suites[@]}"; do
    start=$(date +%s)
    echo "test-versions: $suite: root filesystem"
    bash .ci/rootfs.sh build "$suite" >/dev/null
    echo "test-versions: $suite: tests"
    if bash .ci/rootfs.sh run "$suite" bash .ci/rootfs-tests.sh "$@"; then
        echo "test-versions: $suite: passed in $(( $(date +%s) - start )) s"
    else
        rc=$?
        echo "test-versions: $suite: FAILED (exit $rc) after $(( $(date +%s) - start )) s"
    fi
done
exit $rc
