"""What the target sends to its devices, seen with blktrace, not inferred
from counters (iotrace.py). The devices are logical volumes of a volume
group, as on a datastore (lvm.py).

Each device here has commit_interval 3600, so that the only commits are
the ones a test asks for; udev's probes are let finish before a trace
starts.
"""

import os
import re
import time

import ddlib
from ddlib import BLOCK, BlockDev, block_data, run
from iotrace import IoTrace, describe

NO_TIMED_COMMIT = ("commit_interval", "3600")
SB_SECTORS = BLOCK // 512


def lv_dedup(make_dedup, opts=(), **kw):
    return make_dedup(lvm=True, opts=NO_TIMED_COMMIT + tuple(opts), **kw)


def trace(dev, top=False):
    ddlib.udev_settle()
    roles = {"data": dev.data, "meta": dev.meta}
    if top:
        roles["top"] = dev.path
    return IoTrace(**roles)


def stat(dev, key):
    return int(dev.stats()[key])


def writes(t, role):
    """The bios of @role that were not reads: writes, flushes, discards."""
    return [b for b in t.bios(role) if b.op != "R"]


def assert_writes_and_flushes(t, what, times=1):
    """The data device got @times one 4 KiB write then one empty flush, and
    nothing else. Returns those bios."""
    data = writes(t, "data")
    assert [(b.op, b.preflush, b.sectors) for b in data] == \
        [("W", False, SB_SECTORS), ("W", True, 0)] * times, \
        "data device for %s:\n%s" % (what, describe(t, "data"))
    return data


def assert_commit(t, txn, data_written=(), appended=False):
    """The commit sequence of Documentation/dm-dedup.rst ("Transactions
    and commits"): the data device gets one empty flush and nothing else
    (but the bios @data_written, the data the commit is for), or nothing
    at all when every change was @appended to the journal already; the
    metadata device gets the changed blocks written ahead and a flush,
    the blocks changed since (if any) and a flush, the superblock of
    generation @txn in slot txn % 2, and a flush; nothing has FUA.
    Returns the number of tree blocks written."""
    data = [b for b in writes(t, "data") if b not in data_written]
    assert [(b.op, b.preflush, b.sectors) for b in data] == \
        ([] if appended else [("W", True, 0)]), \
        "data device during a commit:\n" + describe(t, "data")
    meta = writes(t, "meta")
    ops = "".join("F" if b.is_flush and not b.sectors else b.op for b in meta)
    assert re.fullmatch(r"W+FW*FWF", ops), \
        "metadata device during a commit (W = block, F = empty flush):\n" + \
        describe(t, "meta")
    sb = meta[-2]
    assert (sb.sector, sb.sectors) == ((txn % 2) * SB_SECTORS, SB_SECTORS), \
        "superblock of generation %d not in slot %d:\n%s" % (txn, txn % 2,
                                                             describe(t, "meta"))
    assert not any(b.fua for b in data + meta), "FUA in a commit"
    assert appended or data[0].seq < meta[0].seq, \
        "the data device was not flushed before the metadata was written"
    return len(meta) - 4


def assert_append(t, data_written=(), data_flush=True):
    """A flush with the journal (Documentation/dm-dedup.rst, "Transactions
    and commits"): the data device gets one empty flush and nothing else
    (but the bios @data_written), or nothing at all when no data write
    completed since its last flush (@data_flush False); then the metadata
    device gets the journal's new blocks, written with FUA, and nothing
    else: no flush, no superblock, no tree block. Returns the number of
    journal blocks."""
    data = [b for b in writes(t, "data") if b not in data_written]
    assert [(b.op, b.preflush, b.sectors) for b in data] == \
        ([("W", True, 0)] if data_flush else []), \
        "data device during a flush:\n" + describe(t, "data")
    meta = writes(t, "meta")
    assert meta and all(b.op == "W" and b.fua and not b.preflush and b.sectors
                        for b in meta), \
        "metadata device during a flush (journal blocks with FUA only):\n" + \
        describe(t, "meta")
    assert all(b.sector >= 2 * SB_SECTORS for b in meta), \
        "a superblock written at a flush:\n" + describe(t, "meta")
    assert not data_flush or data[0].seq < meta[0].seq, \
        "the data device was not flushed before the journal was written"
    return sum(b.sectors for b in meta) // SB_SECTORS


def test_duplicate_writes_send_nothing_to_the_data_device(make_dedup, seed):
    dev = lv_dedup(make_dedup)
    blocks = [block_data(seed, i) for i in range(64)]
    with BlockDev(dev.path) as b:
        # Two writes, then the fsync: it came after two idle moments, so
        # the writes below get no append begun ahead of a flush request
        # (Documentation/dm-dedup.rst, "The journal").
        b.write_range(0, blocks[:32])
        b.write_range(32, blocks[32:])
        b.fsync()
        dup0 = stat(dev, "duplicate_writes")
        ahead0 = stat(dev, "appends_ahead")
        with trace(dev) as t:
            b.write_range(1000, blocks)                  # one 256 KiB write
            for i in range(0, 64, 2):                    # and 32 of 4 KiB
                b.write(2000 + i, blocks[i])
        assert stat(dev, "duplicate_writes") - dup0 == 96
        assert stat(dev, "appends_ahead") == ahead0
        data, meta = t.summary("data"), t.summary("meta")
        assert data == dict(data, writes=0, reads=0, flushes=0, discards=0), \
            "data device while duplicates were written:\n" + describe(t, "data")
        # Nothing durable reaches the metadata device before the next flush
        # either: no superblock, no journal block (FUA). The running
        # transaction lasts until a checkpoint, and dm-bufio may write its
        # tree blocks back early, onto blocks no commit references.
        early = [x for x in t.bios("meta") if x.op == "W" and x.sectors]
        assert not [x for x in early if x.fua or x.sector < 2 * SB_SECTORS], \
            "metadata device before the flush:\n" + describe(t, "meta")
        assert meta["discards"] == 0, describe(t, "meta")
        # The flush neither: every block the records point at was written
        # before the last flush of the data device, which covers it.
        skipped0 = stat(dev, "data_flushes_skipped")
        with trace(dev) as t:
            b.fsync()
        appended = assert_append(t, data_flush=False)
        assert appended >= 1
        assert stat(dev, "data_flushes_skipped") == skipped0 + 1
        with trace(dev) as t:
            dev.commit()
        changed = assert_commit(t, stat(dev, "transaction_id"), appended=True)
        assert changed >= 1
        assert b.read_range(1000, 64) == blocks
        assert [b.read(2000 + i) for i in range(0, 64, 2)] == blocks[::2]
    ddlib.report("duplicates: 96 written, 0 data bios, no data flush; the flush appended "
                 "%d journal blocks, the commit wrote %d metadata blocks + superblock"
                 % (appended, changed))


def test_sequential_unique_data_goes_out_in_one_bio_per_256k(make_dedup, seed):
    """Documentation/dm-dedup.rst, "Writes": device-mapper cuts a large
    bio at 256 KiB, and the new blocks of each piece go to the data device
    as one bio when the free space is consecutive (a fresh device). Reads
    of a physically contiguous run go out the same way ("Reads")."""
    dev = lv_dedup(make_dedup)
    blocks = [block_data(seed, i) for i in range(256)]
    with BlockDev(dev.path) as b:
        with trace(dev, top=True) as t:
            b.write_range(0, blocks)                     # one 1 MiB write
        top = [x for x in t.bios("top") if x.op == "W"]
        assert [x.bytes for x in top] == [1 << 20], describe(t, "top")
        writes = [x for x in t.bios("data") if x.op == "W"]
        sizes = sorted(x.bytes for x in writes)
        ddlib.report("1 MiB unique write: data bios of %s bytes" % sizes)
        assert sizes == [256 << 10] * 4, \
            "data device bios for one 1 MiB unique write:\n" + describe(t, "data")
        assert not [x for x in t.bios("data") if x.op != "W"], describe(t, "data")
        b.fsync()
        ddlib.udev_settle()
        with trace(dev) as t:
            got = b.read_range(0, 256)                   # one 1 MiB read
        assert got == blocks
        reads = [x for x in t.bios("data") if x.op == "R"]
        assert sorted(x.bytes for x in reads) == [256 << 10] * 4, \
            "data device bios for one 1 MiB read:\n" + describe(t, "data")
        assert not t.bios("meta"), "the map was cached:\n" + describe(t, "meta")


def test_a_flush_appends_once_and_an_idle_flush_sends_nothing(make_dedup, seed):
    dev = lv_dedup(make_dedup)
    with BlockDev(dev.path) as b:
        b.write_range(0, [block_data(seed, i) for i in range(16)])
        txn = stat(dev, "transaction_id")
        with trace(dev) as t:
            b.fsync()
        changed = assert_append(t)
        assert changed == 1, "16 blocks' records fit one journal block"
        # "If nothing has changed since the last append, nothing is written."
        with trace(dev) as t:
            b.fsync()
        assert not t.bios("data") and not t.bios("meta"), \
            "an idle flush:\n%s\n%s" % (describe(t, "data"), describe(t, "meta"))
        assert stat(dev, "transaction_id") == txn
        # A FUA write: its data goes out without FUA, then the append.
        blk = block_data(seed, 100)
        with trace(dev, top=True) as t:
            b.write_range(50, [blk], flags=os.RWF_DSYNC)
        fua = [x for x in t.bios("top") if x.op == "W" and x.sectors]
        assert len(fua) == 1 and fua[0].fua, "no FUA write reached the target:\n" + \
            describe(t, "top")
        data = writes(t, "data")
        assert [(x.op, x.preflush, x.fua, x.sectors) for x in data] == \
            [("W", False, False, SB_SECTORS), ("W", True, False, 0)], \
            "data device for one FUA write:\n" + describe(t, "data")
        assert_append(t, data_written=data[:1])
        assert b.read(50) == blk
        assert stat(dev, "transaction_id") == txn
    ddlib.report("flush after 16 unique writes: %d journal block with FUA after one "
                 "data flush; idle flush: no I/O" % changed)


def test_a_flush_request_arms_one_data_flush_sent_ahead(make_dedup, seed):
    """Documentation/dm-dedup.rst, "The journal": a flush request that came
    right after the device went idle arms a flush sent ahead: the next
    write that leaves the device idle gets the data device flushed before
    its completion brings the next request, which then sends no data
    flush of its own, and its records appended with it (one append per
    write and fsync, as before). Once per request, so a second write
    before the next request gets none; and a request after two idle
    moments does not arm it."""
    dev = lv_dedup(make_dedup)
    with BlockDev(dev.path) as b:
        b.write_range(0, [block_data(seed, i) for i in range(16)])
        b.fsync()                                    # one write, then the request
        ahead0 = stat(dev, "data_flushes_ahead")
        sent0 = stat(dev, "data_flushes")
        skipped0 = stat(dev, "data_flushes_skipped")
        appends0 = stat(dev, "journal_appends")
        appended0 = stat(dev, "appends_ahead")
        with trace(dev, top=True) as t:
            b.write(100, block_data(seed, 100))
            b.fsync()
        data = assert_writes_and_flushes(t, "one write and an fsync")
        flush = [x for x in t.bios("top") if x.is_flush and not x.sectors]
        assert flush and data[1].seq < flush[0].seq, \
            "the data flush was not sent before the fsync arrived:\n%s\n%s" % (
                describe(t, "top"), describe(t, "data"))
        assert_append(t, data_written=data[:1])
        assert (stat(dev, "data_flushes_ahead"), stat(dev, "data_flushes"),
                stat(dev, "data_flushes_skipped")) == (ahead0 + 1, sent0, skipped0 + 1)
        assert (stat(dev, "appends_ahead"), stat(dev, "journal_appends")) == \
            (appended0 + 1, appends0 + 1)
        # Two writes, then the request: the first disarms it, so the
        # second's data needs the append's own flush.
        with trace(dev) as t:
            b.write(101, block_data(seed, 101))
            b.write(102, block_data(seed, 102))
            b.fsync()
        assert_writes_and_flushes(t, "two writes and an fsync", times=2)
        assert (stat(dev, "data_flushes_ahead"), stat(dev, "data_flushes"),
                stat(dev, "appends_ahead")) == (ahead0 + 2, sent0 + 1, appended0 + 2)
        # That request came after two idle moments: the next write gets no
        # flush ahead (it would not have covered the second write above);
        # its request, after one, arms it again.
        for lba, ahead, sent in ((103, 2, 2), (104, 3, 2)):
            with trace(dev) as t:
                b.write(lba, block_data(seed, lba))
                b.fsync()
            assert_writes_and_flushes(t, "one write and an fsync to lba %d" % lba)
            assert (stat(dev, "data_flushes_ahead"), stat(dev, "data_flushes"),
                    stat(dev, "appends_ahead")) == \
                (ahead0 + ahead, sent0 + sent, appended0 + ahead), "write to lba %d" % lba
        assert b.read_range(100, 5) == [block_data(seed, 100 + i) for i in range(5)]
    ddlib.report("a write and an fsync after an fsync: the data flush and the append "
                 "went out ahead of the request; two writes: one ahead, one by the append; "
                 "after that, none ahead until a request follows one idle moment")


def test_discard_passdown_discards_freed_blocks_only(make_dedup, seed):
    dev = lv_dedup(make_dedup, opts=("discard_passdown",))
    shared = [block_data(seed, i) for i in range(8)]
    alone = [block_data(seed, 100 + i) for i in range(8)]
    with BlockDev(dev.path) as b:
        b.write_range(0, shared)
        b.write_range(100, shared)                       # shares the first 8
        b.write_range(200, alone)
        b.fsync()
        # Where each content lives on the data device: small writes take
        # blocks from their CPU's reserved run of 64 (dedup-reserve.h), so
        # the first runs of all CPUs hold them.
        with BlockDev(dev.data) as d:
            used = d.read_range(0, 64 * (os.cpu_count() + 1))
        where = {c: i for i, c in enumerate(used)}
        assert all(c in where for c in shared + alone), "content not found on the data device"
        alone_sectors = {where[c] * SB_SECTORS for c in alone}
        shared_sectors = {where[c] * SB_SECTORS for c in shared}
        passed0 = stat(dev, "discard_passdown_blocks")
        with trace(dev) as t:
            ddlib.discard(dev.path, 0, 8)                # still shared by 100..107
            ddlib.discard(dev.path, 200, 8)              # the only copy
            b.fsync()
            # Freed by a commit, reusable (and discarded) at the next: the
            # commit message makes both.
            dev.commit()
            for _ in range(100):
                if stat(dev, "discard_passdown_blocks") - passed0 >= 8:
                    break
                time.sleep(0.1)
        assert stat(dev, "discard_passdown_blocks") - passed0 == 8
        got = set()
        for x in t.bios("data"):
            if x.op == "D":
                got |= {x.sector + s for s in range(0, x.sectors, SB_SECTORS)}
        assert got == alone_sectors and not got & shared_sectors, \
            "discards on the data device (freed: %s):\n%s" % (sorted(alone_sectors),
                                                             describe(t, "data"))
        assert not [x for x in t.bios("data") if x.op == "W" and x.sectors], \
            describe(t, "data")
        assert b.read_range(100, 8) == shared
        assert b.read_range(0, 8) == [ddlib.ZERO] * 8


def test_dedup_on_logical_volumes_ext4_and_lvextend(make_dedup, backing, seed):
    """The datastore set-up of Documentation/dm-dedup.rst ("On LVM"):
    ext4 on dedup on two logical volumes; the metadata volume grown with
    lvextend and taken by a reload, then the data volume the same way, then
    the logical size and ext4 on it, online (test_grow.py covers growth in
    depth)."""
    dev = make_dedup(meta_mib=16, data_mib=96, logical_mib=512, lvm=True, vg_spare_mib=64)
    vg = dev.vg
    run(["mkfs.ext4", "-q", "-F", dev.path])
    mnt = os.path.join(ddlib.TMPFS, "lvmnt")
    os.makedirs(mnt, exist_ok=True)
    run(["mount", dev.path, mnt])
    backing.mounts.append(mnt)
    payload = b"".join(block_data(seed, i) for i in range(1024))      # 4 MiB
    for i in range(4):
        with open(os.path.join(mnt, "image%d" % i), "wb") as f:
            f.write(payload)
    run(["sync"])
    st = dev.stats()
    assert int(st["data_blocks_live"]) < 2 * 1024, st     # 4 copies, ~1 stored

    total0 = int(st["metadata_blocks_total"])
    assert vg.extend("meta", 16) == 32 << 20
    dev.reload()
    dev.commit()
    assert int(dev.stats()["metadata_blocks_total"]) == total0 + (16 << 20) // BLOCK

    data0 = int(dev.stats()["data_blocks_total"])
    vg.extend("data", 32)
    dev.reload()
    assert int(dev.stats()["data_blocks_total"]) == data0 + (32 << 20) // BLOCK
    assert dev.status()["mode"] == "rw"
    # the logical size, then the mounted file system over it
    dev.logical_sectors *= 2
    dev.reload()
    run(["resize2fs", dev.path])
    assert os.statvfs(mnt).f_blocks * os.statvfs(mnt).f_frsize > 768 << 20
    with open(os.path.join(mnt, "image4"), "wb") as f:
        f.write(payload)
    run(["sync"])
    run(["umount", mnt])
    run(["fsck.ext4", "-fn", dev.path])
    run(["mount", dev.path, mnt])
    for i in range(5):
        with open(os.path.join(mnt, "image%d" % i), "rb") as f:
            assert f.read() == payload, "image%d" % i
    run(["umount", mnt])

