#!/usr/bin/env bash
# Profile dm-dedup's write path in the guest: tests/bench/profile.sh on fresh
# data and metadata disks like those of `make bench`.
#
# usage: scripts/bench-profile.sh [WORKLOAD...]   (default: seq0 seq100 rand50)
# Output: the fio figures, the target's counters and perf's top symbols per
# workload on stdout; perf data in tests/out/bench-profile/.
# Environment: PROFILE_BYTES (256M), BENCH_CACHE, SKIP_BUILD=1, and
# PROFILE_MODULES="LABEL=KO ..." to profile several builds of the module in
# one boot (default: this tree's), PROFILE_REPS=N to time N runs of each
# workload without perf first, PROFILE_PERF=0 to time only, PROFILE_SYNC=1
# to attach the two disks with cache=none (a guest flush is an fdatasync
# of the disk's file on the host, as on the bench's datasync/metasync),
# PROFILE_PERCENT=P to list every symbol above P % of the samples (1.5).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
exec </dev/null
CACHE=${BENCH_CACHE:-/var/cache/dm-dedup-bench}
OUT=$REPO/tests/out/bench-profile
[ $# -gt 0 ] || set -- seq0 seq100 rand50
if ! command -v perf >/dev/null; then
	echo "bench-profile: installing linux-perf" >&2
	DEBIAN_FRONTEND=noninteractive apt-get -y -q -o APT::Install-Recommends=false \
		install linux-perf >/tmp/bench-profile-apt.log 2>&1 ||
		{ tail -n 20 /tmp/bench-profile-apt.log >&2; echo "bench-profile: apt-get install linux-perf failed" >&2; exit 1; }
fi

KVER=$("$REPO/scripts/guest-run.sh" --print-kver)
[ "${SKIP_BUILD:-0}" = 1 ] || make -s -C "$REPO" KDIR="/usr/src/linux-headers-$KVER" >/dev/null
mkdir -p "$CACHE/disks" "$OUT"
rm -f "$CACHE/disks/prof-data.img" "$CACHE/disks/prof-meta.img"
truncate -s 12G "$CACHE/disks/prof-data.img"
truncate -s 1G "$CACHE/disks/prof-meta.img"
q() { printf '%q' "$1"; }
CMD="export DEDUP_KO=$(q "$REPO/dm-dedup/dm-dedup.ko") PROFILE_OUT=$(q "$OUT")
export PROFILE_BYTES=$(q "${PROFILE_BYTES:-256M}") PROFILE_MODULES=$(q "${PROFILE_MODULES:-}")
export PROFILE_REPS=$(q "${PROFILE_REPS:-0}") PROFILE_PERF=$(q "${PROFILE_PERF:-1}")
export PROFILE_PERCENT=$(q "${PROFILE_PERCENT:-1.5}")
bash $(q "$REPO/tests/bench/profile.sh") $*"
DRIVE=--drive
[ "${PROFILE_SYNC:-0}" != 1 ] || DRIVE=--sync-drive
rc=0
GUEST_TIMEOUT=${GUEST_TIMEOUT:-3600} "$REPO/scripts/guest-run.sh" --no-debug --memory 6G --rwdir "$OUT" \
    "$DRIVE" data="$CACHE/disks/prof-data.img" "$DRIVE" meta="$CACHE/disks/prof-meta.img" \
    -- "$CMD" || rc=$?
rm -f "$CACHE/disks/prof-data.img" "$CACHE/disks/prof-meta.img"
exit "$rc"
