"""The fingerprint describes the bytes stored (issue 12, review A1).

A writer may change its pages while its write is in flight: an O_DIRECT
or io_uring buffer belongs to the user, and without stable writes a page
under writeback may be stored to through mmap. The target must hash and
store the same bytes, or a block ends up holding A' under the fingerprint
of A, and every later write of A anywhere is mapped onto A': silent
corruption of somebody else's data.

Both tests use the default table (SHA-256, no `verify`, which would hide
the hole by comparing bytes), and the helper tests/guest/helpers/racewrite.c
(built here with gcc) for the racing threads. The teardown's
`dedup check --data` (ddlib.Backing.check_metadata) rehashes every live
data block against its fingerprint record and fails the test on a mismatch.
"""

import mmap
import os
import time

import pytest

import cgroups
import ddlib
from ddlib import run

DIRECT_ROUNDS = 1500
MMAP_PAGES = 512
MMAP_SECONDS = 20


@pytest.fixture(scope="module")
def racewrite():
    return ddlib.build_helper("racewrite")


def test_odirect_buffer_changed_during_write(make_dedup, racewrite, seed):
    """Round r: block 3r is written with O_DIRECT while another thread flips
    the buffer between A and B; then A and B are written normally to 3r+1 and
    3r+2. Both must read back exactly, and 3r only A's or B's bytes."""
    d = make_dedup(meta_mib=16, data_mib=64, logical_mib=64)
    st0 = d.status()
    p = run([racewrite, "direct", d.path, str(DIRECT_ROUNDS), str(seed)],
            check=False, timeout=1200)
    ddlib.report("integrity: " + p.stdout.strip().splitlines()[-1])
    assert p.returncode == 0, "data read back wrong:\n%s%s" % (
        p.stdout[-4000:], p.stderr)
    st = d.status()
    # Every normally written block is new content of its own or a duplicate
    # of the raced block: the writes really went through the dedup path.
    written = sum(st[k] - st0[k] for k in ("unique_writes", "duplicate_writes"))
    assert written >= 3 * DIRECT_ROUNDS
    d.remove()


@pytest.mark.parametrize("fstype", ["ext4", "xfs"])
def test_mmap_stores_under_writeback(make_dedup, backing, racewrite, seed, fstype):
    """Whole-page stores into a shared mapping while another thread keeps
    calling fdatasync: pages change under writeback (no stable writes). The
    16 patterns make most pages duplicates, so a block stored under another
    content's fingerprint would be shared by later writes of that content.
    After a remount every page must hold the pattern stored last."""
    # XFS refuses filesystems under 300 MB
    d = make_dedup(meta_mib=16, data_mib=128, logical_mib=512)
    mkfs = {"ext4": ["mkfs.ext4", "-q", "-F"], "xfs": ["mkfs.xfs", "-q", "-f"]}[fstype]
    run(mkfs + [d.path], timeout=600)
    mnt = "/tmp/dd-mnt-integrity"
    os.makedirs(mnt, exist_ok=True)
    run(["mount", "-t", fstype, d.path, mnt])
    backing.mounts.append(mnt)
    f = os.path.join(mnt, "mapped")
    last = os.path.join(ddlib.TMPFS, "racewrite-last")
    p = run([racewrite, "mmap", f, str(MMAP_PAGES), str(MMAP_SECONDS), str(seed), last],
            timeout=600)
    ddlib.report("integrity %s: %s" % (fstype, p.stdout.strip()))
    run(["umount", mnt])
    run(["mount", "-t", fstype, d.path, mnt])
    p = run([racewrite, "mmap-verify", f, str(MMAP_PAGES), str(seed), last], check=False)
    assert p.returncode == 0, "pages read back wrong after remount:\n%s%s" % (
        p.stdout[-4000:], p.stderr)
    st = d.status()
    assert st["duplicate_writes"] > 0, "the patterns never deduplicated: %s" % st
    run(["umount", mnt])
    d.remove()


# ---------------------------------------------------------------------------
# no stale metadata after errors or reloads (issue 12, review A2 and A7)
# ---------------------------------------------------------------------------
def test_failed_data_flush_rolls_back_and_leaves_nothing_to_write(backing, seed):
    """A flush of the data device fails during an append. The target must
    fall back to its last commit with the appends made since, as a crash
    at that moment would leave it (Documentation/dm-dedup.rst): the append
    whose flush failed went out beside that flush, so it is there or not
    as a whole, with the data of every block it made live checked, and the
    next activation reads the same. And it must keep nothing of the dead
    transaction to write later: after a reload the old table's destructor
    runs while the new table already owns the metadata, and a stray write
    there would land on blocks the new table may have allocated. The new
    table here is read_only, so any change of the metadata device across
    the reload came from the old instance."""
    meta = backing.loop(16, "meta")
    meta_file = backing.files[-1]
    data_raw = backing.loop(64, "data")
    data, sectors = ddlib.dm_linear("ddtidata", data_raw)
    logical = 128 * ddlib.MIB // 512
    opts = ["commit_interval", "3600"]
    dd = ddlib.DedupDev.create("ddtint", meta, data, logical, opts)
    failed = {lba: ddlib.block_data(seed, lba) for lba in (98, 99)}
    with ddlib.BlockDev(dd.path) as bd:
        # One write, then the fsync: the fsync arms the flush and the
        # append sent ahead (it came right after the device went idle).
        bd.write_range(0, [ddlib.block_data(seed, lba) for lba in range(16)])
        bd.fsync()
        before = dd.stats()
        # Duplicates change only metadata: no data write can fail first.
        # The first one's record is appended ahead, alone, and stays.
        for lba in range(16):
            bd.write(100 + lba, ddlib.block_data(seed, lba))
            if lba:
                failed[100 + lba] = ddlib.block_data(seed, lba)
            else:
                st = ddlib.wait_for_append_ahead(dd, before)
                assert int(st["appends_ahead"]) == 1, st
        assert dd.status()["duplicate_writes"] == 16
        # New blocks, written before the data device fails: the flush must
        # cover them (after duplicates alone none would be sent). The first
        # gets the data device flushed ahead, successfully; the second
        # needs the append's own flush, which fails.
        bd.write(99, ddlib.block_data(seed, 99))
        bd.write(98, ddlib.block_data(seed, 98))
        assert dd.stats()["data_flushes_ahead"] == "1"
        ddlib.dm_swap_table("ddtidata", "0 %d flakey %s 0 0 1 1 error_writes" % (sectors, data_raw))
        with pytest.raises(OSError):
            bd.fsync()
        st = dd.status()
        assert st["mode"] == "ro", st["raw"]
        for lba in range(16):
            assert bd.read(lba) == ddlib.block_data(seed, lba), "committed lba %d" % lba
        assert bd.read(100) == ddlib.block_data(seed, 0), "appended ahead"
        shown = {lba: bd.read(lba) for lba in failed}
    kept = shown == failed
    assert kept or all(c == ddlib.ZERO for c in shown.values()), \
        "the failed append is neither whole nor gone: %s" % sorted(
            lba for lba in failed if shown[lba] != failed[lba])
    dd.suspend()
    before = ddlib.file_sha256(meta_file)
    run(["dmsetup", "reload", dd.name, "--table",
         ddlib.table_line(meta, data, logical, opts + ["read_only"])])
    dd.resume()
    after = ddlib.file_sha256(meta_file)
    assert before == after, "the replaced table wrote to the metadata after the reload"
    dd.remove()
    ddlib.dm_swap_table("ddtidata", "0 %d linear %s 0" % (sectors, data_raw))
    dd.activate()
    st = dd.status()
    assert st["mode"] == "rw" and st["mapped"] == 17 + (len(failed) if kept else 0), st["raw"]
    with ddlib.BlockDev(dd.path) as bd:
        assert {lba: bd.read(lba) for lba in failed} == shown, \
            "the next activation reads otherwise than the fallback did"
        bd.write(200, ddlib.block_data(seed, 200))
        bd.fsync()
        assert bd.read(200) == ddlib.block_data(seed, 200)
    dd.remove()
    run(["dmsetup", "remove", "ddtidata"])


def test_a_failed_flush_sent_ahead_fails_the_next_append(backing, seed):
    """The data device is flushed ahead when a writer that flushes after
    each write goes idle, and the write's records are appended ahead with
    that flush. If the flush fails, the append fails with it and the
    device goes read-only before the writer's fsync arrives, which then
    fails too: the disk may have dropped the writes the flush was to cover
    with its cache. The data disk sits under dm-delay, which holds the
    flush sent ahead (and every data write) 4 s, long enough to switch in
    a layer that fails it, and to switch that layer out again before the
    fsync. (A flush that succeeds after the failed one proves nothing
    about those writes either, dd_flush_ahead_endio; no test here: only
    an append begun between the two flushes' completions would rely on
    it, a window no test can hold open.)"""
    meta = backing.loop(16, "meta")
    data_raw = backing.loop(64, "data")
    under, sectors = ddlib.dm_linear("ddtfaunder", data_raw)
    run(["dmsetup", "create", "ddtfadelay", "--table",
         "0 %d delay %s 0 0 %s 0 4000" % (sectors, under, under)])
    logical = 128 * ddlib.MIB // 512
    dd = ddlib.DedupDev.create("ddtfa", meta, "/dev/mapper/ddtfadelay", logical,
                               ["commit_interval", "3600"])
    with ddlib.BlockDev(dd.path) as bd:
        bd.write_range(0, [ddlib.block_data(seed, lba) for lba in range(4)])
        bd.fsync()                      # right after a write: arms the flush ahead
        ahead = int(dd.stats()["data_flushes_ahead"])
        bd.write(8, ddlib.block_data(seed, 8))
        assert int(dd.stats()["data_flushes_ahead"]) == ahead + 1, \
            "no flush was sent ahead: the test does not test what it says"
        # That flush is held by dm-delay for 4 s: it fails below.
        ddlib.dm_swap_table("ddtfaunder", "0 %d flakey %s 0 0 1 1 error_writes" % (
            sectors, data_raw))
        time.sleep(5)
        ddlib.dm_swap_table("ddtfaunder", "0 %d linear %s 0" % (sectors, data_raw))
        st = dd.stats()
        assert st["mode"] == "ro" and int(st["appends_ahead"]) == 1, \
            "the append sent ahead with the failed flush did not fail: %s" % st
        with pytest.raises(OSError):
            bd.fsync()
    st = dd.status()
    assert st["mode"] == "ro", st["raw"]
    dd.remove()
    ddlib.dm_remove("ddtfadelay")
    ddlib.dm_remove("ddtfaunder")


def switchable_stack(backing, tag):
    """A dedup device (commit_interval 3600) over 16 MiB of metadata and
    64 MiB of data, each behind a dm-linear device, ddtf<TAG>meta and
    ddtf<TAG>data, whose table a test swaps for a faulty one (swap()).
    Returns the device and, per kind, (backing loop, sectors)."""
    paths, under = {}, {}
    for kind, mib in (("meta", 16), ("data", 64)):
        raw = backing.loop(mib, kind)
        paths[kind], sectors = ddlib.dm_linear("ddtf%s%s" % (tag, kind), raw)
        under[kind] = (raw, sectors)
    dd = ddlib.DedupDev.create("ddtf" + tag, paths["meta"], paths["data"],
                               128 * ddlib.MIB // 512, ["commit_interval", "3600"])
    return dd, under


def swap(tag, kind, under, target="linear", args=""):
    """Give ddtf<TAG><KIND> TARGET (linear, or flakey with ARGS) over its
    backing loop."""
    raw, sectors = under[kind]
    ddlib.dm_swap_table("ddtf%s%s" % (tag, kind),
                        ("0 %d %s %s 0 %s" % (sectors, target, raw, args)).strip())


def remove_stack(dd, tag):
    dd.remove()
    ddlib.dm_remove("ddtf%smeta" % tag)
    ddlib.dm_remove("ddtf%sdata" % tag)


def test_fallback_keeps_acknowledged_appends_when_data_reads_fail(backing, seed, kmsg_check):
    """A commit fails (metadata writes fail) while the data device fails
    too. The fallback shows the last commit with the appends made since.
    The newest append was written beside its data flush, but that flush
    completed before the fsync did: nothing about its data is in doubt,
    so it is not checked against the data device, whose reads fail here
    and would take every acknowledged append down with it."""
    dd, under = switchable_stack(backing, "b")
    blocks = {lba: ddlib.block_data(seed, lba) for lba in range(16)}
    with ddlib.BlockDev(dd.path) as bd:
        bd.write_range(0, [blocks[lba] for lba in range(16)])
        bd.fsync()
    ddlib.dm_swap_table("ddtfbdata", "0 %d error" % under["data"][1])
    swap("b", "meta", under, "flakey", "0 1 1 error_writes")
    assert dd.message("commit", check=False).returncode != 0
    assert dd.status()["mode"] == "ro"
    lost = [line for line in kmsg_check.lines() if "reads show the last commit" in line]
    assert not lost, lost
    swap("b", "data", under)
    with ddlib.BlockDev(dd.path, readonly=True) as bd:
        got = bd.read_range(0, 16)
    assert [lba for lba in range(16) if got[lba] != blocks[lba]] == []
    swap("b", "meta", under)
    remove_stack(dd, "b")


def test_fallback_drops_only_the_newest_append_when_its_data_cannot_be_read(
        backing, seed, kmsg_check):
    """The data device fails everything, reads included, just before a
    flush request: the append goes out beside its data flush, which
    fails, and the target falls back to its last commit with the appends
    made since. The newest one's data cannot be checked (reads fail): it
    is dropped, as one whose data is missing would be. The appends before
    it, which fsyncs saw durable, stay: an unreadable data block must not
    take every acknowledged append down with the one in doubt."""
    meta_raw = backing.loop(16, "meta")
    data_raw = backing.loop(64, "data")
    data, data_sectors = ddlib.dm_linear("ddtfndata", data_raw)
    dd = ddlib.DedupDev.create("ddtfn", meta_raw, data, 128 * ddlib.MIB // 512,
                               ["commit_interval", "3600"])
    synced = {lba: ddlib.block_data(seed, lba) for lba in range(16)}
    with ddlib.BlockDev(dd.path) as bd:
        bd.write_range(0, list(synced.values()))
        bd.fsync()                      # arms a flush and an append ahead
        before = dd.stats()
        bd.write(20, ddlib.block_data(seed, 20))
        ddlib.wait_for_append_ahead(dd, before)   # ... taken by this write
        bd.write(21, ddlib.block_data(seed, 21))  # left for the fsync
        # dm-flakey always down, no features: every bio fails, flushes
        # too (the error target takes no flushes: dm core completes them).
        ddlib.dm_swap_table("ddtfndata", "0 %d flakey %s 0 0 1" % (data_sectors, data_raw))
        with pytest.raises(OSError):
            bd.fsync()
    assert dd.status()["mode"] == "ro"
    lines = kmsg_check.lines()
    assert any("newest append dropped" in line for line in lines), \
        "the newest append was not checked against the failing data device: %s" % lines[-8:]
    lost = [line for line in lines if "reads show the last commit" in line]
    assert not lost, lost
    ddlib.dm_swap_table("ddtfndata", "0 %d linear %s 0" % (data_sectors, data_raw))
    with ddlib.BlockDev(dd.path, readonly=True) as bd:
        got = bd.read_range(0, 16)
        assert bd.read(21) == ddlib.ZERO, "the dropped append's block reads"
    assert [lba for lba in range(16) if got[lba] != synced[lba]] == [], \
        "fsynced blocks lost to the fallback"
    dd.remove()
    ddlib.dm_remove("ddtfndata")


def test_an_abort_before_the_newest_append_was_written_keeps_the_one_before(
        backing, seed, kmsg_check):
    """The newest append is taken but its journal block cannot be written
    (the metadata device fails writes): the target aborts and falls back
    to its last commit with the appends on disk. The newest append is the
    one whose data flush was not seen; it is not on disk, so the last one
    there is the append an fsync saw durable, and it must be applied as it
    is, not checked against a data device that reads wrong at that moment
    (here every read comes back with its first byte changed)."""
    dd, under = switchable_stack(backing, "k")
    synced = {lba: ddlib.block_data(seed, lba) for lba in range(16)}
    acked = ddlib.block_data(seed, 31)
    with ddlib.BlockDev(dd.path) as bd:
        bd.write_range(0, list(synced.values()))
        bd.fsync()
        bd.write(31, acked)
        bd.fsync()                      # the append with block 31 is durable
        swap("k", "data", under, "flakey",
             "0 1 5 corrupt_bio_byte 1 r %d 0" % (acked[0] ^ 0xFF))
        swap("k", "meta", under, "flakey", "0 1 1 error_writes")
        with pytest.raises(OSError):
            bd.write(40, ddlib.block_data(seed, 40))
            bd.fsync()
    assert dd.status()["mode"] == "ro"
    lines = kmsg_check.lines()
    # The abort came from the append's write: its records were taken.
    assert any("journal append" in line and "switching to ro" in line
               for line in lines), lines[-8:]
    dropped = [line for line in lines if "dropped" in line
               or "reads show the last commit" in line]
    assert not dropped, dropped
    swap("k", "data", under)
    with ddlib.BlockDev(dd.path, readonly=True) as bd:
        got = bd.read_range(0, 16)
        assert bd.read(31) == acked, "an fsynced block lost to the fallback"
        assert bd.read(40) == ddlib.ZERO, "a block of the append never written reads"
    assert [lba for lba in range(16) if got[lba] != synced[lba]] == [], \
        "fsynced blocks lost to the fallback"
    swap("k", "meta", under)
    remove_stack(dd, "k")


# ---------------------------------------------------------------------------
# a weak hash with verify tries every candidate (issue 12, review A6)
# ---------------------------------------------------------------------------
def _crc32c_table():
    t = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        t.append(c)
    return t


CRC32C_TABLE = _crc32c_table()


def crc32c(data):
    crc = 0xFFFFFFFF
    t = CRC32C_TABLE
    for b in data:
        crc = t[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def crc32c_collision(block, tweak, at=2048):
    """Another 4 KiB block with the CRC-32C of `block`: `tweak` is XORed into
    its first bytes, then 32 bits at byte `at` are solved for. For equal
    lengths a CRC is affine, L(x) = crc(x) ^ crc(0) is linear, and the 32
    bits' images form a basis, so Gaussian elimination over GF(2) finds
    the bits that cancel L(tweak)."""
    zero = crc32c(bytes(len(block)))

    def lin(delta):
        return crc32c(delta) ^ zero

    def bit(i):
        d = bytearray(len(block))
        d[at + i // 8] = 1 << (i % 8)
        return lin(bytes(d))

    d = bytearray(len(block))
    d[:len(tweak)] = tweak
    target = lin(bytes(d))
    # rows: (image, mask of the bits that make it)
    rows = [(bit(i), 1 << i) for i in range(32)]
    basis = {}
    for img, mask in rows:
        for p in sorted(basis, reverse=True):
            if img >> p & 1:
                img ^= basis[p][0]
                mask ^= basis[p][1]
        if img:
            basis[img.bit_length() - 1] = (img, mask)
    assert len(basis) == 32, "the chosen bits do not span the CRC"
    sol = 0
    for p in sorted(basis, reverse=True):
        if target >> p & 1:
            target ^= basis[p][0]
            sol ^= basis[p][1]
    assert target == 0
    out = bytearray(block)
    for i, t in enumerate(tweak):
        out[i] ^= t
    for i in range(32):
        if sol >> i & 1:
            out[at + i // 8] ^= 1 << (i % 8)
    out = bytes(out)
    assert out != block and crc32c(out) == crc32c(block)
    return out


def test_verify_tries_every_candidate(make_dedup, seed):
    """Three different blocks with one CRC-32C: the index offers all three
    for each. Writing each again must find its own copy, not stop at the
    first candidate that differs and store yet another copy."""
    d = make_dedup(opts=["hash", "crc32c", "verify"])
    x = [ddlib.block_data(seed, 1)]
    x.append(crc32c_collision(x[0], b"\x01"))
    x.append(crc32c_collision(x[0], b"\x02\x03"))
    with ddlib.BlockDev(d.path) as bd:
        for i, b in enumerate(x):
            bd.write(i, b)
        bd.fsync()
        st0 = d.status()
        assert st0["unique_writes"] == 3, st0["raw"]
        for i, b in enumerate(x):
            bd.write(10 + i, b)
        bd.fsync()
        st = d.status()
        assert st["duplicate_writes"] - st0["duplicate_writes"] == 3, st["raw"]
        assert st["unique_writes"] == 3, st["raw"]
        for i, b in enumerate(x):
            assert bd.read(i) == b and bd.read(10 + i) == b, "lba %d" % i
    d.remove()


def verify_counts(d):
    """(unique writes, duplicate writes, verify mismatches, verify reads)
    of dedup device `d` so far."""
    st, stats = d.status(), d.stats()
    return (st["unique_writes"], st["duplicate_writes"],
            int(stats["verify_mismatches"]), int(stats["verify_reads"]))


def test_verify_compares_a_fresh_copy_in_memory(make_dedup, seed):
    """A block just stored keeps its copy in memory a while: a copy of it
    written soon after is compared with that, without a read. A block
    with the same CRC-32C but other bytes is still told apart, in memory
    too, and stored. A copy of either is then shared with its own, without
    a read and without a mismatch, though one of the two finds the other
    first in their leaf (each CPU takes new blocks from a run of its own,
    so either block may come first).
    Once 256 other blocks were stored (their physical blocks cover every
    slot), the copy is read again; and after a commit that lets freed
    blocks be reused, a kept copy no longer counts (the block might have
    been written again)."""
    d = make_dedup(opts=["hash", "crc32c", "verify", "commit_interval", "3600"])
    a, b, c, e = (ddlib.block_data(seed, i) for i in (1, 2, 3, 4))
    b_impostor = crc32c_collision(b, b"\x0b")
    filler = [ddlib.block_data(seed, 1000 + i) for i in range(256)]

    with ddlib.BlockDev(d.path) as bd:
        def step(what, lba, blocks, want):
            before = verify_counts(d)
            bd.write_range(lba, blocks)
            bd.fsync()
            got = tuple(x - y for x, y in zip(verify_counts(d), before))
            assert got == want, "%s: (unique, dup, mismatches, reads) %s" % (what, got)

        step("a", 0, [a], (1, 0, 0, 0))
        step("a's copy", 1, [a], (0, 1, 0, 0))
        step("b", 2, [b], (1, 0, 0, 0))
        # compared in memory, unequal: stored, and nothing read
        step("b's impostor", 3, [b_impostor], (1, 0, 1, 0))
        step("b's copy", 4, [b], (0, 1, 0, 0))
        # over itself: lba 3 keeps its one reference to the impostor's block
        step("the impostor's copy", 3, [b_impostor], (0, 1, 0, 0))
        step("filler", 100, filler, (len(filler), 0, 0, 0))
        step("a's copy after the filler", 5, [a], (0, 1, 0, 1))
        step("c", 6, [c], (1, 0, 0, 0))
        # e replaces b's impostor at lba 3, and commits let its block be
        # reused: c's kept copy no longer counts
        step("e", 3, [e], (1, 0, 0, 0))
        d.commit()
        d.commit()
        step("c's copy after a reusing commit", 7, [c], (0, 1, 0, 1))
        want = {0: a, 1: a, 2: b, 3: e, 4: b, 5: a, 6: c, 7: c}
        assert {lba: bd.read(lba) for lba in want} == want
        assert bd.read_range(100, len(filler)) == filler
    d.remove()


@pytest.mark.parametrize("early_ack", [False, True], ids=["ack-when-done", "early-ack"])
def test_verify_reads_are_the_writers(make_dedup, seed, early_ack):
    """The write of a block's new data and the read verify makes of a
    candidate block are made for the writer: the data device charges
    both to the writer's cgroup (its io.stat), not to the target's
    workers' root group, so that a limit such as io.max set for one VM's
    group governs them. dm core hands the target a clone without a
    cgroup; the target takes the submitting task's. With early_ack the
    write is acknowledged before it is decided, and the cgroup kept for
    its I/O."""
    d = make_dedup(opts=["verify"] + (["early_ack"] if early_ack else []))
    a, b = ddlib.block_data(seed, 1), ddlib.block_data(seed, 2)
    # 256 other blocks stored after a: no copy of a is kept in memory
    filler = [ddlib.block_data(seed, 1000 + i) for i in range(256)]
    with ddlib.BlockDev(d.path) as bd:
        bd.write(0, a)
        bd.write_range(100, filler)
        bd.fsync()
    group = cgroups.IoGroup("ddt-verify-%d" % os.getpid())
    try:
        with ddlib.BlockDev(d.path) as bd:
            before = verify_counts(d)
            acked = int(d.stats()["early_acks_undecided"])
            with group.joined():
                bd.write(1, b)      # new data: its write is the group's
                bd.write(2, a)      # a's copy: so is the read of a
                bd.fsync()
            got = tuple(x - y for x, y in zip(verify_counts(d), before))
            assert got == (1, 1, 0, 1), "(unique, dup, mismatches, reads) %s" % (got,)
            # early_ack: both acknowledged before their decision, so the
            # I/O went out for the cgroup kept, not for the bio
            acked = int(d.stats()["early_acks_undecided"]) - acked
            assert acked == (2 if early_ack else 0)
            io = group.io_stat(d.data)
            seen = "%s on %s; the group's io.stat:\n%s" % (io, d.data, group.io_stat_text())
            assert (io["wbytes"], io["wios"]) == (ddlib.BLOCK, 1), seen
            assert (io["rbytes"], io["rios"]) == (ddlib.BLOCK, 1), seen
            assert [bd.read(lba) for lba in range(3)] == [a, b, a]
    finally:
        group.remove()
    d.remove()


def test_verify_batch_compares_every_block(make_dedup, seed):
    """The candidates of a write are read and compared together
    (dd_verify_write), in disk order, one read per run of consecutive
    blocks. One 128 KiB write copies 32 stored blocks, two of them swapped
    for blocks with the same CRC-32C but other bytes: the 30 copies are
    shared after one read, the two impostors are stored after a read each
    on the one-block way. A copy in reverse order is read in one piece
    too; blocks 7 3 9 3 8 in two reads (3, then 7 to 9); 16 copies of one
    block in one. Copies of a block that is new wait for its first copy's
    write and are compared with it in memory (dd_inflight_twins): 16 copies
    of a new block read nothing, and an impostor among 4 copies of
    another is told apart and stored without a read either: the block it
    waited for keeps its copy in memory. The blocks stored last keep their
    copies in memory
    (test_verify_compares_a_fresh_copy_in_memory): 256 other blocks are
    written after the first 32, so that theirs are read. Every block reads
    back."""
    d = make_dedup(opts=["hash", "crc32c", "verify", "commit_interval", "3600"])
    n = 32
    orig = [ddlib.block_data(seed, 100 + i) for i in range(n)]
    copy = list(orig)
    copy[5] = crc32c_collision(orig[5], b"\x07")
    copy[20] = crc32c_collision(orig[20], b"\x08\x09")
    y, z = ddlib.block_data(seed, 200), ddlib.block_data(seed, 201)
    z_impostor = crc32c_collision(z, b"\x0a")
    filler = [ddlib.block_data(seed, 1000 + i) for i in range(256)]
    writes = [  # lba, blocks, (unique, duplicate, mismatches, reads) it adds
        (0, orig, (n, 0, 0, 0)),
        (1024, filler, (len(filler), 0, 0, 0)),
        (64, copy, (2, n - 2, 2, 3)),
        (128, orig[::-1], (0, n, 0, 1)),
        (192, [orig[i] for i in (7, 3, 9, 3, 8)], (0, 5, 0, 2)),
        (256, [orig[3]] * 16, (0, 16, 0, 1)),
        (320, [y] * 16, (1, 15, 0, 0)),
        (384, [z, z, z_impostor, z], (2, 2, 1, 0)),
    ]
    buf = mmap.mmap(-1, len(filler) * ddlib.BLOCK)

    try:
        with ddlib.BlockDev(d.path) as bd:
            for lba, blocks, want in writes:
                before = verify_counts(d)
                size = len(blocks) * ddlib.BLOCK
                buf[:size] = b"".join(blocks)
                assert os.pwrite(bd.fd, memoryview(buf)[:size], lba * ddlib.BLOCK) == size
                bd.fsync()
                got = tuple(a - b for a, b in zip(verify_counts(d), before))
                assert got == want, "write at %d: (unique, dup, mismatches, reads) %s" % (
                    lba, got)
            for lba, blocks, _ in writes:
                got = bd.read_range(lba, len(blocks))
                assert [i for i, b in enumerate(blocks) if got[i] != b] == [], "at %d" % lba
    finally:
        buf.close()
    d.remove()


def _metadata_via_dm(backing, data_mib, logical_mib):
    """A dedup device whose metadata device is dm "ddtimeta" over a loop, so
    that its table can swap to flakey; commits only when asked."""
    meta_raw = backing.loop(16, "meta")
    data = backing.loop(data_mib, "data")
    meta, sectors = ddlib.dm_linear("ddtimeta", meta_raw)
    dd = ddlib.DedupDev.create("ddtint", meta, data, logical_mib * ddlib.MIB // 512,
                               ["commit_interval", "3600"])
    return meta_raw, sectors, dd


def test_reload_after_metadata_write_errors(backing, seed):
    """Metadata writes fail for a while (the device goes ro), the device
    heals, and the table is reloaded and resumed: not removed. The new table
    writes and commits while the old one is destroyed; nothing the old one
    left may land on the new one's blocks. In a loop; the teardown's
    `dedup check --data` is the judge, as is every committed block."""
    meta_raw, sectors, dd = _metadata_via_dm(backing, 64, 128)
    committed = {}
    for rnd in range(3):
        with ddlib.BlockDev(dd.path) as bd:
            for i in range(32):
                lba = rnd * 100 + i
                committed[lba] = ddlib.block_data(seed, lba)
                bd.write(lba, committed[lba])
            bd.fsync()
            ddlib.dm_swap_table("ddtimeta", "0 %d flakey %s 0 0 1 1 error_writes"
                                % (sectors, meta_raw))
            for i in range(32, 64):
                bd.write(rnd * 100 + i, ddlib.block_data(seed, 7 + i))
            with pytest.raises(OSError):
                bd.fsync()
        assert dd.status()["mode"] == "ro"
        ddlib.dm_swap_table("ddtimeta", "0 %d linear %s 0" % (sectors, meta_raw))
        run(["dmsetup", "reload", dd.name, "--table", dd.table_line()])
        dd.resume()
        assert dd.status()["mode"] == "rw"
        with ddlib.BlockDev(dd.path) as bd:
            for lba, want in committed.items():
                assert bd.read(lba) == want, "round %d: committed lba %d" % (rnd, lba)
            for i in range(64, 96):
                lba = rnd * 100 + i
                committed[lba] = ddlib.block_data(seed, lba)
                bd.write(lba, committed[lba])
            bd.fsync()
    dd.remove()
    run(["dmsetup", "remove", "ddtimeta"])


def test_background_metadata_write_error(backing, kmsg_check, seed):
    """dm-bufio writes dirty metadata blocks in the background once they
    outnumber the clean ones, long before a commit, and keeps the error of
    a failed write to itself until asked; the block is then dropped from
    the cache and its location holds older content (review A3). With
    commit_interval 3600 and no flush, the target must notice on its own:
    the device stops accepting writes within the burst, no read returns
    anything but the last commit, and the kernel log says why."""
    meta_raw, sectors, dd = _metadata_via_dm(backing, 96, 256)
    committed = {}
    burst = 12000                     # 47 MiB of unique blocks, no flush
    with ddlib.BlockDev(dd.path) as bd:
        for lba in range(64):
            committed[lba] = ddlib.block_data(seed, lba)
            bd.write(lba, committed[lba])
        bd.fsync()
        ddlib.dm_swap_table("ddtimeta", "0 %d flakey %s 0 0 1 1 error_writes"
                            % (sectors, meta_raw))
        accepted = 0
        for i in range(burst):
            try:
                bd.write(64 + i, ddlib.block_data(seed, 64 + i))
            except OSError:
                break
            accepted += 1
    # The data device is healthy and nothing asked for a commit: only
    # noticing background writeback can refuse writes within the burst.
    assert accepted < burst, "every write of the burst was accepted: %s" % dd.status()
    assert dd.status()["mode"] == "ro"
    assert any("background metadata write failed" in line for line in kmsg_check.lines()), \
        "no dmesg line names the background write"
    ddlib.dm_swap_table("ddtimeta", "0 %d linear %s 0" % (sectors, meta_raw))
    with ddlib.BlockDev(dd.path) as bd:
        for lba, want in committed.items():
            assert bd.read(lba) == want, "committed lba %d" % lba
        got = bd.read_range(64, accepted + 1)
    wrong = [64 + i for i, b in enumerate(got) if b != ddlib.ZERO]
    assert not wrong, "%d uncommitted blocks read other than the last commit, first %d" % (
        len(wrong), wrong[0])
    ddlib.report("background write error: %d of %d burst writes accepted before ro" % (
        accepted, burst))
    dd.remove()
    run(["dmsetup", "remove", "ddtimeta"])
