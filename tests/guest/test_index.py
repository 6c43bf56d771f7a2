"""The fingerprint index covers every stored block.

The index keeps about 4 bytes per data block (a tag of the fingerprint and
the fingerprint leaf that holds its record), sized for a data device full
of unique content. These tests fill a whole data device with unique
blocks and then write every content again elsewhere: on a full device a
content the index had lost would need a new block and fail with ENOSPC,
so the rewrite succeeding with 100 % duplicates is the proof. It must
hold with the index as built by writes, as loaded from a clean close, and
as rebuilt by a walk of the trees.
"""

import ddlib
from ddlib import BlockDev, block_data, verify_blocks

DATA_MIB = 16                # 4096 data blocks: 32 full fingerprint leaves + 32
LOGICAL_MIB = 64             # room for the fill and three rewrites


def fill(dev, seed, ids, start):
    exp = {}
    with BlockDev(dev.path) as bd:
        for i, bid in enumerate(ids):
            data = block_data(seed, bid)
            bd.write(start + i, data)
            exp[start + i] = data
    return exp


def index_counts(dev):
    st = dev.stats()
    return int(st["index_entries"]), int(st["index_full"]), st["index_loaded"]


def rewrite_all(dev, seed, total, start):
    """Every stored content once more at LBAs start..: all duplicates."""
    before = dev.status()
    exp = fill(dev, seed, range(total), start)
    after = dev.status()
    assert after["duplicate_writes"] - before["duplicate_writes"] == total, (before, after)
    assert after["unique_writes"] == before["unique_writes"], (before, after)
    assert after["data_used"] == total, after
    return exp


def test_full_device_of_unique_blocks_rewrites_as_duplicates(make_dedup, seed):
    dev = make_dedup(meta_mib=16, data_mib=DATA_MIB, logical_mib=LOGICAL_MIB)
    total = dev.status()["data_total"]
    assert total == DATA_MIB * ddlib.MIB // ddlib.BLOCK
    exp = fill(dev, seed, range(total), 0)
    st = dev.status()
    assert st["data_used"] == total and st["unique_writes"] == total, st
    assert index_counts(dev)[:2] == (total, 0)

    # as the writes built it
    exp.update(rewrite_all(dev, seed, total, total))

    # as a clean close saved it and the next activation loaded it
    dev.remove()
    dev.activate()
    entries, full, loaded = index_counts(dev)
    assert (entries, full, loaded) == (total, 0, "1")
    exp.update(rewrite_all(dev, seed, total, 2 * total))

    # as a walk of the trees rebuilt it (a reload saves nothing)
    dev.reload()
    entries, full, loaded = index_counts(dev)
    assert (entries, full, loaded) == (total, 0, "0")
    exp.update(rewrite_all(dev, seed, total, 3 * total))

    verify_blocks(dev.path, exp, nblocks=dev.nblocks)
