#!/usr/bin/env bash
# `make bench`: raw device, dm-thin, dm-vdo and dm-dedup side by side, on the
# same disks and data, in one guest boot.  Not part of `make test`.
#
#   1. installs what it needs (scripts/install-deps.sh, plus vdo from
#      bookworm-backports, debootstrap, python3-matplotlib, linux-perf);
#   2. builds the module and the release `dedup` tool;
#   3. builds the VM image pool once (scripts/bench-images.sh, cached);
#   4. boots the guest once with five disks (data 12 GiB, meta 1 GiB, the
#      pool, and datasync 12 GiB and metasync 1 GiB, attached with
#      cache=none so that guest flushes reach the host's disk) and 10 GiB of
#      RAM (the pool fits in its page cache), and runs tests/bench/bench.py
#      (25 to 40 minutes under TCG, plus the cache=none runs, whose time
#      depends on how fast the host's disk flushes);
#   5. in the same boot, profiles dm-dedup's write path (tests/bench/profile.sh:
#      CPU samples, the block copy next to the hash, lock contention);
#   6. writes the table, JSON and charts (tests/bench/report.py) and the
#      profile (profile.txt).
#
# Results: Documentation/benchmarks/ (results.json, results.rst, *.png), which
# Documentation/benchmarks.rst includes.  A quick smoke run (BENCH_QUICK=1:
# small sizes, one repetition, two images) writes to tests/out/bench/ instead.
#
# Environment: BENCH_REPS (3), BENCH_ROUNDS (2: the write series' runs are
# split over two fresh devices per stack, the stacks taking turns; 1 with
# BENCH_QUICK), BENCH_QUICK, BENCH_STACKS ("raw thin vdo dedup fast
# fastack"; "fast" is the tree's module with "hash xxhash64 verify",
# "fastack" the same with early_ack, in the write series and the VM-pool
# copy only),
# BENCH_WORKLOADS ("seqwrite randwrite randread fsync fsync_sync discard
# activation pool pool_sync"; the _sync ones repeat fsync and pool on the
# cache=none disks), BENCH_CACHE (/var/cache/dm-dedup-bench; its file
# system must allow O_DIRECT), BENCH_OUT (result directory), BENCH_BEFORE (a
# commit whose module runs as one more stack, "before"), BENCH_DATA_GIB (12),
# BENCH_SYNC_DATA_GIB (the datasync disk, default BENCH_DATA_GIB),
# BENCH_DEDUP_OPTS (table options of the "dedup" stack, e.g. early_ack;
# the stack "ack" is the tree's module with early_ack beside it;
# "before" always runs with none),
# BENCH_PROFILE (workloads for profile.sh, default
# "seq0 seq100 rand50"; "none" skips it), SKIP_DEPS=1, SKIP_BUILD=1,
# GUEST_TIMEOUT (7200).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
exec </dev/null
say() { printf 'bench: %s\n' "$*"; }
die() { printf 'bench: ERROR: %s\n' "$*" >&2; exit 1; }

CACHE=${BENCH_CACHE:-/var/cache/dm-dedup-bench}
QUICK=${BENCH_QUICK:-0}
if [ "$QUICK" = 1 ]; then
    OUT=${BENCH_OUT:-$REPO/tests/out/bench}
    REPS=${BENCH_REPS:-1}
    ROUNDS=${BENCH_ROUNDS:-1}
else
    OUT=${BENCH_OUT:-$REPO/Documentation/benchmarks}
    REPS=${BENCH_REPS:-3}
    ROUNDS=${BENCH_ROUNDS:-2}
fi
DATA_GIB=${BENCH_DATA_GIB:-12}
SYNC_DATA_GIB=${BENCH_SYNC_DATA_GIB:-$DATA_GIB}
PROFILE=${BENCH_PROFILE:-seq0 seq100 rand50}
PROFILE_BYTES=256M
[ "$QUICK" = 1 ] && PROFILE_BYTES=32M

if [ "${SKIP_DEPS:-0}" != 1 ]; then
    say "installing dependencies"
    "$REPO/scripts/install-deps.sh"
    export DEBIAN_FRONTEND=noninteractive
    need=()
    command -v debootstrap >/dev/null || need+=(debootstrap)
    command -v perf >/dev/null || need+=(linux-perf)
    /usr/bin/python3 -c 'import matplotlib' 2>/dev/null || need+=(python3-matplotlib)
    apt_get() {
        apt-get -y -q -o APT::Install-Recommends=false install "$@" >>/tmp/bench-apt.log 2>&1 ||
            { tail -n 30 /tmp/bench-apt.log >&2; die "apt-get install $* failed"; }
    }
    if [ "${#need[@]}" != 0 ] || ! command -v vdoformat >/dev/null; then
        apt-get -q update >/tmp/bench-apt.log 2>&1 || { cat /tmp/bench-apt.log >&2; die "apt-get update failed"; }
    fi
    if [ "${#need[@]}" != 0 ]; then
        say "installing ${need[*]}"
        apt_get "${need[@]}"
    fi
    # The vdo tools exist only in bookworm-backports (install-deps.sh added
    # that apt entry).
    if ! command -v vdoformat >/dev/null; then
        say "installing vdo from bookworm-backports"
        apt_get -t bookworm-backports vdo
    fi
fi
for c in vdoformat vdostats debootstrap fio; do
    command -v "$c" >/dev/null || die "$c missing (run without SKIP_DEPS=1)"
done

KVER=$("$REPO/scripts/guest-run.sh" --print-kver)
if [ "${SKIP_BUILD:-0}" != 1 ]; then
    say "building the module and the release dedup tool"
    make -s -C "$REPO" KDIR="/usr/src/linux-headers-$KVER" >/dev/null
    (cd "$REPO/tools" && cargo build -q --locked --release)
fi
[ -f "$REPO/dm-dedup/dm-dedup.ko" ] || die "no dm-dedup/dm-dedup.ko"

# BENCH_BEFORE=<commit>: the module of that commit runs as one more stack,
# "before", for before-and-after figures from one boot. Built in a
# worktree under tests/out, where the guest can see it.
STACKS=${BENCH_STACKS:-raw thin vdo dedup fast fastack}
BEFORE_KO=
if [ -n "${BENCH_BEFORE:-}" ]; then
    wt=$REPO/tests/out/bench-before
    before=$(git -C "$REPO" rev-parse --short "$BENCH_BEFORE") || die "no commit $BENCH_BEFORE"
    say "building the module of $before (the \"before\" stack)"
    rm -rf "$wt"
    git -C "$REPO" worktree prune
    git -C "$REPO" worktree add -f --detach "$wt" "$before" >/dev/null
    make -s -C "$wt" KDIR="/usr/src/linux-headers-$KVER" module >/dev/null
    BEFORE_KO=$wt/dm-dedup/dm-dedup.ko
    [ -z "${BENCH_STACKS:-}" ] && STACKS="raw thin vdo before dedup fast fastack"
fi
[ -x "$REPO/tools/target/release/dedup" ] || die "no tools/target/release/dedup"

BENCH_CACHE=$CACHE "$REPO/scripts/bench-images.sh"

# Fresh sparse backing files every run; the guest discards them between
# stacks as well.  datasync and metasync are attached with cache=none.
mkdir -p "$CACHE/disks" "$OUT"
DISKS=("$CACHE/disks/data.img" "$CACHE/disks/meta.img"
       "$CACHE/disks/datasync.img" "$CACHE/disks/metasync.img")
rm -f "${DISKS[@]}"
truncate -s "${DATA_GIB}G" "$CACHE/disks/data.img"
truncate -s 1G "$CACHE/disks/meta.img"
truncate -s "${SYNC_DATA_GIB}G" "$CACHE/disks/datasync.img"
truncate -s 1G "$CACHE/disks/metasync.img"

# The guest writes results.json into a scratch directory first, so that a
# failed run never replaces the published results.
SCRATCH=$REPO/tests/out/bench-run
rm -rf "$SCRATCH" && mkdir -p "$SCRATCH"

host_cpu=$(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -n 1)
qemu_ver=$(qemu-system-x86_64 --version | head -n 1)
host_disk=$(findmnt -no SOURCE,FSTYPE -T "$CACHE/disks" | head -n 1)
q() { printf '%q' "$1"; }
# The profiles cover the module before the change, the fast-hash stack and
# the early_ack stack when those are measured too.
PROFILE_MODULES=
[ -n "$BEFORE_KO" ] && PROFILE_MODULES="before=$BEFORE_KO"
PROFILE_MODULES+="${PROFILE_MODULES:+ }dm-dedup=$REPO/dm-dedup/dm-dedup.ko"
case " $STACKS " in
    *" fast "*) PROFILE_MODULES+=" fast=$REPO/dm-dedup/dm-dedup.ko:hash,xxhash64,verify" ;;
esac
case " $STACKS " in
    *" ack "*) PROFILE_MODULES+=" early_ack=$REPO/dm-dedup/dm-dedup.ko:early_ack" ;;
esac
CMD="export BENCH_OUT=$(q "$SCRATCH") BENCH_REPS=$(q "$REPS") BENCH_ROUNDS=$(q "$ROUNDS") BENCH_QUICK=$(q "$QUICK")
export BENCH_STACKS=$(q "$STACKS") BENCH_BEFORE_KO=$(q "$BEFORE_KO") BENCH_BEFORE=$(q "${before:-}")
export BENCH_DEDUP_OPTS=$(q "${BENCH_DEDUP_OPTS:-}")
export BENCH_WORKLOADS=$(q "${BENCH_WORKLOADS:-seqwrite randwrite randread fsync fsync_sync discard activation pool pool_sync}")
export DEDUP_KO=$(q "$REPO/dm-dedup/dm-dedup.ko") DEDUP_BIN=$(q "$REPO/tools/target/release/dedup")
/usr/bin/python3 $(q "$REPO/tests/bench/bench.py") || exit
# A failed profile must not cost the benchmark's results: it says so in
# profile.txt and the report is written all the same.
[ $(q "$PROFILE") = none ] && exit 0
PROFILE_OUT=$(q "$SCRATCH/profile") PROFILE_BYTES=$(q "$PROFILE_BYTES") \
    PROFILE_MODULES=$(q "$PROFILE_MODULES") bash $(q "$REPO/tests/bench/profile.sh") $PROFILE >$(q "$SCRATCH/profile.txt") 2>&1 ||
    echo \"profile.sh failed with status \$?\" >>$(q "$SCRATCH/profile.txt")
exit 0"

say "booting the guest (results in $SCRATCH)"
start=$(date +%s)
trap 'rm -f "${DISKS[@]}"' EXIT
# --no-debug: the tests' slub_debug and KFENCE would tax each stack by how
# often it allocates.
GUEST_TIMEOUT=${GUEST_TIMEOUT:-7200} "$REPO/scripts/guest-run.sh" --no-debug --memory 10G \
    --rwdir "$SCRATCH" \
    --drive data="$CACHE/disks/data.img" --drive meta="$CACHE/disks/meta.img" \
    --drive pool="$CACHE/pool.img" \
    --sync-drive datasync="$CACHE/disks/datasync.img" \
    --sync-drive metasync="$CACHE/disks/metasync.img" -- "$CMD"
say "guest finished after $(( $(date +%s) - start )) s"

/usr/bin/python3 "$REPO/tests/bench/report.py" "$SCRATCH/results.json" "$OUT" \
    --host-cpu "$host_cpu" --host-cores "$(nproc)" \
    --host-mem "$(awk '/MemTotal/{printf "%.0f GiB", $2/1048576}' /proc/meminfo)" \
    --host-disk "$host_disk" \
    --qemu "$qemu_ver" --commit "$(git -C "$REPO" describe --always --dirty 2>/dev/null || echo unknown)"
if [ -s "$SCRATCH/profile.txt" ]; then
    cp "$SCRATCH/profile.txt" "$OUT/profile.txt"
    say "profile: $OUT/profile.txt"
fi
say "results: $OUT/results.rst, $OUT/results.json, $OUT/*.png"
