"""Device errors under the target.

A metadata device that starts failing writes (dm-flakey error_writes) must
turn the target read-only with a clear status and kernel log line: the flush
that cannot be honoured fails, later writes fail, reads show the last commit
(every flushed block exactly), and after the device is healthy again the
target reopens at that commit with nothing corrupted.
"""

import errno
import json
import os
import struct
import time

import pytest

import ddlib
from ddlib import BLOCK, BlockDev, DedupDev, block_data, dm_linear, dm_swap_table, run

META_MIB, DATA_MIB, LOGICAL_MIB = 16, 64, 128


def reopen_healed(dd, heal, committed, lost, seed):
    """Once @heal() made the metadata disk healthy again, the device
    reopens read-write at its last commit (the blocks of @committed
    exactly, those of @lost unwritten), takes a write and a flush, and is
    removed."""
    dd.remove()
    heal()
    dd.activate()
    st = dd.status()
    assert st["mode"] == "rw"
    assert st["mapped"] == len(committed), "reopened at a state other than the last commit"
    with BlockDev(dd.path) as bd:
        for lba, d in committed.items():
            assert bd.read(lba) == d, "committed lba %d lost" % lba
        for lba in lost:
            assert bd.read(lba) == ddlib.ZERO, "uncommitted lba %d survived" % lba
        bd.write(400, block_data(seed, 400))
        bd.fsync()
    dd.remove()


def relinear(meta_name, sectors, meta_raw):
    return lambda: dm_swap_table(meta_name, "0 %d linear %s 0" % (sectors, meta_raw))


def test_metadata_write_error_turns_read_only(backing, seed):
    meta_raw = backing.loop(META_MIB, "meta")
    data = backing.loop(DATA_MIB, "data")
    meta, sectors = dm_linear("ddtfmeta", meta_raw)
    dd = DedupDev.create("ddtfault", meta, data, LOGICAL_MIB * ddlib.MIB // 512,
                         ["commit_interval", "3600"])
    before = {lba: block_data(seed, lba) for lba in range(32)}
    with BlockDev(dd.path) as bd:
        for lba, d in before.items():
            bd.write(lba, d)
        bd.fsync()
        assert dd.status()["mode"] == "rw"

        # From now on every write to the metadata device fails.
        k = ddlib.Kmsg()                # only lines logged from here on
        dm_swap_table("ddtfmeta", "0 %d flakey %s 0 0 1 1 error_writes" % (sectors, meta_raw))
        for lba in range(32, 48):
            bd.write(lba, block_data(seed, lba))   # acknowledged, not yet durable
        with pytest.raises(OSError) as e:
            bd.fsync()
        assert e.value.errno == errno.EIO
        st = dd.status()
        assert st["mode"] == "ro", st["raw"]
        lines = k.lines()
        k.close()
        assert any("switching to ro mode" in l for l in lines), \
            "no kernel log line announcing read-only mode: %s" % lines[-10:]
        with pytest.raises(OSError) as e:
            bd.write(100, block_data(seed, 100))
        assert e.value.errno == errno.EIO
        # The device now shows its last commit, as a crash would: flushed
        # blocks exactly, unflushed ones old (never written: zeros) or new.
        for lba in range(32):
            assert bd.read(lba) == block_data(seed, lba), "lba %d" % lba
        for lba in range(32, 48):
            assert bd.read(lba) in (ddlib.ZERO, block_data(seed, lba)), "lba %d" % lba

    reopen_healed(dd, relinear("ddtfmeta", sectors, meta_raw), before, range(32, 48), seed)
    run(["dmsetup", "remove", "ddtfmeta"])


def test_metadata_write_error_at_a_commit_turns_read_only(backing, seed):
    """A commit writes most of its blocks ahead, while writers go on, and
    keeps them out only for the rest: a write that fails ahead must still
    fail the commit itself, not vanish with the error dm-bufio hands out
    once. The commit message then fails, the device turns read-only and
    shows its last commit, and reopens there once the disk is healthy."""
    meta_raw = backing.loop(META_MIB, "meta")
    data = backing.loop(DATA_MIB, "data")
    meta, sectors = dm_linear("ddtfcmeta", meta_raw)
    dd = DedupDev.create("ddtfcommit", meta, data, LOGICAL_MIB * ddlib.MIB // 512,
                         ["commit_interval", "3600"])
    with BlockDev(dd.path) as bd:
        for lba in range(32):
            bd.write(lba, block_data(seed, lba))
        bd.fsync()
        dd.commit()
        dm_swap_table("ddtfcmeta", "0 %d flakey %s 0 0 1 1 error_writes" % (sectors, meta_raw))
        for lba in range(32, 96):
            bd.write(lba, block_data(seed, lba))   # never flushed
        with ddlib.Kmsg() as k:
            p = dd.message("commit", check=False)
            lines = k.lines()
        assert p.returncode != 0, "the commit message succeeded on a failing disk"
        st = dd.status()
        assert st["mode"] == "ro", st["raw"]
        # dm-bufio may have tried a block on its own first; either way
        # the log names the failed write.
        assert any("metadata commit failed" in l or "background metadata write failed" in l
                   for l in lines), lines[-8:]
        for lba in range(32):
            assert bd.read(lba) == block_data(seed, lba), "lba %d" % lba
        for lba in range(32, 96):
            assert bd.read(lba) == ddlib.ZERO, "uncommitted lba %d" % lba
    committed = {lba: block_data(seed, lba) for lba in range(32)}
    reopen_healed(dd, relinear("ddtfcmeta", sectors, meta_raw), committed, range(32, 96), seed)
    run(["dmsetup", "remove", "ddtfcmeta"])


def test_metadata_writes_lost_ahead_of_a_commit_fail_it(backing, seed):
    """The metadata device is a sparse file on a small tmpfs that fills up
    (a thin-provisioned backing store out of space): writes to blocks the
    file never held fail, while rewrites of the superblock slots and
    flushes still succeed. The blocks a commit writes ahead are new ones;
    their writes fail before the commit holds writers out, and dm-bufio
    hands that error out once. The commit must still fail: had it gone on
    to write the superblock, that would name blocks that never reached
    the disk, and the next activation would find the device damaged."""
    small = os.path.join(ddlib.TMPFS, "small-%d" % os.getpid())
    os.makedirs(small)
    run(["mount", "-t", "tmpfs", "-o", "size=24m", "dd-small", small])
    meta_file, loop, dd = os.path.join(small, "meta.img"), None, None
    try:
        with open(meta_file, "wb") as f:
            f.truncate(16 * ddlib.MIB)
        loop = run(["losetup", "-f", "--show", meta_file]).stdout.strip()
        data = backing.loop(DATA_MIB, "data")
        dd = DedupDev.create("ddtfcfull", loop, data, LOGICAL_MIB * ddlib.MIB // 512,
                             ["commit_interval", "3600"])
        # Map leaves all over the device, committed; then a write next to
        # each of them shadows its leaf, and the refcount and fingerprint
        # leaves of the new blocks: new metadata blocks, on holes of the
        # file. Each shadow keeps its original in the cache, clean: dm-bufio
        # writes on its own only once dirty blocks outnumber clean ones
        # three to one.
        committed = {1361 * i: block_data(seed, 1361 * i) for i in range(24)}
        lost = [lba + 1 for lba in committed]
        with BlockDev(dd.path) as bd:
            for lba, d in committed.items():
                bd.write(lba, d)
            bd.fsync()
            dd.commit()
            dd.commit()                # both superblock slots written
            st = os.statvfs(small)
            run(["fallocate", "-l", str(st.f_bavail * st.f_frsize),
                 os.path.join(small, "filler")])
            for lba in lost:
                bd.write(lba, block_data(seed, lba))
            with ddlib.Kmsg() as k:
                p = dd.message("commit", check=False)
                lines = k.lines()
        assert p.returncode != 0, "the commit succeeded without its blocks on the disk"
        assert dd.status()["mode"] == "ro"
        assert any("metadata commit failed" in l or "background metadata write failed" in l
                   for l in lines), lines[-8:]
        reopen_healed(dd, lambda: os.unlink(os.path.join(small, "filler")),
                      committed, lost, seed)
        dd = None
        p = ddlib.dedup_check(loop)
        assert p.returncode == 0, p.stdout + p.stderr
    finally:
        if dd is not None:
            run(["dmsetup", "remove", "--retry", dd.name], check=False)
        if loop:
            run(["losetup", "-d", loop], check=False)
        run(["umount", small], check=False)
        os.rmdir(small)


def test_data_read_error_is_passed_up(backing, seed):
    meta = backing.loop(META_MIB, "meta")
    data_raw = backing.loop(DATA_MIB, "data")
    data, sectors = dm_linear("ddtfdata", data_raw)
    dd = DedupDev.create("ddtfault", meta, data, LOGICAL_MIB * ddlib.MIB // 512)
    with BlockDev(dd.path) as bd:
        bd.write(0, block_data(seed, 0))
        bd.fsync()
    # All reads of the data device fail from now on (flakey: reads error
    # while down unless a write feature is given).
    dm_swap_table("ddtfdata", "0 %d flakey %s 0 0 1" % (sectors, data_raw))
    with BlockDev(dd.path) as bd:
        with pytest.raises(OSError) as e:
            bd.read(0)
        assert e.value.errno == errno.EIO
        assert bd.read(5) == ddlib.ZERO    # unmapped: never touches the disk
    dm_swap_table("ddtfdata", "0 %d linear %s 0" % (sectors, data_raw))
    with BlockDev(dd.path) as bd:
        assert bd.read(0) == block_data(seed, 0)
    assert dd.status()["mode"] == "rw"
    dd.remove()
    run(["dmsetup", "remove", "ddtfdata"])


def test_damage_found_while_running_stays_flagged(backing, seed):
    """A map leaf damaged on the medium (activation does not read map
    leaves) is found by a read: the device switches to needs_check and
    records it in the superblock. Every later activation is read-only in
    needs_check mode until `dedup check --clear-needs-check`, which clears
    the flag only once the metadata checks clean; then the device is
    read-write again with every block intact."""
    meta = backing.loop(META_MIB, "meta")
    meta_file = backing.files[-1]
    data = backing.loop(DATA_MIB, "data")
    nb = 600                                  # map leaves 0 (LBA 0-507) and 1
    dd = DedupDev.create("ddtnc", meta, data, LOGICAL_MIB * ddlib.MIB // 512)
    content = {lba: block_data(seed, lba) for lba in range(nb)}
    with BlockDev(dd.path) as bd:
        bd.write_range(0, [content[lba] for lba in range(nb)])
        bd.fsync()
    dd.remove()

    rep = json.loads(run([ddlib.DEDUP_BIN, "check", "--json", meta_file]).stdout)
    with open(meta_file, "rb") as f:
        pristine = f.read()
    root = rep["superblock"]["map_root"]
    leaf0 = struct.unpack_from("<Q", pristine, root * BLOCK + 32)[0]
    assert pristine[root * BLOCK + 25] == 1 and leaf0, "map of height 1 expected"
    damaged = bytearray(pristine[leaf0 * BLOCK:(leaf0 + 1) * BLOCK])
    damaged[100] ^= 0x40                      # LBA 8's entry; the checksum now fails
    with open(meta_file, "r+b") as f:
        f.seek(leaf0 * BLOCK)
        f.write(damaged)

    k = ddlib.Kmsg()
    dd.activate()           # (udev's probe of block 0 may find the damage first)
    with BlockDev(dd.path) as bd:
        with pytest.raises(OSError) as e:
            bd.read(8)
        assert e.value.errno == errno.EIO
        assert bd.read(nb - 1) == content[nb - 1]
    for _ in range(100):
        if any("needs_check saved in the superblock" in l for l in k.lines()):
            break
        time.sleep(0.1)
    assert any("needs_check saved in the superblock" in l for l in k.lines()), \
        "\n".join(k.lines())
    k.close()
    assert dd.status()["mode"] == "needs_check"
    dd.remove()

    def flagged_activation():
        k = ddlib.Kmsg()
        dd.activate()
        assert dd.status()["mode"] == "needs_check"
        assert any("metadata flagged needs_check: read-only; run dedup check" in l
                   for l in k.lines()), "\n".join(k.lines())
        k.close()
        with BlockDev(dd.path) as bd:
            assert bd.read(nb - 1) == content[nb - 1]
            with pytest.raises(OSError):
                bd.write(nb + 10, block_data(seed, 99999))
                bd.fsync()
        dd.remove()

    flagged_activation()
    # still damaged: check fails and leaves the flag
    p = run([ddlib.DEDUP_BIN, "check", "--clear-needs-check", meta_file], check=False)
    assert p.returncode == 4, p.stdout + p.stderr
    assert "needs_check stays set" in p.stderr
    flagged_activation()

    # the leaf is intact again (say, restored): the flag still holds until cleared
    with open(meta_file, "r+b") as f:
        f.seek(leaf0 * BLOCK)
        f.write(pristine[leaf0 * BLOCK:(leaf0 + 1) * BLOCK])
    flagged_activation()
    p = run([ddlib.DEDUP_BIN, "check", "--clear-needs-check", meta_file], check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "needs_check cleared" in p.stderr

    dd.activate()
    assert dd.status()["mode"] == "rw"
    ddlib.verify_blocks(dd.path, content)
    with BlockDev(dd.path) as bd:
        bd.write(nb + 10, block_data(seed, 99999))
        bd.fsync()
        assert bd.read(nb + 10) == block_data(seed, 99999)


# ---------------------------------------------------------------------------
# medium errors: the block layer's -ENODATA is not "unmapped"
# ---------------------------------------------------------------------------
SCSI_READ10, SCSI_WRITE10 = 0x28, 0x2a


class MediumErrorDisk:
    """A scsi_debug disk whose reads or writes can be made to fail with a
    medium error (sense MEDIUM ERROR, UNRECOVERED READ ERROR), which the
    block layer reports as BLK_STS_MEDIUM, errno -ENODATA, as it does for
    an NVMe drive's write fault or unrecovered read. That errno is also
    what the target's map lookup returns for an unmapped block and its
    journal for an empty append: a device error must never pass for
    either (dedup-block.c, dd_device_error)."""

    def __init__(self, size_mib):
        assert not ddlib.module_loaded("scsi_debug"), "scsi_debug left loaded"
        run(["modprobe", "scsi_debug", "dev_size_mb=%d" % size_mib, "num_tgts=1",
             "max_luns=1"])
        ddlib.udev_settle()
        found = []
        for _ in range(100):
            found = [p for p in os.listdir("/sys/block") if os.path.isdir(
                "/sys/block/%s/device/scsi_disk" % p) and "scsi_debug" in open(
                    "/sys/block/%s/device/model" % p).read()]
            if found:
                break
            time.sleep(0.1)
        assert len(found) == 1, "no scsi_debug disk appeared: %s" % os.listdir("/sys/block")
        self.path = "/dev/" + found[0]
        self.hctl = os.path.basename(os.path.realpath("/sys/block/%s/device" % found[0]))
        self.ctl = "%s/scsi_debug/%s/error" % (ddlib.ensure_debugfs(), self.hctl)
        assert os.path.exists(self.ctl), "scsi_debug has no error injection: " + self.ctl

    def fail(self, opcode):
        """Every command @opcode fails from now on, until heal()."""
        with open(self.ctl, "w") as f:
            # ERR_FAIL_CMD, count 1 (kept: positive counts never run out),
            # opcode, host 0, driver 0, CHECK CONDITION, MEDIUM ERROR, 0x11 0x00
            f.write("2 1 0x%x 0x0 0x0 0x2 0x3 0x11 0x0\n" % opcode)

    def heal(self, opcode):
        with open(self.ctl, "w") as f:
            f.write("- 2 0x%x\n" % opcode)

    def close(self):
        ddlib.udev_settle()
        for _ in range(50):
            if run(["rmmod", "scsi_debug"], check=False).returncode == 0:
                return
            time.sleep(0.2)
        raise AssertionError("scsi_debug stays in use")


@pytest.fixture
def medium_disk(backing):
    disk = MediumErrorDisk(16)
    yield disk
    ddlib.remove_dm_devices()
    disk.close()


def test_medium_error_reading_the_map_fails_the_read(backing, medium_disk, seed):
    """A map leaf cannot be read (a medium error on the metadata disk): a
    read of a block it maps fails with EIO instead of returning zeros, and
    a zero write over such a block either fails or really unmaps it. Once
    the disk reads again, so does the device, with its data."""
    data = backing.loop(DATA_MIB, "data")
    logical = LOGICAL_MIB * ddlib.MIB // 512
    dd = DedupDev.create("ddtfmed", medium_disk.path, data, logical,
                         ["commit_interval", "3600"])
    # Far from the first map leaf, which activation reads.
    first = 30000
    written = {lba: block_data(seed, lba) for lba in range(first, first + 8)}
    with BlockDev(dd.path) as bd:
        bd.write_range(first, list(written.values()))
        bd.fsync()
    dd.commit()
    dd.remove()
    dd.activate()                       # that leaf not in the cache
    medium_disk.fail(SCSI_READ10)
    with BlockDev(dd.path) as bd:
        with pytest.raises(OSError) as e:
            got = bd.read(first + 3)
            pytest.fail("a read whose map entry could not be read returned %s" % (
                "zeros" if got == ddlib.ZERO else "data"))
        assert e.value.errno == errno.EIO, e.value
        try:
            bd.write(first + 5, ddlib.ZERO)
            zeroed = True
        except OSError:
            zeroed = False
        medium_disk.heal(SCSI_READ10)
        for lba, d in written.items():
            want = ddlib.ZERO if lba == first + 5 and zeroed else d
            assert bd.read(lba) == want, "lba %d after the disk healed (zero write %s)" % (
                lba, "completed" if zeroed else "failed")
    dd.remove()
    p = ddlib.dedup_check(medium_disk.path, data)
    assert p.returncode == 0, p.stdout + p.stderr


def test_medium_error_writing_the_journal_fails_the_flush(backing, medium_disk, seed):
    """The append's journal block cannot be written (a medium error): the
    flush request that needed it fails and the device goes read-only,
    rather than the flush completing as if the append had been empty.
    After the disk heals the device reopens without the unflushed block."""
    data = backing.loop(DATA_MIB, "data")
    logical = LOGICAL_MIB * ddlib.MIB // 512
    dd = DedupDev.create("ddtfmedw", medium_disk.path, data, logical,
                         ["commit_interval", "3600"])
    with BlockDev(dd.path) as bd:
        # Two idle moments before the request: it arms no append ahead,
        # so the fsync below makes the append itself.
        bd.write(0, block_data(seed, 0))
        bd.write(1, block_data(seed, 1))
        bd.fsync()
        before = dd.stats()
        medium_disk.fail(SCSI_WRITE10)
        bd.write(10, block_data(seed, 10))
        st = dd.stats()
        assert (st["mode"], st["appends_ahead"], st["journal_appends"]) == \
            ("rw", before["appends_ahead"], before["journal_appends"]), \
            "something was appended before the fsync: the test does not test what it says"
        with ddlib.Kmsg() as k:
            with pytest.raises(OSError):
                bd.fsync()
            lines = k.lines()
    assert dd.status()["mode"] == "ro"
    assert any("journal append" in l for l in lines), lines[-8:]
    medium_disk.heal(SCSI_WRITE10)
    dd.remove()
    dd.activate()
    assert dd.status()["mode"] == "rw"
    with BlockDev(dd.path) as bd:
        assert bd.read(0) == block_data(seed, 0) and bd.read(1) == block_data(seed, 1)
        assert bd.read(10) == ddlib.ZERO, "the block whose append failed came back"
    dd.remove()
    p = ddlib.dedup_check(medium_disk.path, data)
    assert p.returncode == 0, p.stdout + p.stderr
