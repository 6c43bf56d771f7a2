#!/usr/bin/env bash
# Install what tools/fuzz.sh needs, if missing: a nightly Rust toolchain
# (minimal profile) and cargo-fuzz. Idempotent, and silent when both are
# already there. Needs rustup (https://rustup.rs) and a C compiler
# (libFuzzer is built from C++ sources by the libfuzzer-sys crate).
set -euo pipefail

if ! command -v rustup >/dev/null 2>&1; then
	echo "install-fuzz.sh: rustup is needed (https://rustup.rs)" >&2
	exit 8
fi
if ! rustup run nightly rustc --version >/dev/null 2>&1; then
	echo "install-fuzz.sh: installing the nightly toolchain (minimal profile)"
	rustup toolchain install nightly --profile minimal
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
	echo "install-fuzz.sh: installing cargo-fuzz"
	CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-1} cargo install cargo-fuzz --locked
fi
