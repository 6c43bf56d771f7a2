#!/usr/bin/env bash
# dm-dedup demo: install deps, build, boot the guest, and in it one of:
#
# DEMO=datastore (the default; scripts/demo-datastore-guest.py): the VM
#   datastore. Two "disks" in one LVM volume group, a dedup device over a
#   logical volume on each, XFS on it exported over NFSv4 from a server
#   network namespace to a "hypervisor" namespace; VM disk images (raw and
#   qcow2, one OS) copied in through the NFS mount, read back and compared,
#   one deleted and trimmed; then the savings and the status. Environment:
#   DEMO_IMAGES (5), DEMO_OS_MB (64), DEMO_IMAGE_MB (128), DEMO_SRC.
#
# DEMO=copy (scripts/demo-guest.sh; also `make demo-copy`): ext4 on the
#   dedup device, a real system tree copied in once from the host
#   (DEMO_MB, default 100 MB read over 9p), then DEMO_COPIES-1 (default
#   3) more times inside the filesystem; every copy verified after
#   unmount + fsck + mount; df, the status and a summary. DEMO_SRC: the
#   source dirs.
#
# Exits non-zero if anything fails or a copy differs.
# Also: SKIP_DEPS=1, SKIP_BUILD=1, GUEST_TIMEOUT (1800).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
exec </dev/null
say() { printf 'demo: %s\n' "$*"; }

[ "${SKIP_DEPS:-0}" = 1 ] || { say "installing dependencies"; "$REPO/scripts/install-deps.sh"; }
KVER=$("$REPO/scripts/guest-run.sh" --print-kver)
if [ "${SKIP_BUILD:-0}" != 1 ]; then
    say "building the module"
    make -C "$REPO" KDIR="/usr/src/linux-headers-$KVER"
fi
[ -f "$REPO/dm-dedup/dm-dedup.ko" ] || { say "no $REPO/dm-dedup/dm-dedup.ko"; exit 1; }

q() { printf '%q' "$1"; }
case "${DEMO:-datastore}" in
datastore)
    CMD="export DEMO_IMAGES=$(q "${DEMO_IMAGES:-5}") DEMO_OS_MB=$(q "${DEMO_OS_MB:-64}")
export DEMO_IMAGE_MB=$(q "${DEMO_IMAGE_MB:-128}")
export DEMO_SRC=$(q "${DEMO_SRC:-/usr/lib/python3/dist-packages}")
export DEDUP_KO=$(q "$REPO/dm-dedup/dm-dedup.ko")
/bin/python3 $(q "$REPO/scripts/demo-datastore-guest.py")" ;;
copy)
    CMD="export DEMO_MB=$(q "${DEMO_MB:-100}") DEMO_COPIES=$(q "${DEMO_COPIES:-4}")
export DEMO_SRC=$(q "${DEMO_SRC:-/usr/lib/python3.11 /usr/lib/python3/dist-packages}")
export DEDUP_KO=$(q "$REPO/dm-dedup/dm-dedup.ko")
bash $(q "$REPO/scripts/demo-guest.sh")" ;;
*)
    say "DEMO must be datastore or copy, not '$DEMO'"; exit 2 ;;
esac
export GUEST_TIMEOUT=${GUEST_TIMEOUT:-1800}
exec "$REPO/scripts/guest-run.sh" -- "$CMD"
