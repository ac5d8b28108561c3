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

# Build (or find) every root filesystem first, at the same time: mostly downloads and dpkg.
start=$(date +%s)
pids=()
for suite in "${suites[@]}"; do
    bash .ci/rootfs.sh build "$suite" > "/tmp/rootfs-build-$suite.log" 2>&1 &
    pids+=($!)
done
for i in "${!suites[@]}"; do
    if ! wait "${pids[$i]}"; then
        echo "test-versions: ${suites[$i]}: building the root filesystem failed:"
        tail -n 40 "/tmp/rootfs-build-${suites[$i]}.log"
        exit 1
    fi
done
echo "test-versions: root filesystems ready in $(( $(date +%s) - start )) s"

rc=0
for suite in "${suites[@]}"; do
    start=$(date +%s)
    echo "test-versions: $suite: tests"
    if bash .ci/rootfs.sh run "$suite" bash .ci/rootfs-tests.sh "$@"; then
        echo "test-versions: $suite: passed in $(( $(date +%s) - start )) s"
    else
        rc=$?
        echo "test-versions: $suite: FAILED (exit $rc) after $(( $(date +%s) - start )) s"
    fi
done
exit $rc
