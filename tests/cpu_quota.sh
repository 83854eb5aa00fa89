#!/usr/bin/env bash
# Run a command inside a CPU quota, to emulate a machine SLOWDOWN times slower than this one
# (`make test-slow`: the whole suite at 2.5x). The quota is cores / SLOWDOWN CPUs in all: on 2 cores and
# 2.5x, 0.8 of one CPU shared by every process of the command, so that a process alone runs 1.25x slower
# and two at once 2.5x slower each (the suite measures the latter: tests/slowdown.py).
#
#   tests/cpu_quota.sh 2.5 make test
#
# Needs root (writing a cgroup) and the cpu controller: cgroup v2 (/sys/fs/cgroup/cgroup.controllers
# lists `cpu`; this script enables it for its child group) or cgroup v1 (/sys/fs/cgroup/cpu mounted). The
# group is made for this run (fleetrl-slow-<pid>) and removed after it; its exit code is the command's.
set -euo pipefail

usage() { echo "usage: $0 SLOWDOWN COMMAND [ARG...]   (e.g. $0 2.5 make test)" >&2; exit 2; }
[ $# -ge 2 ] || usage
slowdown=$1; shift
awk -v s="$slowdown" 'BEGIN { exit !(s + 0 >= 1) }' || { echo "$0: SLOWDOWN must be a number >= 1, got '$slowdown'" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "$0: needs root to create a cgroup (run as root, or use FLEETRL_TEST_SLOWDOWN=$slowdown make test to scale the deadlines only)" >&2; exit 2; }

cores=$(nproc)
period=100000
quota=$(awk -v c="$cores" -v s="$slowdown" -v p="$period" 'BEGIN { printf "%d", c * p / s }')
name="fleetrl-slow-$$"

if [ -f /sys/fs/cgroup/cgroup.controllers ]; then  # cgroup v2
    grep -qw cpu /sys/fs/cgroup/cgroup.controllers || { echo "$0: cgroup v2 without the cpu controller" >&2; exit 2; }
    echo +cpu > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || true
    group=/sys/fs/cgroup/$name
    mkdir "$group"
    echo "$quota $period" > "$group/cpu.max"
elif [ -d /sys/fs/cgroup/cpu ]; then  # cgroup v1
    group=/sys/fs/cgroup/cpu/$name
    mkdir "$group"
    echo "$period" > "$group/cpu.cfs_period_us"
    echo "$quota" > "$group/cpu.cfs_quota_us"
else
    echo "$0: no cgroup cpu controller mounted (looked for /sys/fs/cgroup/cgroup.controllers and /sys/fs/cgroup/cpu)" >&2
    exit 2
fi

cleanup() {
    # Whatever the command left in the group goes back to the root group, then the group goes.
    if [ -f "$group/cgroup.procs" ]; then
        root=$(dirname "$group")
        while read -r pid; do echo "$pid" > "$root/cgroup.procs" 2>/dev/null || true; done < "$group/cgroup.procs"
    fi
    rmdir "$group" 2>/dev/null || echo "$0: could not remove $group" >&2
}
trap cleanup EXIT

echo "cpu quota: $quota/$period us on $cores core(s) = $(awk -v q="$quota" -v p="$period" 'BEGIN { printf "%.2f", q / p }') CPU, a ${slowdown}x slower machine ($group)"
set +e
bash -c 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"' quota "$group" "$@"
rc=$?
set -e
exit $rc
