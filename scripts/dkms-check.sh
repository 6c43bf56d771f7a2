#!/usr/bin/env bash
# Build the module through DKMS as a distro user would: the files the
# README's DKMS steps install, copied to /usr/src/<name>-<version>+check,
# dkms add + build against the installed 6.12 headers, then removed again.
# The version of its own keeps a real DKMS install of dm-dedup untouched.
# Needs root and the dkms package.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
name=$(sed -n 's/^PACKAGE_NAME="\(.*\)"/\1/p' "$top/dkms.conf")
version=$(sed -n 's/^PACKAGE_VERSION="\(.*\)"/\1/p' "$top/dkms.conf")+check
kver=${KVER:-$(ls -d /usr/src/linux-headers-6.12.*-amd64 | sort -V | tail -n 1 | sed 's,.*/linux-headers-,,')}
src=/usr/src/$name-$version

cleanup() {
	dkms remove "$name/$version" --all >/dev/null 2>&1 || true
	rm -rf "$src"
}
trap cleanup EXIT
cleanup
mkdir -p "$src"
cp -a "$top/Makefile" "$src/"
sed "s/^PACKAGE_VERSION=.*/PACKAGE_VERSION=\"$version\"/" "$top/dkms.conf" >"$src/dkms.conf"
mkdir -p "$src/dm-dedup"
cp -a "$top"/dm-dedup/*.[ch] "$top/dm-dedup/Kbuild" "$src/dm-dedup/"
dkms add "$name/$version" >/dev/null
if ! dkms build "$name/$version" -k "$kver"; then
	cat "/var/lib/dkms/$name/$version/build/make.log" >&2 || true
	echo "dkms-check: FAILED to build $name/$version for $kver" >&2
	exit 1
fi
ko=$(find "/var/lib/dkms/$name/$version/$kver" -name 'dm-dedup.ko*' | head -n 1)
[ -n "$ko" ] || { echo "dkms-check: no module produced" >&2; exit 1; }
modinfo "$ko" | grep -E '^(filename|vermagic|description):'
echo "dkms-check: OK ($name/$version for $kver)"
