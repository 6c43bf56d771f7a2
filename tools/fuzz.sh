#!/usr/bin/env bash
# Bounded fuzzing: run every cargo-fuzz target of tools/fuzz for
# SECONDS_PER_TARGET seconds (default 30) on its corpus, print per target
# the executions and the findings, and exit non-zero if any target found
# a crash (or a leak, timeout or out-of-memory input).
#
#   tools/fuzz.sh            # 30 s per target
#   tools/fuzz.sh 300        # 5 min per target
#
# Needs a nightly toolchain and cargo-fuzz (tools/install-fuzz.sh). The
# build uses CARGO_BUILD_JOBS (default 1: the machine is shared). Findings
# go to fuzz/artifacts/<target>/; reproduce one with
#   cd tools/fuzz && cargo +nightly fuzz run --sanitizer none <target> <file>
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/fuzz"

secs=${1:-30}
case $secs in
'' | *[!0-9]*)
	echo "usage: $0 [SECONDS_PER_TARGET]" >&2
	exit 16
	;;
esac
export CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-1}

if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
	echo "fuzz.sh: cargo-fuzz on a nightly toolchain is needed: run tools/install-fuzz.sh" >&2
	exit 8
fi

# The starting corpora are generated, not committed.
targets=$(cargo +nightly fuzz list)
for t in $targets; do
	if [ ! -d "corpus/$t" ]; then
		./make-corpus.sh >/dev/null
		break
	fi
done

# Optimised, with debug assertions and overflow checks (cargo-fuzz's
# default), without AddressSanitizer: the code under test is safe Rust, so
# ASan would only halve the executions.
flags=(--sanitizer none)
start=$(date +%s)
blog=$(mktemp)
if ! cargo +nightly fuzz build "${flags[@]}" >"$blog" 2>&1; then
	cat "$blog" >&2
	rm -f "$blog"
	echo "fuzz.sh: the fuzz targets do not build" >&2
	exit 8
fi
rm -f "$blog"
echo "build: $(($(date +%s) - start)) s (CARGO_BUILD_JOBS=$CARGO_BUILD_JOBS)"

# Metadata images need room: the corpus holds 128 KiB images (the start of
# an image; the targets read the rest as zeros). A journal_parse input is
# a 16-byte head and up to 16 blocks.
max_len() {
	case $1 in
	check_image | repair_image) echo 140000 ;;
	journal_parse) echo 70000 ;;
	*) echo 65536 ;;
	esac
}

failed=0
echo "target              execs     per s  coverage  findings (${secs} s each)"
for t in $targets; do
	mkdir -p "corpus/$t" "artifacts/$t"
	seeds=()
	[ -d "seeds/$t" ] && seeds=("seeds/$t")
	before=$(find "artifacts/$t" -type f | wc -l)
	log=$(mktemp)
	set +e
	cargo +nightly fuzz run "${flags[@]}" "$t" "corpus/$t" "${seeds[@]}" -- \
		-max_total_time="$secs" -max_len="$(max_len "$t")" -timeout=60 \
		-print_final_stats=1 >"$log" 2>&1
	rc=$?
	set -e
	runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
	[ -n "$runs" ] || runs=$(sed -n 's/^Done \([0-9]*\) runs.*/\1/p' "$log" | tail -1)
	cov=$(sed -n 's/.*cov: \([0-9]*\).*/\1/p' "$log" | tail -1)
	after=$(find "artifacts/$t" -type f | wc -l)
	found=$((after - before))
	line=$(printf '%-14s %10s  %8.0f  %8s  %d' "$t" "${runs:-?}" \
		"$(awk -v r="${runs:-0}" -v s="$secs" 'BEGIN { print r / s }')" "${cov:-?}" "$found")
	if [ "$rc" -ne 0 ] || [ "$found" -ne 0 ]; then
		failed=1
		line="$line  FAILED (exit $rc)"
		echo "== $t: last lines of the libFuzzer log:" >&2
		tail -n 40 "$log" >&2
		find "artifacts/$t" -type f -newer "$log" -printf '   finding: %p\n' >&2 || true
	fi
	echo "$line"
	rm -f "$log"
done

if [ "$failed" -ne 0 ]; then
	echo "fuzz.sh: findings (see fuzz/artifacts/)" >&2
	exit 1
fi
echo "fuzz.sh: no findings"
