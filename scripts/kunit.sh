#!/usr/bin/env bash
# KUnit suite of dm-dedup, under User Mode Linux, in one command.
#
#   scripts/kunit.sh [kunit.py run arguments, e.g. 'dm_dedup_index.*']
#
# Builds its own kernel tree from Debian's linux-source-6.12 and never
# changes the installed one:
#   WORK/linux   a hard-link farm of the 6.12 sources (cp -al) in which only
#                drivers/md/Kconfig and drivers/md/Makefile are real copies,
#                each with one hook line, and drivers/md/dedup is a synced
#                copy of the repository's dm-dedup/ sources
#   WORK/build   kunit.py's build directory, kept between runs: the first
#                build takes ~10 minutes on 2 cores, later ones seconds
#   WORK/src     the unpacked tarball, only when /usr/src holds no full tree
#
# dm-dedup/ is copied rather than symlinked because its out-of-tree build
# leaves objects next to the sources, and make would pick those up through
# VPATH instead of building the UML ones.
#
# Exits non-zero if the configuration or build fails or any test fails.
# kunit.py's output and the raw kernel log go to OUT/kunit.log, the parsed
# results to OUT/kunit.json.
#
# Environment:
#   DEDUP_KUNIT_DIR  work directory (default /var/tmp/dm-dedup-kunit)
#   DEDUP_TEST_OUT   output directory (default <repo>/tests/out)
#   KUNIT_SRC        kernel source tree (default /usr/src/linux-source-6.12)
#   KUNIT_JOBS       parallel make jobs (default 2)
#   KUNIT_TIMEOUT    seconds the test kernel may run (default 600)
set -euo pipefail
exec </dev/null

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SRC=${KUNIT_SRC:-/usr/src/linux-source-6.12}
TARBALL=${SRC%/}.tar.xz
WORK=${DEDUP_KUNIT_DIR:-/var/tmp/dm-dedup-kunit}
OUT=${DEDUP_TEST_OUT:-$REPO/tests/out}
JOBS=${KUNIT_JOBS:-2}
TIMEOUT=${KUNIT_TIMEOUT:-600}
TREE=$WORK/linux
BUILD=$WORK/build
LOG=$OUT/kunit.log

say() { printf 'kunit: %s\n' "$*"; }
die() { printf 'kunit: ERROR: %s\n' "$*" >&2; exit 1; }

mkdir -p "$WORK" "$OUT"
exec 9>"$WORK/lock"
flock -n 9 || { say "waiting for another run on $WORK"; flock 9; }

# --- tools the UML build needs ---------------------------------------------
need=()
for t in gcc make flex bison bc perl python3 rsync xz tar; do
	command -v "$t" >/dev/null 2>&1 || need+=("$t")
done
if [ "${#need[@]}" != 0 ]; then
	if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
		die "missing tools: ${need[*]}"
	fi
	say "installing build tools (missing: ${need[*]})"
	DEBIAN_FRONTEND=noninteractive apt-get -y -q install \
		build-essential flex bison bc perl python3 rsync xz-utils tar \
		>"$WORK/apt.log" 2>&1 || { tail -n 20 "$WORK/apt.log" >&2; die "apt-get install failed"; }
fi

# --- a complete source tree ------------------------------------------------
# install-deps.sh may have unpacked nothing but checkpatch.pl into $SRC.
if [ ! -f "$SRC/Makefile" ] || [ ! -f "$SRC/tools/testing/kunit/kunit.py" ]; then
	name=$(basename "$SRC")
	# Unpacked again when the tarball changed (a linux-source upgrade).
	stamp=$(stat -c '%s %Y' "$TARBALL" 2>/dev/null || true)
	if [ ! -f "$WORK/src/$name/tools/testing/kunit/kunit.py" ] ||
	   { [ -f "$TARBALL" ] &&
	     [ "$(cat "$WORK/src/.tarball" 2>/dev/null)" != "$stamp" ]; }; then
		[ -f "$TARBALL" ] || die "no kernel tree at $SRC and no $TARBALL (install linux-source-6.12)"
		say "unpacking $TARBALL into $WORK/src (about a minute)"
		rm -rf "$WORK/src.tmp"
		mkdir -p "$WORK/src.tmp"
		tar -C "$WORK/src.tmp" -xf "$TARBALL"
		[ -f "$WORK/src.tmp/$name/tools/testing/kunit/kunit.py" ] ||
			die "$TARBALL does not hold $name/tools/testing/kunit/kunit.py"
		echo "$stamp" >"$WORK/src.tmp/.tarball"
		rm -rf "$WORK/src"
		mv "$WORK/src.tmp" "$WORK/src"
	fi
	SRC=$WORK/src/$name
fi

# --- the hard-link farm ----------------------------------------------------
# Rebuilt whenever the source tree behind it changes (package upgrade).
stamp="$SRC $(stat -c '%i %Y' "$SRC/Makefile")"
if [ ! -f "$TREE/Makefile" ] || [ "$(cat "$WORK/linux.stamp" 2>/dev/null)" != "$stamp" ]; then
	say "creating the kernel tree $TREE from $SRC"
	rm -rf "$TREE" "$TREE.tmp"
	if ! cp -al "$SRC" "$TREE.tmp" 2>/dev/null; then
		say "hard links impossible (other filesystem?): copying the tree"
		rm -rf "$TREE.tmp"
		cp -a "$SRC" "$TREE.tmp"
	fi
	rm -rf "$TREE.tmp/drivers/md/dedup"
	mv "$TREE.tmp" "$TREE"
	printf '%s\n' "$stamp" >"$WORK/linux.stamp"
fi

# Replace a farm file by a real file with new content. The new file is made
# beside it and renamed over it, so the original's inode (shared with $SRC)
# is never written. Unchanged content keeps the old file and its mtime, so
# make does not re-run Kconfig or rebuild.
replace() { # replace <farm path> <content file>
	if cmp -s "$2" "$1"; then
		rm -f "$2"
	else
		mv -f "$2" "$1"
	fi
	[ "$(stat -c %i "$1")" != "$(stat -c %i "$SRC/${1#"$TREE"/}")" ] ||
		die "$1 is still a hard link into $SRC"
}

md=$TREE/drivers/md
awk -v hook='source "drivers/md/dedup/Kconfig"' '
	{ line[NR] = $0 }
	/^endif/ { last = NR }
	END {
		if (!last) exit 1
		for (i = 1; i <= NR; i++) {
			if (i == last) print hook "\n"
			print line[i]
		}
	}' "$SRC/drivers/md/Kconfig" >"$md/Kconfig.dedup" ||
	die "no closing endif in $SRC/drivers/md/Kconfig"
replace "$md/Kconfig" "$md/Kconfig.dedup"
# shellcheck disable=SC2016 # a make variable, not a shell one
{ cat "$SRC/drivers/md/Makefile"; echo 'obj-$(CONFIG_DM_DEDUP) += dedup/'; } >"$md/Makefile.dedup"
replace "$md/Makefile" "$md/Makefile.dedup"

# Content comparison, not times: a changed file gets a new mtime (make
# rebuilds it), an unchanged one is left alone.
mkdir -p "$md/dedup"
rsync -r --checksum --delete --exclude='*.mod.c' --include='*.c' --include='*.h' \
	--include=Kbuild --include=Kconfig --exclude='*' \
	"$REPO/dm-dedup/" "$md/dedup/"

# --- build and run -----------------------------------------------------------
say "kunit.py run --arch=um --build_dir=$BUILD --jobs=$JOBS $*"
rm -f "$LOG" "$OUT/kunit.json" "$BUILD/test.log"
start=$(date +%s)
rc=0
(cd "$TREE" && PYTHONDONTWRITEBYTECODE=1 python3 tools/testing/kunit/kunit.py run \
	--arch=um --kunitconfig="$REPO/dm-dedup/.kunitconfig" \
	--build_dir="$BUILD" --jobs="$JOBS" --timeout="$TIMEOUT" \
	--json="$OUT/kunit.json" "$@") 2>&1 | tee "$LOG" || rc=$?
end=$(date +%s)
if [ -f "$BUILD/test.log" ]; then
	{ echo; echo "---- raw kernel output ($BUILD/test.log) ----"; cat "$BUILD/test.log"; } >>"$LOG"
fi

# kunit.py can succeed on a kernel in which none of our tests ran, e.g.
# when the configuration lost CONFIG_DM_DEDUP_KUNIT_TEST.
if [ "$rc" = 0 ] && [ "$#" = 0 ] &&
	! grep -qE '^[[:space:]]*ok [0-9]+ dm_dedup_' "$BUILD/test.log" 2>/dev/null; then
	say "no dm_dedup suite passed in the kernel output"
	rc=1
fi
say "finished in $((end - start)) s, status $rc; log: $LOG"
exit "$rc"
