#!/usr/bin/env bash
# Install everything the dm-dedup build and test harness needs on a Debian 12
# (bookworm) host.  Idempotent and fast when everything is already present:
# nothing touches the network unless something is missing.
#
#   - an apt entry for bookworm-backports (main contrib), derived at run time
#     from the machine's own /etc/apt/sources.list.d/debian.sources (or
#     /etc/apt/sources.list); no mirror name is written into this repository
#   - the guest kernel and headers (linux-image/linux-headers-6.12-amd64)
#   - build and test tools (build-essential, sparse, fio, xfsprogs, ...) and
#     what virtme-ng needs for the guest's initramfs (busybox-static, file)
#   - qemu-system-x86 from bookworm-backports (QEMU 10: sha_ni under TCG)
#   - virtme-ng (command `vng`) from PyPI, for the python first on PATH
#
# Works without stdin and with CI=true.  Prints one line per step.
set -euo pipefail

export DEBIAN_FRONTEND=noninteractive
exec </dev/null

log() { printf 'install-deps: %s\n' "$*"; }
die() { printf 'install-deps: ERROR: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root"

APT_OPTS=(-y -q -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold
          -o APT::Install-Recommends=false)
APT_UPDATED=0
apt_update() {
    if [ "$APT_UPDATED" = 0 ]; then
        log "apt-get update"
        apt-get -q update >/tmp/install-deps-apt-update.log 2>&1 ||
            { cat /tmp/install-deps-apt-update.log >&2; die "apt-get update failed"; }
        APT_UPDATED=1
    fi
}
apt_install() { # apt_install [-t suite] pkg...
    apt_update
    local log=/tmp/install-deps-apt-install.log
    apt-get "${APT_OPTS[@]}" install "$@" >"$log" 2>&1 ||
        { tail -n 40 "$log" >&2; die "apt-get install $* failed"; }
}
is_installed() { # dpkg says "install ok installed"
    [ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" = "install ok installed" ]
}

# --- 1. bookworm-backports apt entry ------------------------------------------
BPO_FILE=/etc/apt/sources.list.d/backports.sources
has_backports() {
    grep -rqsE '^[^#]*bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null
}
if has_backports; then
    log "backports apt entry: present"
else
    SRC=/etc/apt/sources.list.d/debian.sources
    if [ -f "$SRC" ]; then
        # deb822: copy every stanza except the security one, with
        # Suites/Components replaced.
        awk '
            function flush() {
                if (n > 0 && !security) {
                    if (printed) print ""
                    for (i = 1; i <= n; i++) print buf[i]
                    printed = 1
                }
                n = 0; security = 0
            }
            /^[[:space:]]*$/ { flush(); next }
            /^Suites:/       { if ($0 ~ /security/) security = 1
                               buf[++n] = "Suites: bookworm-backports"; next }
            /^Components:/   { buf[++n] = "Components: main contrib"; next }
            /^URIs:/         { if ($0 ~ /security/) security = 1 }
            { buf[++n] = $0 }
            END { flush() }
        ' "$SRC" >"$BPO_FILE.tmp"
    elif [ -f /etc/apt/sources.list ]; then
        # one-line format: take the first non-security bookworm "deb" line.
        awk '$1 == "deb" && $0 !~ /security/ && $0 ~ /bookworm/ {
                 for (i = 2; i <= NF; i++) if ($i !~ /^\[/) { uri = $i; break }
                 opts = ($2 ~ /^\[/) ? $2 " " : ""
                 print "deb " opts uri " bookworm-backports main contrib"; exit }' \
            /etc/apt/sources.list >"${BPO_FILE%.sources}.list.tmp"
        BPO_FILE=${BPO_FILE%.sources}.list
    else
        die "no apt sources file to derive the backports entry from"
    fi
    [ -s "$BPO_FILE.tmp" ] || die "could not derive a backports entry"
    mv "$BPO_FILE.tmp" "$BPO_FILE"
    APT_UPDATED=0
    log "backports apt entry: written to $BPO_FILE"
fi

# --- 2. Debian packages from bookworm ------------------------------------------
# busybox-static and file: virtme-ng builds the guest's initramfs around a
# static busybox and checks that it is static with file(1).  procps: pgrep in
# guest-run.sh.  A bare Debian 12 has none of the three (scripts/fresh-check.sh).
# lvm2: the guest suite and the demo put dedup on logical volumes; blktrace:
# the suite's I/O assertions (tests/guest/iotrace.py). nfs-kernel-server,
# open-iscsi, targetcli-fb (python3-rtslib-fb) and iproute2: the datastore
# exports over NFS and iSCSI between network namespaces in the guest
# (tests/guest/test_export.py with netns.py, nfs.py, iscsi.py) and the
# demo; qemu-utils: qemu-img for the VM images they carry.
# Their services are never started on this machine: the suite starts the
# daemons it needs inside the guest.
PKGS=(linux-image-6.12-amd64 linux-headers-6.12-amd64 build-essential sparse fio
      xfsprogs e2fsprogs dmsetup python3-pytest kmod udev rsync util-linux
      dkms linux-source-6.12 xz-utils flex bison bc busybox-static file procps
      lvm2 blktrace nfs-kernel-server open-iscsi targetcli-fb python3-rtslib-fb
      iproute2 qemu-utils)
missing=()
for p in "${PKGS[@]}"; do is_installed "$p" || missing+=("$p"); done
if [ "${#missing[@]}" = 0 ]; then
    log "packages: all ${#PKGS[@]} present"
else
    log "packages: installing ${missing[*]}"
    apt_install "${missing[@]}"
fi

# --- 2b. checkpatch.pl from the 6.12 source tarball ---------------------------
# Only the script and its data files are unpacked: the static checks need
# nothing else from the tree.
CP_DIR=/usr/src/linux-source-6.12/scripts
if [ -x "$CP_DIR/checkpatch.pl" ]; then
    log "checkpatch: $CP_DIR/checkpatch.pl present"
else
    tarball=$(ls /usr/src/linux-source-6.12.tar.* 2>/dev/null | head -n 1 || true)
    [ -n "$tarball" ] || die "linux-source-6.12 tarball not found in /usr/src"
    log "checkpatch: unpacking from $tarball"
    tar -C /usr/src -xf "$tarball" linux-source-6.12/scripts/checkpatch.pl \
        linux-source-6.12/scripts/spelling.txt \
        linux-source-6.12/scripts/const_structs.checkpatch
fi

# --- 2c. Rust toolchain pieces for tools/ --------------------------------------
if ! command -v cargo >/dev/null 2>&1; then
    die "cargo not found: install Rust (rustup) first"
fi
for comp in clippy rustfmt; do
    if cargo "${comp/rustfmt/fmt}" --version >/dev/null 2>&1; then
        log "rust: $comp present"
    else
        log "rust: adding component $comp"
        rustup component add "$comp" >/dev/null
    fi
done

# --- 3. QEMU from bookworm-backports -------------------------------------------
qemu_ver=$(dpkg-query -W -f='${Version}' qemu-system-x86 2>/dev/null || true)
if is_installed qemu-system-x86 && [[ "$qemu_ver" == *bpo* ]]; then
    log "qemu-system-x86: $qemu_ver (backports) present"
else
    log "qemu-system-x86: installing from bookworm-backports (had: ${qemu_ver:-none})"
    apt_install -t bookworm-backports qemu-system-x86
    log "qemu-system-x86: $(dpkg-query -W -f='${Version}' qemu-system-x86)"
fi

# --- 4. virtme-ng (vng) from PyPI ----------------------------------------------
# Pinned: guest-run.sh relies on its options (--disable-kvm, --qemu-opts,
# --rwdir, --exec, --dry-run), and a machine that has vng already never
# sees a newer release.
VNG_PIN=virtme-ng==1.42
if command -v vng >/dev/null 2>&1; then
    log "virtme-ng: $(command -v vng) present"
else
    PY=$(command -v python3 || true)
    [ -n "$PY" ] || die "no python3 on PATH for pip"
    log "virtme-ng: pip install with $PY"
    pipl=/tmp/install-deps-pip.log
    if ! "$PY" -m pip install -q --disable-pip-version-check --root-user-action=ignore \
            "$VNG_PIN" >"$pipl" 2>&1; then
        if grep -q externally-managed "$pipl"; then
            "$PY" -m pip install -q --disable-pip-version-check --break-system-packages \
                "$VNG_PIN" >"$pipl" 2>&1 || { cat "$pipl" >&2; die "pip install failed"; }
        else
            cat "$pipl" >&2; die "pip install virtme-ng failed"
        fi
    fi
    command -v pyenv >/dev/null 2>&1 && pyenv rehash >/dev/null 2>&1 || true
    hash -r
    command -v vng >/dev/null 2>&1 || die "vng still not on PATH after pip install"
    log "virtme-ng: installed $(command -v vng)"
fi

# --- 5. sanity: a guest kernel with its module tree and headers ---------------
KIMG=$(ls /boot/vmlinuz-6.12.*-amd64 2>/dev/null | sort -V | tail -n 1 || true)
[ -n "$KIMG" ] || die "no /boot/vmlinuz-6.12.*-amd64"
KVER=${KIMG#/boot/vmlinuz-}
[ -d "/lib/modules/$KVER/kernel" ] || die "no module tree /lib/modules/$KVER"
[ -d "/usr/src/linux-headers-$KVER" ] || die "no headers /usr/src/linux-headers-$KVER"
log "guest kernel: $KVER (image, modules, headers present)"
