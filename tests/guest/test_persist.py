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


def test_a_read_only_table_writes_no_metadata(dedup, seed):
    """A table loaded read-only (dmsetup --readonly) opens both devices
    read-only: it is a read_only table, though its line has no option,
    and the metadata device is not written, at load or at removal (it
    was, once: a new superblock generation at load and the index save at
    removal, through a read-only handle)."""
    exp = write_ids(dedup.path, seed, LAYOUT)
    st1 = dedup.status()
    dedup.remove()
    before = ddlib.file_sha256(dedup.meta)
    line = ddlib.table_line(dedup.meta, dedup.data, dedup.logical_sectors)
    ddlib.run(["dmsetup", "create", "--readonly", dedup.name, "--table", line])
    ddlib.udev_settle()
    try:
        st = dedup.status()
        assert st["mode"] == "ro", st
        assert ddlib.counters(st) == ddlib.counters(st1), (st, st1)
        assert "read_only" not in dedup.table().split(), dedup.table()
        verify_blocks(dedup.path, exp, nblocks=64)
        dedup.message("commit")
    finally:
        ddlib.dm_remove(dedup.name)
    assert ddlib.file_sha256(dedup.meta) == before, "a read-only table wrote metadata"
    dedup.activate()
    verify_blocks(dedup.path, exp, nblocks=64)


def test_read_only_open_counts_what_the_journal_stored(backing, seed):
    """A read-only open applies the journal in memory only. Its counters
    must be those of the replayed state, as a read-write open shows them
    after writing it: the blocks stored since the last commit count as
    used data blocks (they did not, once: used fell below live)."""
    meta_raw = backing.loop(16, "meta")
    data = backing.loop(64, "data")
    meta, sectors = ddlib.dm_linear("ddtpmeta", meta_raw)
    dev = ddlib.DedupDev.create("ddtpro", meta, data, 128 * ddlib.MIB // 512,
                                ["commit_interval", "3600"])
    exp = write_ids(dev.path, seed, LAYOUT)
    dev.commit()
    exp.update(write_ids(dev.path, seed, [100 + i for i in range(48)], start=64))
    with BlockDev(dev.path) as bd:
        bd.fsync()                     # one journal append, no commit
    # A crash: the final commit and the index save of the removal are lost.
    ddlib.dm_swap_table("ddtpmeta", "0 %d flakey %s 0 0 1 1 drop_writes" % (sectors, meta_raw))
    dev.remove()
    ddlib.dm_swap_table("ddtpmeta", "0 %d linear %s 0" % (sectors, meta_raw))

    ro = ddlib.DedupDev(dev.name, meta, data, dev.logical_sectors, ["read_only"])
    ro.activate()
    st, kv = ro.status(), ro.stats()
    assert st["mode"] == "ro", st
    assert int(kv["journal_blocks_replayed"]) > 0, kv
    verify_blocks(ro.path, exp, nblocks=128)
    ro.remove()
    dev.activate()                     # replays into the trees
    st_rw, kv_rw = dev.status(), dev.stats()
    assert st_rw["mode"] == "rw", st_rw
    verify_blocks(dev.path, exp, nblocks=128)
    assert ddlib.counters(st) == ddlib.counters(st_rw), (st, st_rw)
    for k in ("data_blocks_used", "data_blocks_live", "mapped_blocks"):
        assert kv[k] == kv_rw[k], (k, kv[k], kv_rw[k])
    assert int(kv["data_blocks_used"]) == 8 + 48, kv
    dev.remove()
    ddlib.run(["dmsetup", "remove", "ddtpmeta"])
