#!/usr/bin/env bash
# Runs a command (by default the whole suite, ./scripts/test.sh) on a machine half as fast as
# this one: in a CPU cgroup capped at one core's worth of time, shared by every process the
# command starts (test hosts' processes too: a network namespace keeps its cgroup). Timing
# faults show there -- a log line that races, a deadline with no margin -- that a fast machine
# hides. Needs root and the cgroup v1 cpu controller or cgroup v2; elsewhere it pins the
# command to one core with taskset (the same budget of CPU, with less of the cgroup's jitter).
#
#   ./scripts/throttled.sh                         # the whole suite, throttled
#   ./scripts/throttled.sh ./scripts/test.sh -m hosts
#   PSFRAME_CPU_SHARE=0.5 ./scripts/throttled.sh   # half a core's worth
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SHARE="${PSFRAME_CPU_SHARE:-1}"  # cores' worth of CPU time
[ "$#" -gt 0 ] || set -- "$ROOT/scripts/test.sh"
PERIOD_US=100000
QUOTA_US="$(python3 -c "print(int($SHARE * $PERIOD_US))")"
NAME="psframe-throttled-$$"

if [ -w /sys/fs/cgroup/cpu ] && [ -f /sys/fs/cgroup/cpu/cpu.cfs_quota_us ]; then  # cgroup v1
    GROUP="/sys/fs/cgroup/cpu/$NAME"
    mkdir "$GROUP"
    echo "$PERIOD_US" > "$GROUP/cpu.cfs_period_us"
    echo "$QUOTA_US" > "$GROUP/cpu.cfs_quota_us"
    # The cap is the only limit: a high weight keeps other work on the machine from taking the
    # group below its quota (each busy process outside would otherwise weigh as much as it).
    echo 16384 > "$GROUP/cpu.shares"
elif [ -w /sys/fs/cgroup/cgroup.subtree_control ] && grep -qw cpu /sys/fs/cgroup/cgroup.controllers; then  # v2
    GROUP="/sys/fs/cgroup/$NAME"
    mkdir "$GROUP"
    echo "$QUOTA_US $PERIOD_US" > "$GROUP/cpu.max"
    echo 10000 > "$GROUP/cpu.weight"  # the cap is the only limit (see above)
else
    echo "[throttled] no writable CPU cgroup here: pinning to core 0 with taskset" >&2
    exec taskset -c 0 "$@"
fi
echo "[throttled] $SHARE core(s)' worth of CPU ($QUOTA_US us every $PERIOD_US us), cgroup $GROUP" >&2

# The command runs in a child shell moved into the group before it execs; this shell stays
# outside and removes the group once the command and everything it left have ended. In the
# foreground: a shell without job control starts a background command with SIGINT ignored,
# which the suite's Ctrl-C tests would inherit.
set +e
bash -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' throttled "$GROUP" "$@"
code=$?
set -e
started=$SECONDS
while [ -s "$GROUP/cgroup.procs" ] && [ $((SECONDS - started)) -lt 30 ]; do
    sleep 1  # processes the command left behind end (or are waited for) before the group goes
done
rmdir "$GROUP" 2>/dev/null || echo "[throttled] $GROUP still holds processes: $(tr '\n' ' ' < "$GROUP/cgroup.procs")" >&2
exit "$code"
