#!/usr/bin/env bash
# Fresh-machine check: prove that the project's own scripts install everything
# dm-dedup needs, starting from a bare Debian 12 (bookworm) in a chroot.
#
# usage: scripts/fresh-check.sh [options]
#   --dir DIR     work directory (default $FRESH_DIR or /var/tmp/dd-fresh)
#   --worktree    test the working tree (tracked files as they are now, plus
#                 untracked files that are not ignored) instead of the
#                 committed HEAD (git archive HEAD)
#   --with PATH   HEAD, plus PATH (a file or directory) as it is in the working
#                 tree (repeatable): tests one change while other uncommitted
#                 work in the tree stays out
#   --variant V   debootstrap variant: minbase (default) or default
#   --refresh     debootstrap again even if a cached tarball exists
#   --kunit       also run scripts/kunit.sh (the first UML build takes about
#                 10 minutes on 2 cores)
#   --boot        also boot the guest once with scripts/guest-run.sh and load
#                 the module in it.  This starts QEMU: only one guest may run
#                 on the machine at a time, so the step takes the host's
#                 guest lock (/tmp/dm-dedup-guest.lock) and waits for it
#   --remove      delete the chroot at the end (default: keep it, unmounted,
#                 for inspection; the next run replaces it)
#
# Steps, each timed, with a summary line per step at the end:
#   bootstrap      debootstrap bookworm into DIR/root.  The pristine result is
#                  kept as DIR/cache/bookworm-VARIANT.tar and later runs unpack
#                  that tarball instead (--refresh to debootstrap again)
#   chroot-setup   mounts (proc, sys read-only, /dev and /dev/pts bound from
#                  the host with /dev read-only, tmpfs on /dev/shm, /run and
#                  /tmp), resolv.conf, apt sources, the Rust and Python overlays
#   base-image     the packages and tools of the base image (below); checks
#                  that nothing the project installs is there yet
#   copy-repo      the repository into /root/dm-dedup in the chroot
#   install-deps   scripts/install-deps.sh
#   install-deps-again  scripts/install-deps.sh once more: must install nothing
#   make           make (the module against the newest 6.12 headers)
#   static         make static (W=1, sparse, checkpatch)
#   dkms           scripts/dkms-check.sh
#   tools          tools/run-tests.sh (cargo fmt, clippy, test), and the
#                  release build the guest suite runs (as tests/run-all.sh)
#   guest-prereqs  what a guest run needs, checked without booting: vng, a
#                  static busybox, file, QEMU from backports, the guest kernel
#                  with its modules and headers, the modules the tests load,
#                  dm-dedup.ko's vermagic, the commands the guest suite and the
#                  demo run, pytest for /bin/python3, the dedup tool, and
#                  `vng --dry-run`, which builds the initramfs as a real boot
#                  does and stops before starting QEMU
#   kunit          (--kunit) scripts/kunit.sh
#   boot           (--boot) scripts/guest-run.sh: insmod dm-dedup.ko in the
#                  guest and find the dedup target in `dmsetup targets`
# Every command in the chroot runs as root with stdin closed, CI=true and only
# the environment listed below.  Logs: DIR/logs/STEP.log.
#
# The base image: what a fresh machine of this kind (Debian 12 with Rust from
# rustup and a pyenv Python, gcc, make, git) has before any project script
# runs.  Nothing else is assumed:
#   - debootstrap --variant=minbase bookworm (Debian's required packages and
#     apt), from the mirror of the host's own apt sources
#   - apt sources: the host's /etc/apt/sources.list.d/debian.sources
#     (or its /etc/apt/sources.list, converted to deb822), with any
#     bookworm-backports suite removed: install-deps.sh must derive that
#     entry itself.  No /etc/apt/sources.list.  The apt lists are emptied
#     after the base packages are installed (as in Debian's container images)
#   - packages: ca-certificates curl git gcc make python3 (Debian's python3
#     also brings the shared libraries the pyenv Python links against)
#   - trusted CA certificates: those in the host's
#     /etc/ssl/certs/ca-certificates.crt that no file of its ca-certificates
#     package holds (a machine of this kind may trust a network's own CA) go
#     to /usr/local/share/ca-certificates, so they survive every
#     update-ca-certificates; Debian's own set comes from the chroot's package
#   - /usr/sbin/policy-rc.d refusing to start services (as in Debian's
#     container images; nothing may start daemons from a chroot)
#   - Rust: the host's /root/.cargo and /root/.rustup, mounted as overlays
#     (the host's directories are their read-only lower layers and are never
#     written); cargo's caches (/root/.cargo/registry and git) are hidden in
#     the overlay, so crates come from crates.io
#   - Python: the host's /root/.pyenv as an overlay, its global version first
#     on PATH.  Distributions pip-installed into that Python after this
#     machine booted (for example virtme-ng by an earlier install-deps.sh)
#     are uninstalled in the overlay and the shims are rehashed
#   - environment: HOME=/root, PATH=/root/.cargo/bin:/root/.pyenv/shims:
#     /root/.pyenv/bin and the standard directories, PYENV_ROOT, LANG=C.UTF-8,
#     CI=true, DEBIAN_FRONTEND=noninteractive
# Not in it, so install-deps.sh must provide them: build-essential, the kernel
# and its headers, busybox-static, QEMU, virtme-ng, file, procps, and the rest.
#
# Needs root (it installs debootstrap on the host if missing) and the network access
# install-deps.sh needs (apt, PyPI, crates.io).  The mirror is read at run
# time from the host's apt sources (FRESH_MIRROR overrides it); no host name is
# written here.  Takes about 8 minutes on 2 cores, KUnit not included
# (tests/README.md, "Fresh-machine check").  Cleanup (on any exit): processes left in the chroot are
# stopped, and everything mounted under DIR/root is unmounted, deepest first;
# nothing under DIR is deleted while anything is mounted there.
set -euo pipefail
exec </dev/null

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=${FRESH_DIR:-/var/tmp/dd-fresh}
WORKTREE=0
WITH=()
VARIANT=minbase
REFRESH=0
KUNIT=0
BOOT=0
REMOVE=0

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --dir) [ $# -ge 2 ] || usage; DIR=$2; shift 2 ;;
        --worktree) WORKTREE=1; shift ;;
        --with) [ $# -ge 2 ] || usage; WITH+=("$2"); shift 2 ;;
        --variant) [ $# -ge 2 ] || usage; VARIANT=$2; shift 2 ;;
        --refresh) REFRESH=1; shift ;;
        --kunit) KUNIT=1; shift ;;
        --boot) BOOT=1; shift ;;
        --remove) REMOVE=1; shift ;;
        -h|--help) usage ;;
        *) echo "fresh-check: unknown argument $1" >&2; usage ;;
    esac
done

log() { printf 'fresh-check: %s\n' "$*"; }
warn() { printf 'fresh-check: WARNING: %s\n' "$*" >&2; }
die() { printf 'fresh-check: ERROR: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (debootstrap, chroot, mounts)"
# The host is a machine like any other: install what this script itself needs.
if ! command -v debootstrap >/dev/null; then
    log "installing debootstrap on the host"
    { apt-get -q update && DEBIAN_FRONTEND=noninteractive apt-get -y -q install debootstrap; } \
        >/dev/null 2>&1 </dev/null || die "apt-get install debootstrap failed"
fi
case "$VARIANT" in
    minbase) VARIANT_ARGS=(--variant=minbase) ;;
    default) VARIANT_ARGS=() ;;
    *) die "--variant must be minbase or default" ;;
esac

# DIR must be a plain absolute path well below /: everything under DIR/root
# gets unmounted and deleted.
case "$DIR" in /*) ;; *) DIR=$PWD/$DIR ;; esac
[[ "$DIR" != *[[:space:]\\]* ]] || die "no spaces or backslashes in --dir"
mkdir -p "$DIR"
DIR=$(realpath "$DIR")
[[ "$DIR" == /*/* ]] || die "--dir must be at least two levels below / (got $DIR)"
R=$DIR/root            # the chroot
OVL=$DIR/overlay       # upper and work directories of the overlays
CACHE=$DIR/cache
LOGD=$DIR/logs
CREPO=/root/dm-dedup   # the repository, inside the chroot
mkdir -p "$CACHE" "$LOGD"

exec 8>"$DIR/lock"
flock -n 8 || die "another fresh-check runs on $DIR"

# --- mounts and cleanup -------------------------------------------------------
# Mount points at or below $1, deepest first.
mounts_under() {
    awk -v p="$1" '{ m = $5; gsub(/\\040/, " ", m)
                     if (m == p || index(m, p "/") == 1) print length(m), m }' \
        /proc/self/mountinfo | sort -rn | cut -d' ' -f2-
}
# Stop what still runs with its root in the chroot (by pid: only processes
# started from this chroot can have it as their root).
stop_chroot_procs() {
    local p pids=() pass
    [ -d "$R" ] || return 0
    for pass in TERM KILL; do
        pids=()
        for p in /proc/[0-9]*; do
            [ "$(readlink "$p/root" 2>/dev/null)" = "$R" ] && pids+=("${p#/proc/}")
        done
        [ "${#pids[@]}" = 0 ] && return 0
        warn "stopping processes left in the chroot ($pass): ${pids[*]}"
        kill "-$pass" "${pids[@]}" 2>/dev/null || true
        sleep 2
    done
}
unmount_all() {
    local m list _
    for _ in 1 2 3 4 5; do
        list=$(mounts_under "$R")
        [ -n "$list" ] || return 0
        while IFS= read -r m; do
            umount "$m" 2>/dev/null || true
        done <<<"$list"
        [ -n "$(mounts_under "$R")" ] || return 0
        sleep 1
    done
    warn "still mounted under $R:"
    mounts_under "$R" >&2
    return 1
}
# rm -rf, refused while anything is mounted at or below the path.
remove_tree() {
    local t=$1
    [[ "$t" == "$DIR"/* ]] || die "internal: refusing to remove $t (outside $DIR)"
    [ -e "$t" ] || return 0
    [ -z "$(mounts_under "$t")" ] || die "refusing to remove $t: something is still mounted there"
    rm -rf --one-file-system "$t"
}
# domount TARGET MOUNT-ARGS...: mount, and keep the mount private so that
# nothing mounted or unmounted below it propagates anywhere else.
domount() {
    local t=$1; shift
    mount "$@" "$t"
    mount --make-private "$t"
}
cleanup() {
    local rc=$?
    set +e
    stop_chroot_procs
    if ! unmount_all; then
        warn "could not unmount everything under $R; unmount it by hand (deepest first) before removing anything"
        [ "$rc" != 0 ] || rc=1
    elif [ "$REMOVE" = 1 ] && [ -d "$R" ]; then
        log "removing $R and $OVL (--remove)"
        remove_tree "$R"
        remove_tree "$OVL"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# A previous run that was killed may have left mounts behind.
[ -z "$(mounts_under "$R")" ] || { log "unmounting what a previous run left under $R"; unmount_all || die "cannot unmount $R"; }

# --- the mirror and the apt sources, from the host ---------------------------
HOST_DEB822=/etc/apt/sources.list.d/debian.sources
HOST_LIST=/etc/apt/sources.list
# The first URI of a "deb" entry for the suite bookworm (not security).
derive_mirror() {
    if [ -f "$HOST_DEB822" ]; then
        awk 'function flush() {
                 if (uri != "" && (" " types " ") ~ / deb / && (" " suites " ") ~ / bookworm / &&
                     uri !~ /security/) { print uri; found = 1; exit }
                 uri = ""; suites = ""; types = ""
             }
             /^[[:space:]]*$/ { flush(); next }
             /^URIs:/   { uri = $2 }
             /^Suites:/ { sub(/^Suites:[[:space:]]*/, ""); suites = $0 }
             /^Types:/  { sub(/^Types:[[:space:]]*/, ""); types = $0 }
             END { if (!found) flush() }' "$HOST_DEB822"
    elif [ -f "$HOST_LIST" ]; then
        awk '$1 == "deb" { i = 2
                           if ($i ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
                           if ($(i + 1) == "bookworm" && $i !~ /security/) { print $i; exit } }' "$HOST_LIST"
    fi
}
# The chroot's debian.sources: the host's, without bookworm-backports.
write_chroot_sources() {
    local out=$R/etc/apt/sources.list.d/debian.sources
    mkdir -p "$(dirname "$out")"
    if [ -f "$HOST_DEB822" ]; then
        awk 'function flush() {
                 if (n > 0 && keep) { if (printed) print ""; for (i = 1; i <= n; i++) print buf[i]; printed = 1 }
                 n = 0; keep = 1
             }
             BEGIN { keep = 1 }
             /^[[:space:]]*$/ { flush(); next }
             /^Suites:/ { s = ""
                          for (i = 2; i <= NF; i++) if ($i != "bookworm-backports") s = s " " $i
                          if (s == "") keep = 0
                          buf[++n] = "Suites:" s; next }
             { buf[++n] = $0 }
             END { flush() }' "$HOST_DEB822" >"$out"
    elif [ -f "$HOST_LIST" ]; then
        awk '$1 == "deb" { i = 2; opts = ""
                           if ($i ~ /^\[/) { while (i <= NF) { opts = opts " " $i; if ($i ~ /\]$/) break; i++ }; i++ }
                           if ($(i + 1) ~ /backports/) next
                           if (printed) print ""
                           print "Types: deb"; print "URIs: " $i; print "Suites: " $(i + 1)
                           c = ""; for (j = i + 2; j <= NF; j++) c = c " " $j
                           print "Components:" c
                           if (match(opts, /signed-by=[^] ]+/)) print "Signed-By: " substr(opts, RSTART + 10, RLENGTH - 10)
                           printed = 1 }' "$HOST_LIST" >"$out"
    fi
    [ -s "$out" ] || die "could not derive apt sources for the chroot from the host"
    rm -f "$R/etc/apt/sources.list"
}

MIRROR=${FRESH_MIRROR:-$(derive_mirror || true)}
[ -n "$MIRROR" ] || warn "no bookworm entry in the host's apt sources: debootstrap uses its default mirror"

# --- running things in the chroot ---------------------------------------------
CHROOT_PATH=/root/.cargo/bin:/root/.pyenv/shims:/root/.pyenv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
CHROOT_ENV=(HOME=/root USER=root LOGNAME=root SHELL=/bin/bash TERM=dumb LANG=C.UTF-8
            CI=true DEBIAN_FRONTEND=noninteractive PYENV_ROOT=/root/.pyenv PATH="$CHROOT_PATH")
# in_chroot 'bash commands' (run from the repository copy when it exists)
in_chroot() {
    chroot "$R" /usr/bin/env -i "${CHROOT_ENV[@]}" /bin/bash -c \
        "set -euo pipefail; if [ -d $CREPO ]; then cd $CREPO; else cd /root; fi; $1" </dev/null
}

# --- steps --------------------------------------------------------------------
STEP_NAMES=()
STEP_SECS=()
T_START=$(date +%s)
summary() {
    local i total=$(( $(date +%s) - T_START ))
    log "summary (work directory $DIR, logs in $LOGD):"
    for i in "${!STEP_NAMES[@]}"; do
        printf 'fresh-check:   %-20s %6ss  %s\n' "${STEP_NAMES[$i]}" "${STEP_SECS[$i]%% *}" "${STEP_SECS[$i]#* }"
    done
    printf 'fresh-check:   %-20s %6ss\n' total "$total"
}
# step NAME FUNCTION: run it with its output on the terminal and in
# LOGD/NAME.log; stop with a message naming the step when it fails.
step() {
    local name=$1 fn=$2 t0 rc=0 secs
    log "==== step $name"
    t0=$(date +%s)
    set +e
    ( set -e; "$fn" ) 2>&1 | tee "$LOGD/$name.log"
    rc=${PIPESTATUS[0]}
    set -e
    secs=$(( $(date +%s) - t0 ))
    STEP_NAMES+=("$name")
    if [ "$rc" = 0 ]; then
        STEP_SECS+=("$secs ok")
        log "step $name: ok (${secs}s)"
    else
        STEP_SECS+=("$secs FAILED (status $rc)")
        summary
        die "step $name FAILED (status $rc) after ${secs}s; log: $LOGD/$name.log"
    fi
}

TARBALL=$CACHE/bookworm-$VARIANT.tar
do_bootstrap() {
    remove_tree "$R"
    if [ "$REFRESH" = 0 ] && [ -s "$TARBALL" ]; then
        log "unpacking the pristine debootstrap result $TARBALL ($(cat "$TARBALL.info" 2>/dev/null || echo 'no info'))"
        mkdir -p "$R"
        tar -C "$R" --numeric-owner --xattrs --xattrs-include='*' -xpf "$TARBALL"
        return
    fi
    log "debootstrap ${VARIANT_ARGS[*]} bookworm $R ${MIRROR:-(default mirror)}"
    local rc=0
    debootstrap "${VARIANT_ARGS[@]}" bookworm "$R" ${MIRROR:+"$MIRROR"} >"$LOGD/debootstrap.log" 2>&1 || rc=$?
    # debootstrap mounts proc and sys in the target and may leave them on failure
    unmount_all
    if [ "$rc" != 0 ]; then
        tail -n 30 "$LOGD/debootstrap.log"
        [ ! -f "$R/debootstrap/debootstrap.log" ] || tail -n 30 "$R/debootstrap/debootstrap.log"
        return "$rc"
    fi
    log "caching the pristine result as $TARBALL"
    tar -C "$R" --numeric-owner --xattrs --xattrs-include='*' -cpf "$TARBALL.tmp" .
    mv "$TARBALL.tmp" "$TARBALL"
    printf 'debootstrap %s, variant %s, mirror %s, %s\n' \
        "$(debootstrap --version | awk '{print $2}')" "$VARIANT" "${MIRROR:-default}" \
        "$(date -u +%Y-%m-%dT%H:%MZ)" >"$TARBALL.info"
}

# The host's trusted certificates that its ca-certificates package does not
# ship (see the header), as local CA files of the chroot.
copy_host_cas() {
    local bundle=/etc/ssl/certs/ca-certificates.crt dest=$R/usr/local/share/ca-certificates
    local known n
    [ -f "$bundle" ] || return 0
    known=$(mktemp)
    find /usr/share/ca-certificates -name '*.crt' -type f -exec cat {} + >"$known" 2>/dev/null || true
    mkdir -p "$dest"
    awk -v out="$dest" '
        /-----BEGIN CERTIFICATE-----/ { inc = 1; pem = ""; key = "" }
        inc { pem = pem $0 "\n"; if ($0 !~ /^-----/) { gsub(/[[:space:]]/, ""); key = key $0 } }
        /-----END CERTIFICATE-----/ {
            inc = 0
            if (FILENAME == ARGV[1]) known[key] = 1
            else if (!(key in known)) { n++; f = out "/fresh-check-host-" n ".crt"; printf "%s", pem >f; close(f) }
        }
        END { print n + 0 }' "$known" "$bundle" >"$known.n"
    n=$(cat "$known.n")
    rm -f "$known" "$known.n"
    echo "trusted CA certificates of the host that Debian does not ship: $n (in $dest)"
}

do_chroot_setup() {
    [ -x "$R/bin/bash" ] || { echo "no bootstrapped tree in $R"; return 1; }
    domount "$R/proc" -t proc proc
    domount "$R/sys" -t sysfs -o ro sysfs
    domount "$R/dev" --bind /dev
    mount -o remount,bind,ro "$R/dev"      # this bind only; the host's /dev stays rw
    domount "$R/dev/pts" --bind /dev/pts
    domount "$R/dev/shm" -t tmpfs -o mode=1777,nosuid,nodev dd-fresh-shm
    domount "$R/run" -t tmpfs -o mode=755,nosuid,nodev dd-fresh-run
    domount "$R/tmp" -t tmpfs -o mode=1777,nosuid,nodev,size=8G dd-fresh-tmp
    rm -f "$R/etc/resolv.conf"
    cat /etc/resolv.conf >"$R/etc/resolv.conf"
    write_chroot_sources
    copy_host_cas
    printf '#!/bin/sh\n# fresh-check: no services start in this chroot\nexit 101\n' >"$R/usr/sbin/policy-rc.d"
    chmod 755 "$R/usr/sbin/policy-rc.d"
    echo "apt sources in the chroot ($R/etc/apt/sources.list.d):"
    sed 's/^/    /' "$R/etc/apt/sources.list.d/debian.sources"

    # Rust and Python of the base image: overlays over the host's directories.
    remove_tree "$OVL"
    local d name
    for d in /root/.cargo /root/.rustup /root/.pyenv; do
        [ -d "$d" ] || { echo "the host has no $d (part of the base image)"; return 1; }
        name=${d##*/.}
        mkdir -p "$OVL/$name/upper" "$OVL/$name/work" "$R$d"
        domount "$R$d" -t overlay -o "lowerdir=$d,upperdir=$OVL/$name/upper,workdir=$OVL/$name/work" "dd-fresh-$name"
        echo "overlay: $R$d over the host's $d"
    done
    # A fresh machine has no crates cached: hide cargo's caches (this deletes
    # in the overlay only; the host's files stay).
    rm -rf "$R/root/.cargo/registry" "$R/root/.cargo/git"
}

# The scripts in single quotes below run in the chroot, which expands them.
# shellcheck disable=SC2016
do_base_image() {
    in_chroot '
        apt-get -q update
        apt-get -y -q -o APT::Install-Recommends=false install ca-certificates curl git gcc make python3
        apt-get clean
        rm -rf /var/lib/apt/lists/*'
    # pyenv: back to what the image shipped (see the header)
    in_chroot '
        btime=$(awk "\$1 == \"btime\" { print \$2 }" /proc/stat)
        sp=$(python3 -c "import sysconfig; print(sysconfig.get_paths()[\"purelib\"])")
        names=()
        for d in "$sp"/*.dist-info; do
            [ -f "$d/METADATA" ] && [ "$(stat -c %Y "$d")" -gt "$btime" ] || continue
            names+=("$(sed -n "s/^Name: *//p" "$d/METADATA" | head -n 1)")
        done
        if [ "${#names[@]}" != 0 ]; then
            echo "pyenv: uninstalling what was pip-installed after boot: ${names[*]}"
            PIP_DISABLE_PIP_VERSION_CHECK=1 python3 -m pip uninstall -y -q --root-user-action=ignore "${names[@]}"
        else
            echo "pyenv: nothing pip-installed after boot"
        fi
        pyenv rehash
        echo "base image:"
        echo "  $(python3 --version) at $(pyenv which python3)"
        echo "  $(cargo --version), $(rustc --version)"
        echo "  rust toolchains: $(rustup toolchain list | tr "\n" " ")"
        echo "  $(git --version), $(gcc --version | sed -n 1p), $(make --version | sed -n 1p)"
        echo "  trusted CA certificates: $(grep -c "BEGIN CERTIFICATE" /etc/ssl/certs/ca-certificates.crt) ($(ls /usr/local/share/ca-certificates | wc -l) local)"
        import_ok=$(python3 -c "import ssl, ctypes, zlib, bz2, lzma, sqlite3; print(\"ok\")")
        echo "  pyenv Python stdlib (ssl, ctypes, zlib, bz2, lzma, sqlite3): $import_ok"
        # The check means nothing if any of this is already here.
        present=()
        for c in vng busybox qemu-system-x86_64 sparse dkms fio dmsetup file pgrep; do
            command -v "$c" >/dev/null 2>&1 && present+=("$c")
        done
        ls /boot/vmlinuz-* >/dev/null 2>&1 && present+=(/boot/vmlinuz-*)
        if [ "${#present[@]}" != 0 ]; then
            echo "not a bare base image: already present: ${present[*]}"
            exit 1
        fi
        echo "  not present yet (as expected): vng busybox qemu sparse dkms fio dmsetup file pgrep, a kernel"'
}

do_copy_repo() {
    local dest=$R$CREPO
    remove_tree "$dest"
    mkdir -p "$dest"
    if [ "$WORKTREE" = 1 ]; then
        log "copying the working tree of $REPO (HEAD $(git -C "$REPO" rev-parse --short HEAD), uncommitted changes and untracked files included)"
        git -C "$REPO" status --short | sed 's/^/    /'
        (cd "$REPO" && git ls-files -z -c -o --exclude-standard |
            while IFS= read -r -d '' f; do
                if [ -e "$f" ] || [ -L "$f" ]; then printf '%s\0' "$f"; fi
            done | tar --null -T - -cf -) | tar -C "$dest" -xf -
    else
        log "copying the committed HEAD of $REPO ($(git -C "$REPO" log -1 --format='%h %s'))"
        if [ "${#WITH[@]}" = 0 ] && [ -n "$(git -C "$REPO" status --porcelain --untracked-files=no)" ]; then
            log "note: the working tree has uncommitted changes that are NOT tested (use --worktree or --with)"
        fi
        git -C "$REPO" archive --format=tar HEAD | tar -C "$dest" -xf -
        local p
        for p in "${WITH[@]}"; do
            log "with $p from the working tree"
            (cd "$REPO" && tar -cf - "$p") | tar -C "$dest" -xf -
        done
    fi
    echo "$(find "$dest" -type f | wc -l) files in $CREPO"
}

do_install_deps() { in_chroot 'scripts/install-deps.sh'; }

do_install_deps_again() {
    local out
    out=$(in_chroot 'scripts/install-deps.sh') || { echo "$out"; return 1; }
    echo "$out"
    if grep -Eq 'installing|unpacking|adding component|apt-get update|written to' <<<"$out"; then
        echo "install-deps.sh installed something on its second run: it is not idempotent"
        return 1
    fi
}

do_make() { in_chroot 'make'; }
do_static() { in_chroot 'make static'; }
do_dkms() { in_chroot 'scripts/dkms-check.sh'; }
do_tools() { in_chroot 'tools/run-tests.sh && cd tools && cargo build -q --locked --release --bin dedup'; }
do_kunit() { in_chroot 'scripts/kunit.sh'; }

# shellcheck disable=SC2016
do_guest_prereqs() {
    in_chroot '
        fail=0
        ok() { printf "prereq: ok       %s\n" "$*"; }
        bad() { printf "prereq: MISSING  %s\n" "$*"; fail=1; }
        need() { local c p; for c; do if p=$(command -v "$c"); then ok "$c ($p)"; else bad "command $c"; fi; done; }

        echo "-- the host side of a guest run (guest-run.sh, vng, QEMU)"
        need vng qemu-system-x86_64 busybox file flock timeout pgrep modprobe depmod
        if vng --help >/dev/null 2>&1; then ok "vng --help ($(vng --version 2>&1 | head -n 1))"; else bad "vng --help fails"; fi
        if ! bb=$(command -v busybox); then
            bad "busybox for the initramfs (busybox-static)"
        elif ! command -v file >/dev/null; then
            bad "file(1): vng runs it to check that $bb is statically linked"
        elif ftype=$(file -L "$bb") && [[ "$ftype" == *"statically linked"* || "$ftype" == *"static-pie linked"* ]]; then
            ok "$bb is statically linked (virtme-ng puts it in the initramfs)"
        else
            bad "a statically linked busybox (busybox-static); $ftype"
        fi
        qv=$(dpkg-query -W -f="\${Version}" qemu-system-x86 2>/dev/null || true)
        if [[ "$qv" == *bpo* ]]; then ok "qemu-system-x86 $qv (backports)"; else bad "qemu-system-x86 from bookworm-backports (have: ${qv:-none})"; fi

        echo "-- the guest kernel"
        if KVER=$(scripts/guest-run.sh --print-kver); then
            ok "guest kernel /boot/vmlinuz-$KVER"
            [ -f "/lib/modules/$KVER/modules.dep" ] && ok "/lib/modules/$KVER/modules.dep" || bad "/lib/modules/$KVER/modules.dep"
            [ -d "/usr/src/linux-headers-$KVER" ] && ok "/usr/src/linux-headers-$KVER" || bad "/usr/src/linux-headers-$KVER"
            for m in dm-mod dm-bufio libcrc32c crc32c loop null_blk configfs dm-flakey dm-log-writes; do
                if modinfo -k "$KVER" -F filename "$m" >/dev/null 2>&1; then ok "module $m"; else bad "module $m in $KVER"; fi
            done
            ko=dm-dedup/dm-dedup.ko
            if [ -f "$ko" ]; then
                vm=$(modinfo -F vermagic "$ko")
                if [[ "$vm" == "$KVER "* ]]; then ok "$ko vermagic $vm"; else bad "$ko built for $KVER (vermagic: $vm)"; fi
                for m in $(modinfo -F depends "$ko" | tr , " "); do
                    if modinfo -k "$KVER" -F filename "$m" >/dev/null 2>&1; then ok "dependency $m of $ko"; else bad "dependency $m of $ko"; fi
                done
            else
                bad "$ko (make)"
            fi
        else
            bad "a guest kernel /boot/vmlinuz-6.12.*-amd64 with /lib/modules"
            KVER=
        fi

        echo "-- what the guest suite and the demo run (the guest sees this root file system)"
        need dmsetup mkfs.ext4 fsck.ext4 mkfs.xfs xfs_repair blkdiscard blockdev losetup \
             udevadm insmod rmmod lsmod modinfo dmesg mount umount mountpoint truncate \
             sha256sum tar find awk fio pvcreate vgcreate lvcreate lvextend vgremove \
             blktrace blkparse ip nsenter rpcbind rpc.nfsd rpc.mountd exportfs mount.nfs4 \
             iscsid iscsiadm qemu-img
        if /bin/python3 -c "import rtslib_fb" 2>/dev/null; then ok "rtslib_fb for /bin/python3 (LIO)"; else bad "rtslib_fb for /bin/python3 (python3-rtslib-fb)"; fi
        if /bin/python3 -c "import pytest" 2>/dev/null; then ok "pytest for /bin/python3 ($(/bin/python3 -m pytest --version 2>&1 | head -n 1))"; else bad "pytest for /bin/python3 (python3-pytest)"; fi
        if [ -x tools/target/release/dedup ] && tools/target/release/dedup --version >/dev/null; then
            ok "tools/target/release/dedup ($(tools/target/release/dedup --version))"
        else
            bad "tools/target/release/dedup (cd tools && cargo build --release)"
        fi

        echo "-- the initramfs: vng --dry-run builds it as a boot does, then stops before QEMU"
        if [ -n "$KVER" ]; then
            if out=$(vng --dry-run --disable-kvm --run "/boot/vmlinuz-$KVER" --memory 4G --cpus 2 --exec true 2>&1) &&
               grep -q -- "-initrd" <<<"$out"; then
                ok "vng --dry-run (the QEMU command line has an -initrd)"
            else
                printf "%s\n" "$out" | tail -n 20
                bad "vng --dry-run"
            fi
        fi
        [ "$fail" = 0 ] || echo "guest prerequisites missing (lines MISSING above)"
        exit "$fail"'
}

GUEST_LOCK=/tmp/dm-dedup-guest.lock
do_boot() {
    # The chroot has its own /tmp: hold the host's guest lock here, so that no
    # guest-run.sh on the host starts a second QEMU meanwhile.
    local cmd
    # shellcheck disable=SC2016
    cmd='for m in $(modinfo -F depends dm-dedup/dm-dedup.ko | tr , " "); do modprobe "$m"; done
insmod dm-dedup/dm-dedup.ko && dmsetup targets | grep -w dedup'
    exec 7>"$GUEST_LOCK"
    if ! flock -n 7; then
        log "another guest is running (host lock $GUEST_LOCK); waiting for it"
        flock 7
    fi
    in_chroot "GUEST_TIMEOUT=900 scripts/guest-run.sh -- $(printf '%q' "$cmd")"
}

# --- main ---------------------------------------------------------------------
if [ "$WORKTREE" = 1 ]; then
    [ "${#WITH[@]}" = 0 ] || die "--worktree and --with exclude each other"
    WHAT="the working tree"
else
    WHAT="HEAD${WITH[*]:+ with ${WITH[*]} from the working tree}"
fi
for p in "${WITH[@]}"; do
    [[ "$p" != /* && "$p" != *..* ]] || die "--with $p: give a path relative to the top of the repository"
    [ -e "$REPO/$p" ] || die "--with $p: no such path in $REPO"
done
log "work directory $DIR; mirror ${MIRROR:-(debootstrap default)}; testing $WHAT"
step bootstrap do_bootstrap
step chroot-setup do_chroot_setup
step base-image do_base_image
step copy-repo do_copy_repo
step install-deps do_install_deps
step install-deps-again do_install_deps_again
step make do_make
step static do_static
step dkms do_dkms
step tools do_tools
step guest-prereqs do_guest_prereqs
[ "$KUNIT" = 0 ] || step kunit do_kunit
[ "$BOOT" = 0 ] || step boot do_boot
summary
log "PASSED$([ "$REMOVE" = 1 ] || echo "; the chroot stays in $R (unmounted) until the next run")"
