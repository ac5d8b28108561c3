#!/usr/bin/env bash
# Build (once) and enter a Debian root filesystem with another Slurm version, for the testbed's
# version axis (docs/testbed.md, "Slurm versions"):
#
#   .ci/rootfs.sh build SUITE          -> prints the root filesystem's path (cached)
#   .ci/rootfs.sh path SUITE           -> prints where it is or would be, builds nothing
#   .ci/rootfs.sh run SUITE CMD [ARG..] -> runs CMD inside it, this checkout at /src
#
# SUITE: trixie (Debian 13, Slurm 24.11) or sid (Debian unstable, Slurm 26.05).
# The root filesystem is cached under $ROOTFS_CACHE (default /var/cache/slurm-gpu/rootfs) and
# keyed by the suite, the package list and this script's own text: a machine builds each once
# (about 4 minutes), later runs find it. `run` bind-mounts /proc, /sys, /dev, /dev/pts and the
# checkout in a mount namespace of its own, so they vanish however CMD ends. Processes inside share this machine's
# network and pid space: the testbed picks free ports and stops its daemons by pid as on the host.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
cache=${ROOTFS_CACHE:-/var/cache/slurm-gpu/rootfs}

# What the tests need inside, as on the host (.ci/install-deps.sh): Slurm with accounting, MariaDB,
# munge, a C compiler for the simulated driver, Python with venv, the Ansible role's tools.
PACKAGES=(slurmctld slurmd slurm-client slurmdbd munge mariadb-server mariadb-client
          build-essential procps make python3 python3-venv python3-dev ca-certificates git
          ansible-core ansible-lint systemd util-linux iproute2 less faketime)
# Slurm's NVML GPU plugin (gpu_nvml.so) is Debian contrib's slurm-wlm-nvml-plugin (source package
# slurm-wlm-contrib): with it, real slurmd AutoDetect=nvml runs against the simulated
# libnvidia-ml.so.1 (tests/simnvml). prometheus and node_exporter: the metrics testbed test.
PACKAGES+=(slurm-wlm-nvml-plugin prometheus prometheus-node-exporter)
# galera-4 and rsync (its state transfer): the central server as a three-node Galera cluster
# (tests/test_central_galera.py, once_on("sid"): that suite's run has CI's most time to spare).
PACKAGES+=(galera-4 rsync)

die() { echo "rootfs.sh: $*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || die "must run as root (debootstrap, chroot, mounts)"

# The Debian mirror this machine's apt already uses (never a host name written here).
mirror() {
    local uri=""
    if [ -f /etc/apt/sources.list.d/debian.sources ]; then
        uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
    fi
    if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
        uri=$(awk '$1 == "deb" && $0 !~ /security/ {for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) {print $i; exit}}' /etc/apt/sources.list)
    fi
    [ -n "$uri" ] || die "cannot find this machine's Debian mirror in /etc/apt/sources.list{,.d/debian.sources}"
    echo "${uri%/}"
}

key() {
    local suite=$1
    # What decides the contents: the suite, the packages and the functions that build it (not
    # this whole file: editing `run` must not rebuild the cache).
    { echo "$suite"; printf '%s\n' "${PACKAGES[@]}"; declare -f build copy_host_config; } | sha256sum | cut -c1-12
}

mount_all() {
    local root=$1
    mountpoint -q "$root/proc" || mount -t proc proc "$root/proc"
    for d in sys dev dev/pts; do
        mkdir -p "$root/$d"
        mountpoint -q "$root/$d" || mount --bind "/$d" "$root/$d"
    done
}

umount_all() {
    local root=$1 d
    for d in src dev/pts dev sys proc; do
        if mountpoint -q "$root/$d" 2>/dev/null; then umount -l "$root/$d" || true; fi
    done
}

# Remove a root filesystem, never through a mount that is still there (a bind-mounted /dev or
# checkout would be deleted with it).
safe_rm() {
    local dir=$1
    [ -e "$dir" ] || return 0
    umount_all "$dir"
    if awk -v d="$(realpath "$dir")/" 'index($2 "/", d) == 1 {found = 1} END {exit !found}' /proc/mounts; then
        die "$dir still has mounts below it; not removing it"
    fi
    rm -rf --one-file-system "$dir"
}

# Files from this machine that make pip and apt inside behave as here: the trust store (the
# package registries sit behind it), pip's configuration and its constraints, DNS.
copy_host_config() {
    local root=$1 f
    mkdir -p "$root/etc/ssl/certs"
    cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
    cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
    for f in /etc/pip.conf /etc/xdg/pip; do
        if [ -e "$f" ]; then
            mkdir -p "$root$(dirname "$f")"
            cp -a "$f" "$root$(dirname "$f")/"
        fi
    done
}

build() {
    local suite=$1 root m
    root="$cache/$suite-$(key "$suite")"
    if [ -f "$root/.slurm-gpu-rootfs-ready" ]; then
        echo "$root"
        return
    fi
    command -v debootstrap >/dev/null || die "debootstrap is missing (apt-get install debootstrap)"
    m=$(mirror)
    mkdir -p "$cache"
    tmp="$cache/.building-$suite-$$"
    safe_rm "$tmp"
    trap 'safe_rm "$tmp"' EXIT   # $tmp is global: the trap runs after this function returns
    echo "rootfs.sh: building $suite in $tmp (debootstrap, then ${#PACKAGES[@]} packages)" >&2
    debootstrap --variant=minbase --components=main,contrib "$suite" "$tmp" "$m" >&2
    # sid's Release file is past its Valid-Until date on these machines.
    echo 'Acquire::Check-Valid-Until "false";' > "$tmp/etc/apt/apt.conf.d/99slurm-gpu-valid-until"
    printf '#!/bin/sh\nexit 101\n' > "$tmp/usr/sbin/policy-rc.d"   # no daemon starts at install
    chmod 755 "$tmp/usr/sbin/policy-rc.d"
    copy_host_config "$tmp"
    mount_all "$tmp"
    chroot "$tmp" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
        sh -c "apt-get update -qq && apt-get install -y -qq --no-install-recommends ${PACKAGES[*]}" >&2
    copy_host_config "$tmp"   # ca-certificates' postinst rewrote the bundle: ours again
    umount_all "$tmp"
    touch "$tmp/.slurm-gpu-rootfs-ready"
    safe_rm "$root"
    mv "$tmp" "$root"
    trap - EXIT
    # Older builds of the same suite are of no further use.
    local old
    for old in "$cache/$suite"-*; do
        [ "$old" = "$root" ] || [ ! -d "$old" ] || safe_rm "$old" || true
    done
    echo "$root"
}

# Testbed ports of each suite's own (tests/testbed.py): the host's suite and the root filesystems'
# share one network and may run at the same time.
ports() {
    case "$1" in
        trixie) echo 17000-17199 ;;
        sid) echo 17200-17399 ;;
        *) echo 17400-17599 ;;
    esac
}

run() {
    local suite=$1; shift
    local root
    root=$(build "$suite")
    copy_host_config "$root"
    mkdir -p "$root/src"
    # A private mount namespace: the mounts exist only for this run and vanish with it, so two
    # runs of one root filesystem at once do not unmount each other's /proc. /dev is a tmpfs of
    # its own with the usual nodes: the tests mknod /dev/nvidiaN and remove what they made, which
    # must not touch this machine's /dev while its own suite runs beside.
    unshare --mount --propagation private /usr/bin/env ROOT="$root" SRC="$here" sh -c '
        set -e
        mount -t proc proc "$ROOT/proc"
        mount --rbind /sys "$ROOT/sys"
        mount -t tmpfs -o mode=755,nosuid dev "$ROOT/dev"
        for n in null:1:3 zero:1:5 full:1:7 random:1:8 urandom:1:9 tty:5:0; do
            IFS=: read -r name major minor <<EOF2
$n
EOF2
            mknod -m 666 "$ROOT/dev/$name" c "$major" "$minor"
        done
        mkdir -p "$ROOT/dev/pts" "$ROOT/dev/shm"
        mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts "$ROOT/dev/pts"
        ln -s pts/ptmx "$ROOT/dev/ptmx"
        mount -t tmpfs -o mode=1777,nosuid,nodev shm "$ROOT/dev/shm"
        ln -s /proc/self/fd "$ROOT/dev/fd"
        ln -s /proc/self/fd/0 "$ROOT/dev/stdin"; ln -s /proc/self/fd/1 "$ROOT/dev/stdout"; ln -s /proc/self/fd/2 "$ROOT/dev/stderr"
        # /tmp and /run of this run alone: test work directories, sockets and the testbed registry
        # neither pile up in the cached root filesystem nor meet another run'"'"'s.
        mount -t tmpfs -o mode=1777,nosuid,nodev tmp "$ROOT/tmp"
        mount -t tmpfs -o mode=755,nosuid,nodev run "$ROOT/run"
        mount --bind "$SRC" "$ROOT/src"
        shift
        exec chroot "$ROOT" "$@"' sh - \
        /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        HOME=/root LANG=C.UTF-8 TERM="${TERM:-dumb}" CI="${CI:-}" SLURM_GPU_ROOTFS="$suite" \
        SLURM_GPU_VENV=/opt/slurm-gpu-venv SLURM_TESTBED_PORTS="$(ports "$suite")" \
        sh -c 'cd /src && exec "$@"' sh "$@"
}

case "${1:-}" in
    build) [ $# -eq 2 ] || die "usage: rootfs.sh build SUITE"; build "$2" ;;
    path) [ $# -eq 2 ] || die "usage: rootfs.sh path SUITE"; echo "$cache/$2-$(key "$2")" ;;
    run) [ $# -ge 3 ] || die "usage: rootfs.sh run SUITE CMD [ARG...]"; suite=$2; shift 2; run "$suite" "$@" ;;
    *) die "usage: rootfs.sh build SUITE | path SUITE | run SUITE CMD [ARG...]" ;;
esac
