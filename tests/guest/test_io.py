"""Data path: exact dedup accounting, overwrites of shared blocks, zero
blocks, unwritten blocks, discard and write-zeroes.

All writes are O_DIRECT, one 4 KiB block per write, with deterministic
content (ddlib.block_data: content = PRNG(seed, id); duplicates reuse ids).
Space counters that can only drop when blocks are freed are read after a
`dmsetup message <dev> 0 commit` (a design may release freed blocks at commit).
"""

import os
import random

import pytest

import ddlib
from ddlib import BLOCK, ZERO, BlockDev, block_data, verify_blocks, write_ids


def expected_from(layout, seed, start=0):
    return {start + i: block_data(seed, b) for i, b in enumerate(layout)}


# ---------------------------------------------------------------------------
# exact accounting
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dup_pct", [0, 50, 75, 100])
def test_exact_accounting(dedup, seed, dup_pct):
    """N distinct blocks, then M more blocks of which dup_pct % repeat earlier
    contents: used == distinct contents, mapped == blocks written."""
    N, M = 48, 48
    ndup = M * dup_pct // 100
    phase2 = [i % N for i in range(ndup)] + [1000 + i for i in range(M - ndup)]
    random.Random(seed).shuffle(phase2)
    layout = list(range(N)) + phase2
    exp = write_ids(dedup.path, seed, layout)
    st = dedup.status()
    distinct = len(set(layout))
    assert distinct == N + M - ndup
    assert st["data_used"] == distinct, st
    assert st["mapped"] == len(layout), st
    assert st["unique_writes"] == distinct, st
    assert st["duplicate_writes"] == ndup, st
    assert st["zero_writes"] == 0, st
    assert st["discarded"] == 0, st
    verify_blocks(dedup.path, exp, nblocks=len(layout) + 64)


def test_same_content_everywhere(dedup, seed):
    layout = [7] * 64
    exp = write_ids(dedup.path, seed, layout)
    st = dedup.status()
    assert (st["data_used"], st["mapped"], st["unique_writes"], st["duplicate_writes"]) == \
        (1, 64, 1, 63), st
    verify_blocks(dedup.path, exp, nblocks=128)


def test_duplicates_across_distant_lbas(dedup, seed):
    """Duplicates far apart in the logical space (different map pages)."""
    lbas = [0, 1, 4095, 4096, 30000, dedup.nblocks - 1]
    exp = {}
    with BlockDev(dedup.path) as bd:
        for i, lba in enumerate(lbas):
            exp[lba] = block_data(seed, i % 2)
            bd.write(lba, exp[lba])
    st = dedup.status()
    assert (st["data_used"], st["mapped"], st["duplicate_writes"]) == (2, len(lbas), 4), st
    verify_blocks(dedup.path, exp)


def test_verify_option_accounting(make_dedup, seed):
    """With a weak hash + verify the accounting is the same as with sha256."""
    d = make_dedup(opts=["hash", "crc32c", "verify"])
    layout = list(range(32)) + list(range(16)) + [100 + i for i in range(8)]
    exp = write_ids(d.path, seed, layout)
    st = d.status()
    assert (st["data_used"], st["mapped"], st["duplicate_writes"]) == (40, 56, 16), st
    verify_blocks(d.path, exp, nblocks=len(layout) + 8)


# ---------------------------------------------------------------------------
# overwrites
# ---------------------------------------------------------------------------
def test_overwrite_shared_block_keeps_sharers(dedup, seed):
    A, B = block_data(seed, 1), block_data(seed, 2)
    with BlockDev(dedup.path) as bd:
        for lba in (0, 1, 2):
            bd.write(lba, A)
        assert dedup.status()["data_used"] == 1
        bd.write(1, B)
    assert [dedup_read(dedup, l) for l in (0, 1, 2)] == [A, B, A]
    dedup.commit()
    st = dedup.status()
    assert st["data_used"] == 2, st
    assert st["mapped"] == 3, st
    assert (st["unique_writes"], st["duplicate_writes"]) == (2, 2), st


def test_overwrite_last_sharer_frees_block(dedup, seed):
    A, B, C = (block_data(seed, i) for i in (1, 2, 3))
    with BlockDev(dedup.path) as bd:
        bd.write(0, A)
        bd.write(1, A)
        bd.write(0, B)        # A still used by LBA 1
        bd.write(1, C)        # A unreferenced now
    dedup.commit()
    st = dedup.status()
    assert st["data_used"] == 2 and st["mapped"] == 2, st
    verify_blocks(dedup.path, {0: B, 1: C}, nblocks=8)


def test_rewrite_same_content_same_lba(dedup, seed):
    A = block_data(seed, 5)
    with BlockDev(dedup.path) as bd:
        bd.write(3, A)
        before = dedup.status()
        bd.write(3, A)
    dedup.commit()
    st = dedup.status()
    assert (st["data_used"], st["mapped"]) == (1, 1), st
    assert st["unique_writes"] == before["unique_writes"], st
    assert st["duplicate_writes"] == before["duplicate_writes"] + 1, st
    verify_blocks(dedup.path, {3: A}, nblocks=8)


def test_overwrite_swaps_contents(dedup, seed):
    """Swap the contents of two LBAs: no block may be freed too early."""
    A, B = block_data(seed, 1), block_data(seed, 2)
    with BlockDev(dedup.path) as bd:
        bd.write(0, A)
        bd.write(1, B)
        bd.write(0, B)
        bd.write(1, A)
    dedup.commit()
    assert dedup.status()["data_used"] == 2
    verify_blocks(dedup.path, {0: B, 1: A}, nblocks=8)


def dedup_read(d, lba):
    with BlockDev(d.path) as bd:
        return bd.read(lba)


# ---------------------------------------------------------------------------
# zero blocks, unwritten blocks
# ---------------------------------------------------------------------------
def test_unwritten_blocks_read_zeros(dedup):
    with BlockDev(dedup.path) as bd:
        head = bd.read_range(0, 256)
        tail = bd.read_range(dedup.nblocks - 256, 256)
    assert all(b == ZERO for b in head + tail)
    st = dedup.status()
    assert st["data_used"] == 0 and st["mapped"] == 0


def test_zero_blocks_use_no_space(dedup, seed):
    exp = write_ids(dedup.path, seed, [None] * 32)
    st = dedup.status()
    assert st["zero_writes"] == 32, st
    assert st["data_used"] == 0, st
    assert st["unique_writes"] == 0 and st["duplicate_writes"] == 0, st
    verify_blocks(dedup.path, exp, nblocks=64)


def test_zero_blocks_mixed_with_data(dedup, seed):
    layout = [None if i % 3 == 0 else i for i in range(60)]
    exp = write_ids(dedup.path, seed, layout)
    nz = sum(1 for b in layout if b is None)
    st = dedup.status()
    assert st["zero_writes"] == nz, st
    assert st["data_used"] == len(layout) - nz, st
    assert st["mapped"] == len(layout) - nz, st
    verify_blocks(dedup.path, exp, nblocks=64)


def test_zero_overwrite_unmaps_and_frees(dedup, seed):
    A, B = block_data(seed, 1), block_data(seed, 2)
    with BlockDev(dedup.path) as bd:
        bd.write(0, A)
        bd.write(1, B)
        bd.write(2, B)
        bd.write(0, ZERO)      # last reference of A
        bd.write(1, ZERO)      # B still referenced by LBA 2
    dedup.commit()
    st = dedup.status()
    assert st["data_used"] == 1, st
    assert st["mapped"] == 1, st
    assert st["zero_writes"] == 2, st
    verify_blocks(dedup.path, {2: B}, nblocks=8)


# ---------------------------------------------------------------------------
# discard / write zeroes
# ---------------------------------------------------------------------------
def test_discard_whole_device(dedup, seed):
    layout = [i % 40 for i in range(64)]
    write_ids(dedup.path, seed, layout)
    assert dedup.status()["data_used"] == 40
    ddlib.run(["blkdiscard", dedup.path])
    dedup.commit()
    st = dedup.status()
    assert st["mapped"] == 0, st
    assert st["data_used"] == 0, st
    assert st["discarded"] == 64, st
    verify_blocks(dedup.path, {}, nblocks=128)


def test_discard_partial_range(dedup, seed):
    layout = [i % 40 for i in range(64)]          # LBAs 40..63 share ids 0..23
    exp = write_ids(dedup.path, seed, layout)
    ddlib.discard(dedup.path, 16, 32)             # LBAs 16..47
    for lba in range(16, 48):
        del exp[lba]
    dedup.commit()
    st = dedup.status()
    remaining_ids = {layout[l] for l in exp}
    assert st["mapped"] == 32, st
    assert st["data_used"] == len(remaining_ids) == 24, st
    assert st["discarded"] == 32, st
    verify_blocks(dedup.path, exp, nblocks=128)


def test_discard_never_mapped_range(dedup, seed):
    exp = write_ids(dedup.path, seed, list(range(16)))
    before = dedup.status()
    ddlib.discard(dedup.path, 1000, 1000)
    ddlib.discard(dedup.path, dedup.nblocks - 8, 8)
    dedup.commit()
    st = dedup.status()
    assert ddlib.counters(st) == ddlib.counters(before), (before, st)
    verify_blocks(dedup.path, exp, nblocks=64)


def test_discard_then_rewrite(dedup, seed):
    exp = write_ids(dedup.path, seed, list(range(32)))
    ddlib.discard(dedup.path, 0, 32)
    dedup.commit()
    exp = write_ids(dedup.path, seed, list(range(16)) + [200 + i for i in range(16)])
    st = dedup.status()
    assert st["data_used"] == 32 and st["mapped"] == 32, st
    verify_blocks(dedup.path, exp, nblocks=64)


def test_write_zeroes_range(dedup, seed):
    """BLKZEROOUT (write zeroes, or zero-filled writes when the target does
    not advertise it): the range reads zeros and its space is freed."""
    layout = list(range(32))
    exp = write_ids(dedup.path, seed, layout)
    ddlib.zeroout(dedup.path, 8, 16)
    for lba in range(8, 24):
        del exp[lba]
    dedup.commit()
    st = dedup.status()
    assert st["mapped"] == 16, st
    assert st["data_used"] == 16, st
    verify_blocks(dedup.path, exp, nblocks=64)


def test_discard_passdown_frees_backing_space(make_dedup, backing, seed):
    """With discard_passdown, freed physical blocks are discarded on the data
    device: the tmpfs file under the data loop device shrinks."""
    d = make_dedup(opts=["discard_passdown"])
    data_file = backing.files[-1]
    write_ids(d.path, seed, [1000 + i for i in range(256)])     # 1 MiB unique
    d.commit()
    used_before = os.stat(data_file).st_blocks * 512
    ddlib.run(["blkdiscard", d.path])
    d.commit()
    used_after = os.stat(data_file).st_blocks * 512
    assert d.status()["data_used"] == 0
    assert used_before - used_after >= 256 * BLOCK, (used_before, used_after)


def test_discard_passdown_never_lands_on_reused_blocks(make_dedup, seed):
    """A commit discards the blocks it freed after it lets writers go on
    again, and hands them out only when the discard is done. The data
    device is full, everything is discarded, and four writers at once need
    every freed block back (they wait for the commit, which their own
    no-space waits start): what they wrote must read back, not the zeros a
    discard leaves on the tmpfs-backed data device. That the allocator
    never hands out a held block is KUnit's dm_dedup_space hold_frees."""
    import threading
    d = make_dedup(data_mib=8, logical_mib=64, opts=["discard_passdown"])
    nblocks = 8 * 1024 * 1024 // BLOCK
    write_ids(d.path, seed, [i for i in range(nblocks)])
    assert d.status()["data_used"] == nblocks
    ddlib.run(["blkdiscard", "-o", "0", "-l", str(nblocks * BLOCK), d.path])
    per = nblocks // 4
    errors = []

    def writer(w):
        try:
            with BlockDev(d.path) as bd:
                for i in range(0, per, 16):
                    base = nblocks + w * per + i
                    bd.write_range(base, [block_data(seed, 100_000 + base + j)
                                          for j in range(16)])
        except Exception as e:          # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    expected = {lba: block_data(seed, 100_000 + lba)
                for lba in range(nblocks, 2 * nblocks)}
    verify_blocks(d.path, expected)
    st = d.stats()
    assert int(st["discard_passdown_blocks"]) >= nblocks, st
    d.commit()
    verify_blocks(d.path, expected)
