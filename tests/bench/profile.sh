#!/usr/bin/env bash
# Where a dm-dedup write spends its CPU time, and where it waits for locks:
# per workload, a kernel CPU profile of one fio run, then a lock contention
# profile of a second one. Runs INSIDE the guest (scripts/bench-profile.sh
# boots it with the same disks as the benchmark). TCG has no PMU, so perf
# samples the cpu-clock software event on both vCPUs; the lock profile
# comes from the kernel's lock:contention_begin/end tracepoints.
#
# usage: profile.sh WORKLOAD...   (seq0: 1 MiB writes, unique data;
#                                  seq100: 1 MiB writes, all duplicates;
#                                  seq<dup>q<depth>, e.g. seq0q16: 1 MiB
#                                  writes, dup % duplicates, another iodepth;
#                                  rand0, rand50, rand90: 4 KiB random writes,
#                                  none, 50 or 90 % duplicates, iodepth 32;
#                                  rand<dup>q<depth>, e.g. rand0q4: the same
#                                  at another iodepth;
#                                  randread: 4 KiB random reads after a fill
#                                  of PROFILE_BYTES with 1 MiB writes,
#                                  iodepth 32; randreadq<depth>, e.g.
#                                  randreadq1: the same at another iodepth;
#                                  fsync, fsync100: 4 KiB writes, an fsync
#                                  after each, iodepth 1; unique data, or
#                                  all duplicates; fsync4: an fsync after
#                                  every 4 unique writes)
# Environment: PROFILE_BYTES (256M), PROFILE_OUT (directory), and the
# module(s): PROFILE_MODULES="LABEL=KO ..." profiles each in turn in this
# boot (before and after a change), default "dm-dedup=$DEDUP_KO"; the KO
# "linear" stands for dm-linear over the data disk, the raw reference, and
# KO:OPT,OPT adds table options (e.g. dm-dedup.ko:early_ack).
# PROFILE_REPS=N first times N runs of each workload without perf (fresh
# device each, the modules in turn) and prints their medians (each run's
# stats message is kept in PROFILE_OUT/LABEL-WORKLOAD-repN.stats);
# PROFILE_PERF=0 skips the profiles.
set -euo pipefail

disk() { for b in /sys/block/*; do
             [ "$(cat "$b/serial" 2>/dev/null)" = "$1" ] && { echo "/dev/${b##*/}"; return; }
         done; echo "no disk with serial $1" >&2; exit 1; }
DATA=$(disk data) META=$(disk meta)
BYTES=${PROFILE_BYTES:-256M}
OUT=${PROFILE_OUT:-/tmp/profile}
mkdir -p "$OUT"

echo 0 >/proc/sys/kernel/kptr_restrict   # perf needs the kernel's symbol addresses
for m in dm-mod dm-bufio libcrc32c; do modprobe "$m" 2>/dev/null || true; done

fio_run() { # fio_run OUTFILE [perf prefix...]; the workload is in opts
    local out=$1; shift
    "$@" fio --name=prof --filename=/dev/mapper/prof-dedup --direct=1 --ioengine=libaio \
        --refill_buffers=1 --scramble_buffers=0 --randseed=7 --size="$BYTES" \
        "${opts[@]}" --output-format=terse --terse-version=3 >"$out" 2>&1
}

# The bandwidth (MiB/s) and IOPS of a terse v3 fio output file: of its
# reads for a read workload, else of its writes.
fio_rate() {
    if [ "${opts[0]}" = --rw=randread ]; then
        awk -F';' '/^3;/ {printf "%.1f %.0f\n", $7/1024, $8}' "$1"
    else
        awk -F';' '/^3;/ {printf "%.1f %.0f\n", $48/1024, $49}' "$1"
    fi
}

# A fresh device of the loaded kind: dm-dedup, or dm-linear for "linear".
# A read workload first fills what it reads (unique data, not measured).
fresh_device() {
    blkdiscard "$DATA"; blkdiscard "$META"
    S=$(blockdev --getsz "$DATA")
    if [ "$KIND" = linear ]; then
        dmsetup create prof-dedup --table "0 $S linear $DATA 0"
    else
        local o=(${DEDUP_OPTS//,/ })
        dmsetup create prof-dedup --table \
            "0 $((2 * S)) dedup $META $DATA${o[*]:+ ${#o[@]} ${o[*]}}"
    fi
    if [ -n "${fill[*]}" ]; then
        fio --name=fill --filename=/dev/mapper/prof-dedup --direct=1 --ioengine=libaio \
            --refill_buffers=1 --scramble_buffers=0 --randseed=77 --size="$BYTES" \
            "${fill[@]}" --output-format=terse >/dev/null
    fi
}

workload_opts() { # workload_opts WORKLOAD: sets opts, and fill for a read
    fill=()
    case "$1" in
        seq0) opts=(--rw=write --bs=1M --iodepth=4) ;;
        seq100) opts=(--rw=write --bs=1M --iodepth=4 --dedupe_percentage=100) ;;
        seq*q*)     # seq<duplicate %>q<iodepth>, e.g. seq0q16
            local s=${1#seq}
            opts=(--rw=write --bs=1M --iodepth=${s#*q} --dedupe_percentage=${s%q*}) ;;
        rand0) opts=(--rw=randwrite --bs=4k --iodepth=32) ;;
        rand50|rand90)
            opts=(--rw=randwrite --bs=4k --iodepth=32 --dedupe_percentage=${1#rand}) ;;
        randreadq*) # the same at another iodepth, e.g. randreadq1
            opts=(--rw=randread --bs=4k --iodepth=${1#randreadq})
            fill=(--rw=write --bs=1M --iodepth=4) ;;
        rand*q*)    # rand<duplicate %>q<iodepth>, e.g. rand0q4
            local d=${1#rand}
            opts=(--rw=randwrite --bs=4k --iodepth=${d#*q} --dedupe_percentage=${d%q*}) ;;
        randread)
            opts=(--rw=randread --bs=4k --iodepth=32)
            fill=(--rw=write --bs=1M --iodepth=4) ;;
        fsync) opts=(--rw=write --bs=4k --iodepth=1 --fsync=1) ;;
        fsync100) opts=(--rw=write --bs=4k --iodepth=1 --fsync=1 --dedupe_percentage=100) ;;
        fsync4) opts=(--rw=write --bs=4k --iodepth=1 --fsync=4) ;;
        *) echo "unknown workload $1" >&2; exit 2 ;;
    esac
}

load_module() { # load_module KO[:OPT,OPT...]: sets KIND and DEDUP_OPTS
    KIND=dedup
    DEDUP_OPTS=
    if [ "$1" = linear ]; then KIND=linear; return; fi
    [[ "$1" != *:* ]] || DEDUP_OPTS=${1#*:}
    [ -d /sys/module/dm_dedup ] && rmmod dm_dedup
    insmod "${1%%:*}"
}

# The timed runs go round the modules once per repetition (A B A B ...,
# not A A B B), so that anything drifting during the boot (the host's
# load, the disks' images growing) weighs on every module alike.
time_modules() { # time_modules WORKLOAD...
    local i spec label w mibs
    for ((i = 0; i < PROFILE_REPS; i++)); do
        for spec in $MODULES; do
            label=${spec%%=*}
            load_module "${spec#*=}"
            for w in "$@"; do
                workload_opts "$w"
                fresh_device
                fio_run "$OUT/$label-$w-rep$i.fio"
                [ "$KIND" = linear ] ||
                    dmsetup message prof-dedup 0 stats >"$OUT/$label-$w-rep$i.stats"
                dmsetup remove --retry prof-dedup
                read -r mibs _ < <(fio_rate "$OUT/$label-$w-rep$i.fio")
                echo "$mibs" >>"$OUT/$label-$w.rates"
            done
        done
    done
    for spec in $MODULES; do
        label=${spec%%=*}
        for w in "$@"; do
            printf 'median %s %s: %s MiB/s (runs: %s)\n' "$label" "$w" \
                "$(sort -n "$OUT/$label-$w.rates" | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')" \
                "$(paste -sd' ' "$OUT/$label-$w.rates")"
        done
    done
}

profile_module() { # profile_module LABEL WORKLOAD...
    local label=$1 w; shift
    for w in "$@"; do
        workload_opts "$w"
        fresh_device
        echo "=== $label, $w: fio ${opts[*]} --size=$BYTES under perf ==="
        fio_run "$OUT/$label-$w.fio" perf record -q -a -g -e cpu-clock -F 499 -o "$OUT/$label-$w.data" --
        fio_rate "$OUT/$label-$w.fio" | awk '{printf "fio: %s MiB/s, %s IOPS\n", $1, $2}'
        [ "$KIND" = linear ] ||
            dmsetup message prof-dedup 0 stats | grep -E 'unique_writes|duplicate_writes|deferred|checkpoints|commit_hold'
        dmsetup remove --retry prof-dedup
        echo "--- where the CPU time went (self time, top symbols) ---"
        perf report -q -i "$OUT/$label-$w.data" --kallsyms=/proc/kallsyms --no-children --sort sym --stdio -g none \
            --percent-limit "${PROFILE_PERCENT:-1.5}" 2>/dev/null | sed 's/[[:space:]]*$//' | sed -n 1,40p
        # The write path copies each block into a page of its own before the
        # zero test and the hash (dedup-data.h); this is what that costs next
        # to the hash, both with what they call (memcpy, the SHA-256 rounds).
        echo "--- the block copy next to the zero test and the hash (inclusive) ---"
        perf report -q -i "$OUT/$label-$w.data" --kallsyms=/proc/kallsyms --children --sort sym --stdio -g none \
            2>/dev/null | grep -E 'dd_data_copy|dd_data_is_zero|dd_fingerprint_block' |
            sed 's/[[:space:]]*$//' || echo "(none sampled)"
        echo "--- the target, dm core and dm-bufio (self time) ---"
        perf report -q -i "$OUT/$label-$w.data" --kallsyms=/proc/kallsyms --no-children --sort sym --stdio -g none \
            --percent-limit 0.1 2>/dev/null | grep -E '\] (dd_|dm_|__dm|bufio|cache_|__cache)' |
            sed 's/[[:space:]]*$//' | sed -n 1,40p || echo "(none sampled)"
        # Each step of a bio with what it calls: where a write's time goes
        # between submission, hashing, the decision, the mapping of new
        # data and the completions.
        echo "--- the steps of a bio (inclusive) ---"
        perf report -q -i "$OUT/$label-$w.data" --kallsyms=/proc/kallsyms --children --sort sym --stdio -g none \
            2>/dev/null | grep -E '\] (dd_io_map|dd_write_start|dd_hash_work|dd_decide_and_act|dd_decide_write|dd_stored_work|dd_run_done_work|dd_decide_stored_runs|dd_run_endio|dd_submit_run|dd_map_read|dd_read_batch_work|dm_submit_bio|bio_endio|blk_mq_dispatch_rq_list|virtblk_done|schedule|process_one_work)$' |
            sed 's/[[:space:]]*$//' || echo "(none sampled)"
        echo "--- by module ---"
        perf report -q -i "$OUT/$label-$w.data" --kallsyms=/proc/kallsyms --no-children --sort dso --stdio -g none \
            2>/dev/null | sed 's/[[:space:]]*$//' | sed -n 1,12p
        # A second run of the same workload on a fresh device, for the locks:
        # who waited, how often and how long, by the lock's caller.
        fresh_device
        echo "--- lock contention ($label, $w, second run) ---"
        fio_run "$OUT/$label-$w-lock.fio" perf lock record -q -a -o "$OUT/$label-$w-lock.data" --
        fio_rate "$OUT/$label-$w-lock.fio" |
            awk '{printf "fio (lock run): %s MiB/s, %s IOPS\n", $1, $2}'
        dmsetup remove --retry prof-dedup
        perf lock --kallsyms=/proc/kallsyms contention -i "$OUT/$label-$w-lock.data" \
            -k wait_total -E 12 2>&1 |
            sed 's/[[:space:]]*$//' || echo "(no lock contention recorded)"
    done
}

MODULES=${PROFILE_MODULES:-dm-dedup=${DEDUP_KO:?}}
rm -f "$OUT"/*.rates
if [ "${PROFILE_REPS:-0}" -gt 0 ]; then time_modules "$@"; fi
[ "${PROFILE_PERF:-1}" = 1 ] || exit 0
for spec in $MODULES; do
    load_module "${spec#*=}"
    profile_module "${spec%%=*}" "$@"
done
