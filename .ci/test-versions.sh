#!/usr/bin/env bash
# The Slurm version axis (docs/testbed.md, "Slurm versions"): on each Slurm that is not this
# machine's, the tests that depend on Slurm's or Python's version (all but those marked host_only)
# run against that version's real daemons, inside a cached Debian root filesystem (.ci/rootfs.sh),
# every suite at the same time.
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

# Then every suite's tests at once: each run has its own ports, /tmp, /run and /dev (.ci/rootfs.sh),
# and much of a suite's time is waiting on daemons (a job's sleep, slurmctld's scheduling pass), which
# the other suites fill. One after the other they took 765 + 750 s beside the host's run; at once
# the slowest of them decides.
start=$(date +%s)
pids=()
for suite in "${suites[@]}"; do
    ( s=$(date +%s)
      if bash .ci/rootfs.sh run "$suite" bash .ci/rootfs-tests.sh "$@"; then
          echo "test-versions: $suite: passed in $(( $(date +%s) - s )) s"
      else
          rc=$?
          echo "test-versions: $suite: FAILED (exit $rc) after $(( $(date +%s) - s )) s"
          exit $rc
      fi ) > "/tmp/test-versions-$suite.log" 2>&1 &
    pids+=($!)
done
rc=0
for i in "${!suites[@]}"; do
    wait "${pids[$i]}" || rc=$?
done
for suite in "${suites[@]}"; do
    echo "test-versions: --- $suite ---"
    cat "/tmp/test-versions-$suite.log"
done
echo "test-versions: every suite done in $(( $(date +%s) - start )) s"
exit $rc
