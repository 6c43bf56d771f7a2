#!/usr/bin/env bash
# Build the starting corpora of the fuzz targets into fuzz/corpus/ from the
# committed seeds: metadata images made by `dedup format` and `dedup restore`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
cargo build -q -j1 --manifest-path ../Cargo.toml
dedup=../target/debug/dedup
mkdir -p corpus/check_image corpus/restore_dump corpus/stats_parse
cp seeds/restore_dump/* corpus/restore_dump/
cp seeds/stats_parse/* corpus/stats_parse/
img=corpus/check_image
truncate -s 32K "$img/formatted" && $dedup format "$img/formatted" --data-blocks 60 --logical-blocks 200 --force --format-time 1 >/dev/null
truncate -s 128K "$img/restored" && $dedup restore seeds/restore_dump/small.json "$img/restored" --force >/dev/null
echo "corpora in $(pwd)/corpus"
