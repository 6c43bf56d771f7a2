#!/usr/bin/env bash
# Build (once) the pool of virtual-machine disk images that `make bench`
# copies onto every stack, and pack it into one disk image for the guest.
#
# usage: scripts/bench-images.sh [--rebuild]
#
# Each image is its own debootstrap run of Debian bookworm (variant minbase
# plus a server role), so two images of one flavour share what separate
# installs share in practice (the same packages) but not what they would not
# (SSH host keys, logs, timestamps, the order files were written in).  Every
# tree is packed into a raw ext4 disk image with mkfs.ext4 -d (no mounting),
# and all images into one ext4 "pool" disk, attached read-only in the guest.
#
# Environment:
#   BENCH_CACHE     where images live between runs (/var/cache/dm-dedup-bench)
#   BENCH_FLAVOURS  space-separated flavours (default: all five below)
#   BENCH_COPIES    installs per flavour (2)
# Downloaded packages are kept in $BENCH_CACHE/debs, so a rebuild needs no
# network.  debootstrap uses its default mirror: none is named here.
set -euo pipefail

CACHE=${BENCH_CACHE:-/var/cache/dm-dedup-bench}
FLAVOURS=${BENCH_FLAVOURS:-"dns web-db mail files db"}
COPIES=${BENCH_COPIES:-2}
SUITE=bookworm
say() { printf 'bench-images: %s\n' "$*"; }
die() { printf 'bench-images: ERROR: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (debootstrap)"
command -v debootstrap >/dev/null || die "debootstrap missing (scripts/bench.sh installs it)"
[ "${1:-}" != --rebuild ] || rm -rf "$CACHE/images" "$CACHE/pool.img" "$CACHE/pool.manifest"

COMMON=systemd-sysv,openssh-server,iproute2,ifupdown,isc-dhcp-client,less,cron,logrotate,ca-certificates
packages() {
    case "$1" in
        dns) echo "$COMMON,bind9,bind9-utils" ;;
        web-db) echo "$COMMON,apache2,libapache2-mod-php,php-mysql,mariadb-server" ;;
        mail) echo "$COMMON,postfix,dovecot-imapd,dovecot-pop3d" ;;
        files) echo "$COMMON,samba,nfs-kernel-server" ;;
        db) echo "$COMMON,postgresql" ;;
        *) die "unknown flavour $1 (dns web-db mail files db)" ;;
    esac
}

# The manifest names what the pool holds; a pool built from other settings is
# rebuilt.
want="suite=$SUITE flavours=$FLAVOURS copies=$COPIES format=1"
if [ -f "$CACHE/pool.img" ] && [ "$(cat "$CACHE/pool.manifest" 2>/dev/null)" = "$want" ]; then
    say "pool present: $CACHE/pool.img ($want)"
    exit 0
fi

mkdir -p "$CACHE/debs" "$CACHE/images" "$CACHE/roots"
start=$(date +%s)
for f in $FLAVOURS; do
    pk=$(packages "$f")
    for i in $(seq 1 "$COPIES"); do
        img=$CACHE/images/$f-$i.img
        if [ -f "$img" ]; then
            say "$f-$i: present"
            continue
        fi
        root=$CACHE/roots/$f-$i
        rm -rf "$root"
        say "$f-$i: debootstrap $SUITE minbase + ${pk//,/ }"
        t0=$(date +%s)
        log=$CACHE/roots/$f-$i.log
        if ! debootstrap --variant=minbase --include="$pk" --cache-dir="$CACHE/debs" \
                "$SUITE" "$root" >"$log" 2>&1; then
            tail -n 30 "$log" >&2
            die "$f-$i: debootstrap failed (log: $log)"
        fi
        # What an installer leaves behind: a hostname and a machine id.
        echo "$f-$i" >"$root/etc/hostname"
        head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$root/etc/machine-id"
        echo >>"$root/etc/machine-id"
        used=$(du -sxb "$root" | cut -f1)
        # Room for the filesystem's own metadata and 25 % free, in whole MiB.
        mib=$(( (used * 5 / 4) / 1048576 + 96 ))
        rm -f "$img.tmp"
        truncate -s "${mib}M" "$img.tmp"
        mkfs.ext4 -q -F -L "$f-$i" -d "$root" "$img.tmp" >/dev/null
        mv "$img.tmp" "$img"
        rm -rf "$root" "$log"
        say "$f-$i: $((used / 1048576)) MiB of files in a ${mib} MiB image ($(( $(date +%s) - t0 )) s)"
    done
done

# Pack every image into one ext4 disk for the guest (9p would read at ~10 MB/s).
pool=$CACHE/pool
rm -rf "$pool" && mkdir -p "$pool/images"
total=0
for f in $FLAVOURS; do
    for i in $(seq 1 "$COPIES"); do
        ln "$CACHE/images/$f-$i.img" "$pool/images/"
        total=$(( total + $(stat -c %s "$CACHE/images/$f-$i.img") ))
    done
done
mib=$(( total * 11 / 10 / 1048576 + 128 ))
rm -f "$CACHE/pool.img.tmp"
truncate -s "${mib}M" "$CACHE/pool.img.tmp"
say "packing $((total / 1048576)) MiB of images into a ${mib} MiB pool disk"
mkfs.ext4 -q -F -L ddpool -d "$pool" "$CACHE/pool.img.tmp" >/dev/null
mv "$CACHE/pool.img.tmp" "$CACHE/pool.img"
rm -rf "$pool" "$CACHE/roots"
echo "$want" >"$CACHE/pool.manifest"
say "pool ready: $CACHE/pool.img in $(( $(date +%s) - start )) s"
