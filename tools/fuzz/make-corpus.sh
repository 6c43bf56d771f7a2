#!/usr/bin/env bash
# Build the starting corpora of the fuzz targets into fuzz/corpus/ from the
# committed seeds: metadata images made by `dedup format` and `dedup
# restore`, and the journal seeds of dedup_tools::fuzzing.
#
# Every image is 9 MiB long. The tools write the trees from block 2 and
# never write the journal's run (64 blocks for these sizes), so an image
# is kept as its start only (32 or 128 KiB): the check_image and
# repair_image targets read the rest as zeros (fuzzing::expand_image).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
cargo build -q -j1 --manifest-path ../Cargo.toml --bin dedup --example journal-seeds
dedup=../target/debug/dedup
mkdir -p corpus/check_image corpus/repair_image corpus/restore_dump corpus/stats_parse \
	corpus/journal_parse
cp seeds/restore_dump/* corpus/restore_dump/
cp seeds/stats_parse/* corpus/stats_parse/
../target/debug/examples/journal-seeds corpus/journal_parse
img=corpus/check_image
# format: the run at block 2, the trees empty; restore: the trees from
# block 2, the run after them.
truncate -s 9M "$img/formatted" && $dedup format "$img/formatted" --data-blocks 60 --logical-blocks 200 --force --format-time 1 >/dev/null
truncate -s 32K "$img/formatted"
truncate -s 9M "$img/formatted-v1" && $dedup format "$img/formatted-v1" --data-blocks 60 --logical-blocks 200 --force --format-time 1 --format-version 1 >/dev/null
truncate -s 32K "$img/formatted-v1"
truncate -s 9M "$img/restored" && $dedup restore seeds/restore_dump/small.json "$img/restored" --force >/dev/null
truncate -s 128K "$img/restored"
# repair_image: the same images, and the restored one with a flipped byte
# in its map leaf (block 2) and in its fingerprint leaf (block 4), so that
# the salvage path is reached from the start.
rep=corpus/repair_image
cp "$img/formatted" "$img/formatted-v1" "$img/restored" "$rep/"
flip() { # FILE BLOCK OFFSET
	local off=$(($2 * 4096 + $3)) b
	b=$(od -An -tu1 -j "$off" -N1 "$1")
	printf '%b' "$(printf '\\0%03o' $((b ^ 0x10)))" | dd of="$1" bs=1 seek="$off" conv=notrunc status=none
}
cp "$img/restored" "$rep/map-leaf-damaged" && flip "$rep/map-leaf-damaged" 2 100
cp "$img/restored" "$rep/fp-leaf-damaged" && flip "$rep/fp-leaf-damaged" 4 100
echo "corpora in $(pwd)/corpus"
