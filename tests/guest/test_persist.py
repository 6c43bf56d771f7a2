"""Format and reopen: content and counters persist across remove/create and
across rmmod/insmod; the read_only option."""

import errno

import ddlib
from ddlib import BlockDev, block_data, verify_blocks, write_ids

# unique, duplicate and zero blocks
LAYOUT = [0, 1, 2, 3, 0, 1, None, 4, 4, 4, None, 5, 2, 6, 7, 0]


def test_format_and_reopen(dedup, seed):
    exp = write_ids(dedup.path, seed, LAYOUT)
    st1 = dedup.status()
    assert st1["data_used"] == 8 and st1["zero_writes"] == 2
    dedup.remove()
    dedup.activate()
    st2 = dedup.status()
    assert ddlib.counters(st2) == ddlib.counters(st1), (st1, st2)
    assert st2["mode"] == "rw"
    assert st2["meta_total"] == st1["meta_total"] and st2["data_total"] == st1["data_total"]
    verify_blocks(dedup.path, exp, nblocks=64)


def test_reopen_keeps_dedup_index(dedup, seed):
    """After a reopen, old contents are still found as duplicates."""
    write_ids(dedup.path, seed, list(range(16)))
    dedup.remove()
    dedup.activate()
    exp = write_ids(dedup.path, seed, list(range(16)), start=100)
    st = dedup.status()
    assert st["data_used"] == 16, st
    assert st["duplicate_writes"] == 16, st
    assert st["mapped"] == 32, st
    verify_blocks(dedup.path, exp)


def test_several_remove_create_cycles(dedup, seed):
    exp = {}
    for cycle in range(4):
        with BlockDev(dedup.path) as bd:
            for i in range(8):
                lba = cycle * 8 + i
                exp[lba] = block_data(seed, (cycle * 8 + i) % 12)
                bd.write(lba, exp[lba])
            # overwrite one earlier block each cycle
            if cycle:
                exp[cycle] = block_data(seed, 500 + cycle)
                bd.write(cycle, exp[cycle])
        st = dedup.status()
        dedup.remove()
        dedup.activate()
        assert ddlib.counters(dedup.status()) == ddlib.counters(st)
        verify_blocks(dedup.path, exp, nblocks=64)


def test_persistence_across_module_reload(dedup, seed):
    exp = write_ids(dedup.path, seed, LAYOUT)
    st1 = dedup.status()
    dedup.remove()
    try:
        ddlib.unload_dedup_module()
    finally:
        ddlib.load_dedup_module()       # later tests need it in any case
    dedup.activate()
    st2 = dedup.status()
    assert ddlib.counters(st2) == ddlib.counters(st1), (st1, st2)
    verify_blocks(dedup.path, exp, nblocks=64)
    # and it keeps working
    more = write_ids(dedup.path, seed, [0, 100], start=200)
    exp.update(more)
    st3 = dedup.status()
    assert st3["data_used"] == st2["data_used"] + 1
    verify_blocks(dedup.path, exp)


def test_read_only_option(dedup, seed):
    exp = write_ids(dedup.path, seed, LAYOUT)
    st1 = dedup.status()
    dedup.remove()
    ro = ddlib.DedupDev(dedup.name, dedup.meta, dedup.data, dedup.logical_sectors,
                        ["read_only"])
    ro.activate()
    st = ro.status()
    assert st["mode"] == "ro", st
    assert ddlib.counters(st) == ddlib.counters(st1)
    verify_blocks(ro.path, exp, nblocks=64)
    with BlockDev(ro.path) as bd:
        for data in (block_data(seed, 999), block_data(seed, 0), ddlib.ZERO):
            try:
                bd.write(40, data)
                raise AssertionError("write succeeded on a read_only dedup device")
            except OSError as e:
                assert e.errno == errno.EIO, e
    assert ddlib.counters(ro.status()) == ddlib.counters(st1)
    ro.remove()
    # read-write again: unchanged, writable
    dedup.activate()
    verify_blocks(dedup.path, exp, nblocks=64)
    write_ids(dedup.path, seed, [999], start=40)
    assert dedup.status()["data_used"] == st1["data_used"] + 1
