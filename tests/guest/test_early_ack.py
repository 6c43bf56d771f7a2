"""early_ack: a write is acknowledged before its data is written and mapped:
before its blocks are decided once a data block is promised to each, or else
once each is decided (Documentation/dm-dedup.rst, "Writes").

Under the data device sits dm-delay, holding every write for a while, so
that acknowledged writes really are still in flight when the test looks;
each check fails if the mechanism it is named after is missing:
  * a read of a block whose write was acknowledged but is not mapped yet
    returns the new content: it waits for the write;
  * a write whose content another write still in flight is storing (its
    block waits behind that twin) is acknowledged without waiting;
  * a flush covers them: after a power cut right after fsync, everything
    written before the fsync reads back;
  * a data write that fails after its acknowledgement fails the next
    fsync, once, and the block keeps its old content;
  * suspend waits for them: everything reads back after suspend and
    resume and after a table reload; `dedup check` is clean after each test.
"""

import errno

import pytest

import ddlib
from ddlib import ZERO, BlockDev, DedupDev, block_data, dm_swap_table, verify_blocks
from powercut import PowerRig

META_MIB, DATA_MIB, LOGICAL_MIB = 16, 64, 256
WRITE_DELAY_MS = 40


def delayed(backing, name, mib, write_ms):
    """dm-delay NAME over a fresh loop device, its writes (and flushes)
    held @write_ms: returns (path, the loop device, sectors). The loop's
    file is named "data": the cleanup's `dedup check` then finds it as the
    data device of the "meta" loop made before it, and checks with --data."""
    raw = backing.loop(mib, "data")
    sectors = mib * ddlib.MIB // 512
    ddlib.run(["dmsetup", "create", name, "--table",
               "0 %d delay %s 0 0 %s 0 %d" % (sectors, raw, raw, write_ms)])
    ddlib.udev_settle()
    return "/dev/mapper/" + name, raw, sectors


def early_acks(dev):
    return int(dev.stats()["early_acks"])


def test_reads_wait_for_writes_acknowledged_early(backing, seed):
    meta = backing.loop(META_MIB, "meta")
    data, _, _ = delayed(backing, "ddteadata", DATA_MIB, WRITE_DELAY_MS)
    dev = DedupDev.create("ddtea", meta, data, LOGICAL_MIB * ddlib.MIB // 512,
                          ["early_ack"])
    assert dev.table().endswith(" 1 early_ack"), dev.table()
    exp = {}
    with BlockDev(dev.path) as bd:
        # One block, read back at once, over and over on a few blocks.
        for i in range(120):
            lba = i % 24
            exp[lba] = block_data(seed, i)
            bd.write(lba, exp[lba])
            assert bd.read(lba) == exp[lba], "write %d: lba %d read stale" % (i, lba)
        # Runs of 8, read back as runs of 16 that straddle older blocks.
        for i in range(20):
            first = 100 + 8 * (i % 6)
            run = [block_data(seed, 1000 + 8 * i + k) for k in range(8)]
            bd.write_range(first, run)
            exp.update({first + k: c for k, c in enumerate(run)})
            got = bd.read_range(first - 4, 16)
            for k in range(16):
                lba = first - 4 + k
                assert got[k] == exp.get(lba, ZERO), "run %d: lba %d read stale" % (i, lba)
    st = dev.stats()
    assert int(st["early_acks"]) >= 100, st
    assert int(st["ordered_waits"]) > 0, "no read waited for a write: %s" % st
    verify_blocks(dev.path, exp, nblocks=200)


def test_write_behind_its_twin_is_acknowledged_early(backing, seed):
    """A second write of content whose first write is still in flight
    waits behind it (the in-flight table) to share its block. With a block
    promised to it, it is acknowledged before that: the first's data write
    is held 1.6 s, and both writes return while it is. Without promises
    it would wait for that write, and be acknowledged once decided, not
    early."""
    meta = backing.loop(META_MIB, "meta")
    data, _, _ = delayed(backing, "ddteadata", DATA_MIB, 1600)
    dev = DedupDev.create("ddtea", meta, data, LOGICAL_MIB * ddlib.MIB // 512,
                          ["early_ack"])
    c = block_data(seed, 1)
    with BlockDev(dev.path) as bd:
        bd.write(0, c)
        before = dev.stats()
        bd.write(1, c)
        st = dev.stats()
        assert int(st["early_acks"]) == int(before["early_acks"]) + 1, \
            "the twin's write was not acknowledged early: %s" % st
        assert int(st["early_acked_blocks_in_flight"]) == 2, \
            "the first write was done already: nothing tested (%s)" % st
        assert int(st["early_acks_undecided"]) == 2, st
        bd.fsync()
        assert bd.read_range(0, 2) == [c, c]
    st = dev.status()
    assert (st["unique_writes"], st["duplicate_writes"], st["data_used"]) == (1, 1, 1), st


def test_flush_covers_writes_acknowledged_early(backing, seed):
    """A power cut just after fsync: every write acknowledged before it
    reads back, although each was acknowledged before its data write
    (delayed below) even began."""
    rig = PowerRig(backing, opts=["early_ack"], write_delay_ms=WRITE_DELAY_MS)
    dev = rig.dev
    dev.activate()
    exp = {}
    with BlockDev(dev.path) as bd:
        for i in range(96):
            lba = (i * 7) % 200
            # unique blocks, some duplicates of earlier ones, some zeros
            c = ZERO if i % 16 == 15 else block_data(seed, i if i % 5 else i // 5)
            bd.write(lba, c)
            if c == ZERO:
                exp.pop(lba, None)
            else:
                exp[lba] = c
        acked = early_acks(dev)
        bd.fsync()
    assert acked >= 48, "only %d writes acknowledged early" % acked
    rig.cut()
    rig.power_cycle()
    with BlockDev(dev.path) as bd:
        got = bd.read_range(0, 200)
    bad = [lba for lba in range(200) if got[lba] != exp.get(lba, ZERO)]
    assert not bad, "%d blocks lost or wrong after fsync and a power cut: %s" % (
        len(bad), bad[:20])
    assert dev.status()["mapped"] == len(exp)
    rig.check_recovered()


def test_write_failing_after_early_ack_fails_the_next_flush(backing, seed):
    meta = backing.loop(META_MIB, "meta")
    data, raw, sectors = delayed(backing, "ddteadata", DATA_MIB, WRITE_DELAY_MS)
    dev = DedupDev.create("ddtea", meta, data, LOGICAL_MIB * ddlib.MIB // 512,
                          ["early_ack"])
    old = [block_data(seed, i) for i in range(8)]
    new = [block_data(seed, 100 + i) for i in range(8)]
    with BlockDev(dev.path) as bd:
        bd.write_range(0, old)
        bd.fsync()
        dm_swap_table("ddteadata", "0 %d flakey %s 0 0 1 1 error_writes" % (sectors, raw))
        acked = early_acks(dev)
        bd.write_range(0, new)          # acknowledged: its data write fails later
        assert early_acks(dev) == acked + 1
        with pytest.raises(OSError) as e:
            bd.fsync()
        assert e.value.errno == errno.EIO
        dm_swap_table("ddteadata", "0 %d linear %s 0" % (sectors, raw))
        bd.fsync()                      # the error was reported once
        assert bd.read_range(0, 8) == old
        assert dev.status()["mode"] == "rw"
        assert int(dev.stats()["data_write_errors"]) > 0
        bd.write_range(0, new)
        bd.fsync()
        assert bd.read_range(0, 8) == new
    dev.commit()
    assert dev.status()["data_used"] == 8, dev.status()


def test_suspend_and_reload_wait_for_writes_acknowledged_early(backing, seed):
    # Long enough that the writes are still in flight when looked at.
    meta = backing.loop(META_MIB, "meta")
    data, _, _ = delayed(backing, "ddteadata", DATA_MIB, 1600)
    dev = DedupDev.create("ddtea", meta, data, LOGICAL_MIB * ddlib.MIB // 512,
                          ["early_ack"])
    exp = {}
    for rnd, action in enumerate(("suspend", "reload")):
        with BlockDev(dev.path) as bd:
            for i in range(64):
                lba = 64 * rnd + i
                exp[lba] = block_data(seed, 1000 * rnd + i)
                bd.write(lba, exp[lba])
        assert int(dev.stats()["early_acked_blocks_in_flight"]) > 0, \
            "the writes were done before the %s: nothing tested" % action
        if action == "suspend":
            dev.suspend()
            assert int(dev.stats()["early_acked_blocks_in_flight"]) == 0
            dev.resume()
        else:
            dev.reload()
        verify_blocks(dev.path, exp, nblocks=256)
    dev.remove()
    dev.activate()
    verify_blocks(dev.path, exp, nblocks=256)
