#!/usr/bin/env bash
# Every test of the userspace tools: formatting, lints, unit and end-to-end
# tests (including the deterministic stand-in for the fuzz targets).
# Exits non-zero on the first failure. Cargo uses every CPU (CI runs this
# before it boots the guest); CARGO_BUILD_JOBS=1 spares a guest that is
# timing something.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo clippy (warnings are errors)"
cargo clippy --all-targets --locked -- -D warnings

echo "== cargo test"
cargo test --locked

# The fuzz crate must at least build when a nightly toolchain and
# cargo-fuzz are there (it is not part of the stable workspace).
if [ "${DEDUP_FUZZ_BUILD:-0}" = 1 ]; then
	echo "== cargo +nightly fuzz build"
	(cd fuzz && cargo +nightly fuzz build)
fi

echo "== all tools tests passed"
