#!/usr/bin/env bash
# The guest half of scripts/demo.sh (runs inside the QEMU guest as root).
set -euo pipefail

KO=${DEDUP_KO:?}
MB=${DEMO_MB:-100}
COPIES=${DEMO_COPIES:-4}
SRC=${DEMO_SRC:-/usr/lib/python3.11 /usr/lib/python3/dist-packages}
T=/tmp/dd-demo            # tmpfs holding the backing files
MNT=/tmp/dd-demo-mnt
NAME=dddemo
VG=dddemo_vg
say() { printf 'demo: %s\n' "$*"; }
stamp() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }

cleanup() {
    set +e
    mountpoint -q "$MNT" && umount "$MNT"
    dmsetup info "$NAME" >/dev/null 2>&1 && dmsetup remove --retry "$NAME"
    if [ -n "${SSD:-}" ] && [ -n "${HDD:-}" ]; then
        lvm vgremove -q -f "$VG" >/dev/null 2>&1
        lvm pvremove -q -y "$SSD" "$HDD" >/dev/null 2>&1
    fi
    [ -n "${SSD:-}" ] && losetup -d "$SSD"
    [ -n "${HDD:-}" ] && losetup -d "$HDD"
    mountpoint -q "$T" && umount "$T"
    lsmod | grep -q '^dm_dedup' && rmmod dm_dedup
}
trap cleanup EXIT

say "loading modules"
for m in dm-mod dm-bufio libcrc32c crc32c loop; do modprobe "$m" 2>/dev/null || true; done
for d in $(modinfo -F depends "$KO" | tr ',' ' '); do modprobe "$d"; done
insmod "$KO"

mkdir -p "$T" "$MNT"
mount -t tmpfs -o size=3G dd-demo "$T"
# Two disks, as on a datastore: a small fast one for the metadata ("ssd")
# and a large one for the data ("hdd"), both loop devices over tmpfs here.
# One volume group over both, a logical volume on each (Documentation/
# dm-dedup.rst, "On LVM"). --devices keeps LVM to these two disks.
truncate -s 64M "$T/ssd.img"
truncate -s 2G "$T/hdd.img"
SSD=$(losetup -f --show "$T/ssd.img")
HDD=$(losetup -f --show "$T/hdd.img")
lvm() { LVM_SUPPRESS_FD_WARNINGS=1 command "$1" --devices "$SSD,$HDD" "${@:2}"; }
say "LVM: volume group $VG on $SSD (metadata) and $HDD (data)"
lvm pvcreate -q -y "$SSD" "$HDD"
lvm vgcreate -q "$VG" "$SSD" "$HDD"
lvm lvcreate -q -y -Wy -Zy -n meta -l 100%PVS "$VG" "$SSD"
lvm lvcreate -q -y -Wy -Zy -n data -l 100%PVS "$VG" "$HDD"
lvm lvs -o lv_name,lv_size,devices "$VG"
META=/dev/$VG/meta
DATA=/dev/$VG/data
LOGICAL=$((4 << 30))
TABLE="0 $((LOGICAL / 512)) dedup $META $DATA"
say "dmsetup create $NAME --table \"$TABLE\""
dmsetup create "$NAME" --table "$TABLE"
udevadm settle || true
DEV=/dev/mapper/$NAME

say "mkfs.ext4 + mount"
mkfs.ext4 -q -F "$DEV"
mount "$DEV" "$MNT"

# ---- the source: a bounded list of files from the host (over 9p) ----------
LIST=$T/files.list
# shellcheck disable=SC2086
find $SRC -xdev -type f -not -path '*/__pycache__/*' -printf '%s %p\n' 2>/dev/null |
    sort -k2 | awk -v max=$((MB * 1000000)) '$1 + tot <= max { tot += $1; print substr($0, length($1) + 2) }' >"$LIST"
NFILES=$(wc -l <"$LIST")
SRCBYTES=$(tr '\n' '\0' <"$LIST" | du -cb --files0-from=- | tail -n 1 | cut -f1)
say "source: $NFILES files, $((SRCBYTES / 1000000)) MB from: $SRC"

t0=$(stamp)
mkdir -p "$MNT/copy1"
tar -C / -cf - --files-from=<(sed 's|^/||' "$LIST") | tar -C "$MNT/copy1" -xf -
sync
t1=$(stamp)
say "copy 1 from the host (9p): $(secs "$t0" "$t1") s"
# checksums of the source as stored in copy 1 vs the host files
(cd / && tr '\n' '\0' <"$LIST" | sed -z 's|^/||' | xargs -0 sha256sum) >"$T/src.sha256"
for i in $(seq 2 "$COPIES"); do
    t0=$(stamp)
    cp -a --reflink=never "$MNT/copy1" "$MNT/copy$i"
    sync
    say "copy $i inside the filesystem: $(secs "$t0" "$(stamp)") s"
done
dmsetup message "$NAME" 0 commit

say "unmount, fsck, mount again, verify every copy"
umount "$MNT"
fsck.ext4 -fn "$DEV" >"$T/fsck.log" 2>&1 || { cat "$T/fsck.log"; say "FAIL: fsck.ext4 found problems"; exit 1; }
mount "$DEV" "$MNT"
fail=0
for i in $(seq 1 "$COPIES"); do
    if (cd "$MNT/copy$i" && sha256sum --quiet -c "$T/src.sha256"); then
        say "copy $i: all $NFILES files identical to the source"
    else
        say "FAIL: copy $i differs from the source"; fail=1
    fi
done

echo
echo "---- df -h $MNT ----"
df -h "$MNT"
echo
STATUS=$(dmsetup status "$NAME")
echo "---- dmsetup status $NAME ----"
echo "$STATUS"
# shellcheck disable=SC2086
set -- $STATUS
shift 3
echo "  mode=$1 transaction_id=$2 metadata=$3 data=$4 mapped=$5"
echo "  unique_writes=$6 duplicate_writes=$7 zero_writes=$8 discarded=$9 hash=${10} ${11} ${12}"
echo
echo "---- summary ----"
awk -v used="${4%%/*}" -v total="${4##*/}" -v uniq="$6" -v dup="$7" -v zero="$8" \
    -v mapped="$5" -v copies="$COPIES" -v src="$SRCBYTES" 'BEGIN {
    B = 4096; MiB = 1048576
    written = uniq + dup
    printf "data copied into the filesystem: %d x %.1f MiB = %.1f MiB\n", copies, src / MiB, copies * src / MiB
    printf "logical data written:            %.1f MiB (%d blocks; + %d zero blocks not stored)\n", written * B / MiB, written, zero
    printf "logical blocks mapped:           %d (%.1f MiB)\n", mapped, mapped * B / MiB
    printf "physical data blocks used:       %d of %d (%.1f MiB)\n", used, total, used * B / MiB
    if (written > 0 && used > 0) {
        printf "space saved:                     %.1f %%\n", 100 * (1 - used / written)
        printf "dedup ratio:                     %.2f : 1\n", written / used
    }
}'
if [ "$fail" != 0 ]; then say "verification FAILED"; exit 1; fi
say "verification passed"
