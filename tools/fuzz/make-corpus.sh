#!/usr/bin/env bash
# Build the starting corpora of the fuzz targets into fuzz/corpus/ from the
# committed seeds: metadata images made by `dedup format` and `dedup restore`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
cargo build -q -j1 --manifest-path ../Cargo.toml
dedup=../target/debug/dedup
mkdir -p corpus/check_image corpus/repair_image corpus/restore_dump corpus/stats_parse
cp seeds/restore_dump/* corpus/restore_dump/
cp seeds/stats_parse/* corpus/stats_parse/
img=corpus/check_image
truncate -s 32K "$img/formatted" && $dedup format "$img/formatted" --data-blocks 60 --logical-blocks 200 --force --format-time 1 >/dev/null
truncate -s 128K "$img/restored" && $dedup restore seeds/restore_dump/small.json "$img/restored" --force >/dev/null
# repair_image: the same images, and the restored one with a flipped byte
# in its map leaf (block 2) and in its fingerprint leaf (block 4), so that
# the salvage path is reached from the start.
rep=corpus/repair_image
cp "$img/formatted" "$img/restored" "$rep/"
flip() { # FILE BLOCK OFFSET
	local off=$(($2 * 4096 + $3)) b
	b=$(od -An -tu1 -j "$off" -N1 "$1")
	printf '%b' "$(printf '\\0%03o' $((b ^ 0x10)))" | dd of="$1" bs=1 seek="$off" conv=notrunc status=none
}
cp "$img/restored" "$rep/map-leaf-damaged" && flip "$rep/map-leaf-damaged" 2 100
cp "$img/restored" "$rep/fp-leaf-damaged" && flip "$rep/fp-leaf-damaged" 4 100
echo "corpora in $(pwd)/corpus"
