"""Power cut.

Method (chosen for robustness):
  * metadata and data live on two memory-backed null_blk disks with a
    volatile write cache (configfs: memory_backed=1, cache_size, blocksize
    4096).  Writes sit in the cache until a flush/FUA reaches the disk;
    powering the disk off (power=0) throws the cache away, so unflushed writes
    are really lost, flushed ones are kept.
  * between each null_blk disk and dm-dedup sits a dm-linear device.  The
    "cut" suspends both (no flush, no lockfs) and swaps their tables for
    dm-flakey with drop_writes (up 0 s, down 1 s: always down): from that
    instant on every write and flush from dm-dedup is acknowledged but
    dropped, exactly like writes issued after a power failure.  Reads still
    work, so dm-dedup can be removed normally (its final commit goes nowhere)
    instead of being torn down under a dead disk.
  * the dedup device and the flakey layers are removed, both null_blk disks
    are powered off and on (losing their caches), dm-linear is set up again
    and dm-dedup is re-created with the same table.
Checks after each cut: `dedup check --data` is clean on what the cut left
on the disks (before the recovery) and, after the recovery, once the
target is removed (PowerRig.check, check_recovered); every block written
before the last completed fsync (or written with O_DSYNC) reads back
exactly; every block written after it reads either its old or its new
content (never another block's content, never garbage); `mapped` equals the
number of non-zero blocks; the device keeps working: new unique writes do
not clobber surviving blocks.
commit_interval is 3600 so that no periodic commit hides the effect of the
cut.
"""

import json
import os
import time

import pytest

import ddlib
from ddlib import ZERO, BlockDev, block_data, digest, run
from powercut import PowerRig

NB = 512          # LBAs looked at (all writes of the test are below this)
META_DELAY_MS = 400


def check_after_cut(dev, durable, maybe, rig=None):
    """durable: {lba: bytes} that must read back exactly; maybe: {lba: set of
    allowed contents} (old or new).  LBAs in neither must read zeros.  With
    @rig (right after a recovery): then `dedup check --data` on the metadata
    the recovery wrote, the target removed and activated again."""
    with BlockDev(dev.path) as bd:
        got = bd.read_range(0, NB)
    bad = []
    for lba in range(NB):
        g = got[lba]
        if lba in durable:
            if g != durable[lba]:
                bad.append((lba, "durable", digest(durable[lba]), digest(g)))
        elif lba in maybe:
            if g not in maybe[lba]:
                bad.append((lba, "old-or-new", [digest(x) for x in maybe[lba]], digest(g)))
        elif g != ZERO:
            bad.append((lba, "zero", digest(ZERO), digest(g)))
    assert not bad, "%d blocks wrong after power cut: %s" % (len(bad), bad[:20])
    st = dev.status()
    assert st["mode"] == "rw", st
    nonzero = sum(1 for g in got if g != ZERO)
    assert st["mapped"] == nonzero, "mapped %d but %d non-zero blocks: %s" % (
        st["mapped"], nonzero, st)
    if rig is not None:
        rig.check_recovered()
    return {lba: got[lba] for lba in range(NB) if got[lba] != ZERO}


def test_power_cut_nullblk(backing, seed):
    rig = PowerRig(backing)
    dev = rig.dev
    dev.activate()
    state = {}            # what the device holds after the last durable point

    for rnd in range(2):
        base = rnd * 1000
        # phase A: durable writes (unique, duplicates, zeros), then fsync
        layout_a = [base + (i % 48) for i in range(64)]
        with BlockDev(dev.path) as bd:
            for i, bid in enumerate(layout_a):
                lba = (rnd * 64 + i) % NB
                data = block_data(seed, bid) if i % 10 != 9 else ZERO
                bd.write(lba, data)
                if data == ZERO:
                    state.pop(lba, None)
                else:
                    state[lba] = data
            bd.fsync()
        durable = dict(state)
        maybe = {}

        def pending(lba, data):
            old = durable.get(lba, ZERO)
            maybe.setdefault(lba, {old}).add(data)
            durable.pop(lba, None)

        with BlockDev(dev.path) as bd:
            # phase B: overwrite half of A and write new LBAs, no flush
            for i in range(32, 96):
                lba = (rnd * 64 + i) % NB
                data = block_data(seed, base + 500 + i if i % 2 else base + (i % 48))
                bd.write(lba, data)
                pending(lba, data)
        # one O_DSYNC write: durable on completion
        fua_lba = 400 + rnd
        with BlockDev(dev.path, os.O_DSYNC) as bd:
            data = block_data(seed, base + 999)
            bd.write(fua_lba, data)
        maybe.pop(fua_lba, None)
        durable[fua_lba] = data
        # phase C: a few more unflushed writes after the FUA write
        with BlockDev(dev.path) as bd:
            for lba in range(410, 420):
                data = block_data(seed, base + 700 + lba)
                bd.write(lba, data)
                pending(lba, data)

        rig.cut()
        # writes after the cut are lost whatever happens
        with BlockDev(dev.path) as bd:
            bd.write(450, block_data(seed, base + 4242))
            bd.fsync()
        rig.power_cycle()

        state = check_after_cut(dev, durable, maybe, rig)

        # still consistent: fresh unique data must not clobber anything
        with BlockDev(dev.path) as bd:
            for i in range(40):
                lba = 300 + (rnd * 40 + i) % 90
                data = block_data(seed, base + 800 + i)
                bd.write(lba, data)
                state[lba] = data
            bd.fsync()
        got = check_after_cut(dev, state, {})
        assert got == state


def power_cut_keeps(rig, expect, what):
    """Cut both disks and power them off and on: the blocks from 0 read
    @expect."""
    rig.cut()
    rig.power_cycle()
    with BlockDev(rig.dev.path) as bd:
        got = bd.read_range(0, len(expect))
    bad = [lba for lba in range(len(expect)) if got[lba] != expect[lba]]
    assert not bad, "%s: %s" % (what, bad)
    rig.check_recovered()


def _append_whose_data_flush_is_lost(rig, seed):
    """Eight blocks made durable by an fsync, then three writes (two new
    blocks and a duplicate). The fsync came right after a write, so the
    first of them has its data flushed and its records appended ahead,
    and is durable once that append is done. The other two go to the
    next fsync's append, which reaches the metadata disk while its data
    flush is lost. Both disks are cut at the end. Returns the contents as
    of the append ahead, and the new ones."""
    dev = rig.dev
    dev.activate()
    old = [block_data(seed, i) for i in range(8)]
    new = list(old)
    new[0], new[1], new[2] = block_data(seed, 100), block_data(seed, 101), old[3]
    with BlockDev(dev.path) as bd:
        bd.write_range(0, old)
        bd.fsync()
        before = dev.stats()
        ahead = int(before["appends_ahead"])
        # The fsync came right after a write: the next write's data is
        # flushed and its records appended ahead when it completes, but
        # the one after that's are not.
        bd.write(0, new[0])
        st = ddlib.wait_for_append_ahead(dev, before)
        flushed = int(st["data_flushes_ahead"])
        assert int(st["appends_ahead"]) == ahead + 1, st
        bd.write(1, new[1])
        bd.write(2, new[2])             # a duplicate, in the same append
        st = dev.stats()
        assert (int(st["data_flushes_ahead"]), int(st["appends_ahead"])) == \
            (flushed, ahead + 1), \
            "the second write's data was flushed ahead: nothing would be lost"
    rig.cut("d")
    with BlockDev(dev.path) as bd:
        bd.fsync()                      # the append; its data flush is lost
    rig.cut()
    durable = list(old)
    durable[0] = new[0]
    return durable, new


def test_append_whose_data_flush_was_cut_is_dropped(backing, seed, kmsg_check):
    """An fsync's journal append is written while the data device is
    flushed for it. A power cut between the two, the append on the
    metadata disk and the flush never on the data disk: activation finds
    a block the append made live without its data, and drops the append,
    which was never acknowledged. Every block reads its content as of the
    append before (sent ahead of that fsync), never the lost data or
    another block's."""
    rig = PowerRig(backing)
    dev = rig.dev
    durable, _ = _append_whose_data_flush_is_lost(rig, seed)
    rig.power_cycle()
    dropped = [line for line in kmsg_check.lines()
               if "last append" in line and "dropped" in line]
    assert dropped, "the append whose data was lost was not dropped"
    assert int(dev.stats()["journal_blocks_dropped"]) == 1, dev.stats()
    with BlockDev(dev.path) as bd:
        got = bd.read_range(0, 8)
    bad = [lba for lba in range(8) if got[lba] != durable[lba]]
    assert not bad, "blocks not as of the append before: %s" % bad
    st = dev.status()
    assert st["mapped"] == 8 and st["mode"] == "rw", st
    # Dropped for good: the next activation replays nothing of it. The
    # metadata the recovery wrote checks clean with its data in between.
    rig.check_recovered()
    with BlockDev(dev.path) as bd:
        assert bd.read_range(0, 8) == durable


def test_append_checked_in_the_data_cache_is_flushed_first(backing, seed, kmsg_check):
    """The same lost data flush, but the crash keeps the disks powered:
    the new data is still in the data disk's cache, so activation finds it
    and keeps the append, which its checkpoint makes permanent. The data
    must then be made durable as well, before the check: a power cut
    after that activation must not take back a block the metadata now
    points at for good."""
    rig = PowerRig(backing)
    dev = rig.dev
    _, new = _append_whose_data_flush_is_lost(rig, seed)
    rig.restart()
    assert not [line for line in kmsg_check.lines()
                if "last append" in line and "dropped" in line], \
        "the data was in the disk's cache: the append should have been kept"
    with BlockDev(dev.path) as bd:
        assert bd.read_range(0, 8) == new
    power_cut_keeps(rig, new, "blocks lost after the activation that kept their append")


@pytest.mark.parametrize("hash_opts", [(), ("hash", "crc32c", "verify")],
                         ids=["sha256", "crc32c"])
def test_appends_go_beside_their_data_flush_only_with_a_strong_hash(backing, seed,
                                                                   hash_opts):
    """Replay trusts the newest append if the fingerprints of its new
    blocks match the data found. With crc32c, allowed with verify, stale
    data could match by chance (or by design): the append then waits for
    its data flush, and neither it nor the superblock carries UNFLUSHED.
    Read off the metadata disk as a crash leaves it, with `dedup dump`."""
    strong = not hash_opts
    rig = PowerRig(backing, opts=hash_opts)
    dev = rig.dev
    dev.activate()
    with BlockDev(dev.path) as bd:
        bd.write_range(0, [block_data(seed, i) for i in range(4)])
        bd.fsync()
    rig.cut()                           # nothing more reaches either disk
    dev.remove()
    p = run([ddlib.DEDUP_BIN, "dump", "/dev/mapper/" + rig.layers["m"]])
    doc = json.loads(p.stdout)
    appends = doc["journal"]["appends"]
    assert appends, "the fsync's append is not in the journal"
    assert bool(doc["superblock"]["flags"] & 2) == strong, doc["superblock"]
    assert [a.get("unflushed", False) for a in appends] == [strong] * len(appends), \
        [(a["first_seq"], a.get("unflushed", False)) for a in appends]


def test_flush_joins_only_an_append_holding_every_write_before_it(backing, seed):
    """A flush request that comes while an append is on its way, and every
    write completed before it made its change before that append took its
    records, completes with that append (appends_joined) instead of
    waiting for it and then finding nothing to append. One that comes
    after a write that made its change after the take needs an append of
    its own, with that write in it. The metadata disk holds each write
    for META_DELAY_MS, so that the append begun ahead is still on its way
    when the request comes. A power cut right after the last fsync: every
    write before it reads back, which fails if the last request joined
    the append that lacks its write."""
    rig = PowerRig(backing, meta_delay_ms=META_DELAY_MS)
    dev = rig.dev
    dev.activate()
    blocks = [block_data(seed, 900 + i) for i in range(4)]

    def counts():
        st = dev.stats()
        return {k: int(st[k]) for k in ("appends_joined", "appends_ahead",
                                         "journal_appends")}

    def used():
        return int(dev.stats()["journal_blocks_used"])

    def wait_taken(before):
        """Until the append begun ahead took its records, which moves the
        journal's write position (its blocks stay held below)."""
        deadline = time.monotonic() + 30
        while used() <= before:
            assert time.monotonic() < deadline, \
                "the append begun ahead did not take its records"
            time.sleep(0.01)

    with BlockDev(dev.path) as bd:
        bd.write(0, blocks[0])
        bd.fsync()                      # after one idle moment: arms the next
        c0 = counts()
        u = used()
        bd.write(1, blocks[1])          # its append begins ahead, held below
        wait_taken(u)
        bd.fsync()
        c1 = counts()
        assert c1 == {"appends_joined": c0["appends_joined"] + 1,
                      "appends_ahead": c0["appends_ahead"] + 1,
                      "journal_appends": c0["journal_appends"] + 1}, (c0, c1)
        u = used()
        bd.write(2, blocks[2])          # its append begins ahead ...
        wait_taken(u)                   # ... and takes its records
        bd.write(3, blocks[3])          # completes while it is on its way
        bd.fsync()
        c2 = counts()
        assert c2 == {"appends_joined": c1["appends_joined"],
                      "appends_ahead": c1["appends_ahead"] + 1,
                      "journal_appends": c1["journal_appends"] + 2}, (c1, c2)
    power_cut_keeps(rig, blocks, "blocks written before the last fsync lost")
