#!/usr/bin/env bash
# dm-dedup demo: install deps, build, boot the guest, and in it:
#   - two "disks" (sparse files on a guest tmpfs: 64 MiB for metadata,
#     2 GiB for data), one LVM volume group over both, a logical volume on
#     each, and a dedup device of 4 GiB logical size over the two volumes
#   - ext4 on it; a real system tree copied in once from the host (bounded,
#     DEMO_MB, default 100 MB read over 9p), then copied DEMO_COPIES-1 more
#     times inside the filesystem (those writes go through the dedup target)
#   - verification of every copy against the source (sha256 lists) after an
#     unmount + fsck + mount, then df, the dedup status and a summary:
#     logical data written, physical blocks used, space saved, dedup ratio.
# Exits non-zero if anything fails or a copy differs.
#
# Environment: DEMO_MB (100), DEMO_COPIES (4), DEMO_SRC (space-separated
# source dirs, default "/usr/lib/python3.11 /usr/lib/python3/dist-packages"),
# SKIP_DEPS=1, SKIP_BUILD=1, GUEST_TIMEOUT (1800).
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
CMD="export DEMO_MB=$(q "${DEMO_MB:-100}") DEMO_COPIES=$(q "${DEMO_COPIES:-4}")
export DEMO_SRC=$(q "${DEMO_SRC:-/usr/lib/python3.11 /usr/lib/python3/dist-packages}")
export DEDUP_KO=$(q "$REPO/dm-dedup/dm-dedup.ko")
bash $(q "$REPO/scripts/demo-guest.sh")"
export GUEST_TIMEOUT=${GUEST_TIMEOUT:-1800}
exec "$REPO/scripts/guest-run.sh" -- "$CMD"
