"""The newest superblock slot damaged on the medium after its commit.

The device then runs from the other slot, one commit older
(Documentation/dm-dedup.rst, "Flush, FUA and crashes"). That state may
reference data blocks which the newest commit freed; if they had been
written again since, the older state would read somebody else's data.
Two rules close this: a data block freed by a commit is reused only after
one more commit, and a read-write load writes the loaded state to the
other slot as well. Each test fills a small data device, frees one block
with a commit, makes a new write take a block (the freed one is the only
one), then damages the newest slot of a copy of the metadata taken at
that moment and loads the copy: every logical block must read content
it has held, and never the new write's.
"""

import json
import struct

import pytest

import ddlib
from ddlib import BLOCK, MIB, BlockDev, block_data, run

DATA_BLOCKS = 64
LOGICAL_BLOCKS = 256
SLOT_TXN = 16          # offset of txn in a block header (dedup-format.h)
SB_JOURNAL_SEQ = 224   # journal_seq, then journal_id (Documentation/dedup-format.rst)


def slot_txns(path):
    with open(path, "rb") as f:
        raw = f.read(2 * BLOCK)
    return [struct.unpack_from("<Q", raw, s * BLOCK + SLOT_TXN)[0] for s in (0, 1)]


def newest_slot(path):
    txns = slot_txns(path)
    return txns.index(max(txns))


def newest_journal(path):
    """(epoch, journal id) of the newest superblock slot of the file at PATH."""
    with open(path, "rb") as f:
        f.seek(newest_slot(path) * BLOCK)
        raw = f.read(BLOCK)
    return struct.unpack_from("<QQ", raw, SB_JOURNAL_SEQ)


def damage(path, block):
    """Flip bytes inside the payload: the checksum no longer matches."""
    with open(path, "r+b") as f:
        f.seek(block * BLOCK + 512)
        old = f.read(64)
        f.seek(block * BLOCK + 512)
        f.write(bytes(b ^ 0xff for b in old))


def copy_file(src, dst):
    with open(src, "rb") as f, open(dst, "r+b") as g:
        while True:
            b = f.read(MIB)
            if not b:
                break
            g.write(b)


def load_newest_damaged(name, snap, snap_file, data, opts):
    """Damage the newest superblock slot of the copy at SNAP_FILE and load
    it (as NAME, over DATA): the target must say it falls back. Returns
    the device, both slots' transaction ids and the damaged slot."""
    txns = slot_txns(snap_file)
    newest = newest_slot(snap_file)
    damage(snap_file, newest)
    k = ddlib.Kmsg()
    dev = ddlib.DedupDev.create(ddlib.NAME_PREFIX + name, snap, data,
                                LOGICAL_BLOCKS * ddlib.SECTORS_PER_BLOCK, opts)
    assert any("superblock slot %d is damaged" % newest in line for line in k.lines()), \
        "\n".join(k.lines())
    k.close()
    return dev, txns, newest


@pytest.mark.parametrize("when", ["while_running", "after_a_crash_and_load"])
def test_older_slot_never_reads_reused_data(backing, seed, when):
    meta = backing.loop(16, "meta")
    meta_file = backing.files[-1]
    data = backing.loop(DATA_BLOCKS * BLOCK / MIB, "data")
    snap = backing.loop(16, "snap")          # not "meta*": checked here, not at cleanup
    snap_file = backing.files[-1]
    opts = ("commit_interval", "3600")
    dev = ddlib.DedupDev.create(ddlib.NAME_PREFIX + "fb", meta, data,
                                LOGICAL_BLOCKS * ddlib.SECTORS_PER_BLOCK, opts)
    held = {lba: {ddlib.ZERO} for lba in range(LOGICAL_BLOCKS)}
    blocks = [block_data(seed, i) for i in range(DATA_BLOCKS)]
    new = block_data(seed, 1000)
    with BlockDev(dev.path) as b:
        b.write_range(0, blocks)                 # the data device is full
        for lba, c in enumerate(blocks):
            held[lba].add(c)
        b.fsync()
        b.write(0, blocks[1])                    # frees lba 0's block ...
        held[0].add(blocks[1])
        b.fsync()                                # ... in this commit
    assert int(dev.stats()["data_blocks_live"]) == DATA_BLOCKS - 1

    if when == "after_a_crash_and_load":
        # The crash: the metadata as it is right after that commit, loaded
        # again. The other slot holds the commit before, which still maps
        # lba 0 to the freed block.
        copy_file(meta_file, snap_file)
        dev.remove()
        copy_file(snap_file, meta_file)
        dev.activate()

    with BlockDev(dev.path) as b:
        b.write(100, new)                        # takes the freed block
    held[100].add(new)
    copy_file(meta_file, snap_file)              # the medium at this moment
    dev.remove()

    ro, txns, newest = load_newest_damaged("fbro", snap, snap_file, data,
                                           opts + ("read_only",))
    assert ro.status()["transaction_id"] == txns[1 - newest]
    with BlockDev(ro.path, readonly=True) as b:
        got = b.read_range(0, LOGICAL_BLOCKS)
    ro.remove()
    wrong = [lba for lba in range(LOGICAL_BLOCKS) if got[lba] not in held[lba]]
    assert not wrong, "blocks reading content they never held: %s%s" % (
        wrong[:8], " (lba 0 reads the new write)" if got[0] == new else "")
    # The offline checker, run on the same copy, takes the same slot; a
    # reused block would fail its fingerprint.
    p = run([ddlib.DEDUP_BIN, "check", "--json", snap, "--data", data], check=False)
    summary = json.loads(p.stdout)["summary"]
    assert summary["fingerprint_mismatches"] == 0, p.stdout + p.stderr
    assert summary["data_blocks_verified"] == DATA_BLOCKS - 1, p.stdout + p.stderr


def test_a_lost_activation_never_continues_the_next_journal(backing, seed):
    """An activation that replays nothing writes the loaded state as the
    next generation and appends after it; its generation is then damaged
    before any checkpoint. The next activation falls back to the older
    slot, which holds the same state one epoch earlier, and starts its
    epoch where the lost activation started. After one append of its own
    and a crash, replay must stop after that append: the lost
    activation's appends further on in the ring are not this journal's
    (Documentation/dedup-format.rst, "Epochs and stale blocks")."""
    # Not "meta*": the copies write to the same data device after it
    # stops, so the cleanup's check of it would find its blocks reused.
    meta = backing.loop(16, "first")
    meta_file = backing.files[-1]
    data = backing.loop(DATA_BLOCKS * BLOCK / MIB, "data")
    snap = backing.loop(16, "snap")          # not "meta*": checked here, not at cleanup
    snap_file = backing.files[-1]
    crashed = backing.loop(16, "crashed")
    crashed_file = backing.files[-1]
    opts = ("commit_interval", "3600")
    sectors = LOGICAL_BLOCKS * ddlib.SECTORS_PER_BLOCK
    dev = ddlib.DedupDev.create(ddlib.NAME_PREFIX + "fj", meta, data, sectors, opts)
    base = [block_data(seed, i) for i in range(8)]
    with BlockDev(dev.path) as b:
        b.write_range(0, base)
        b.fsync()
    dev.remove()                                 # a clean close: nothing to replay
    dev.activate()
    lost = {lba: block_data(seed, 100 + lba) for lba in range(10, 14)}
    with BlockDev(dev.path) as b:
        for lba, c in lost.items():              # an append each
            b.write(lba, c)
            b.fsync()
    copy_file(meta_file, snap_file)              # the medium at a crash
    dev.remove()

    lost_epoch, lost_id = newest_journal(snap_file)
    after, _, _ = load_newest_damaged("fja", snap, snap_file, data, opts)
    new = block_data(seed, 1000)
    with BlockDev(after.path) as b:
        b.write(20, new)
        b.fsync()
    copy_file(snap_file, crashed_file)           # a second crash
    after.remove()
    # The case at hand: the same epoch as the lost activation's.
    epoch, journal_id = newest_journal(crashed_file)
    assert epoch == lost_epoch, (epoch, lost_epoch)
    assert journal_id != lost_id

    ro = ddlib.DedupDev.create(ddlib.NAME_PREFIX + "fjro", crashed, data, sectors,
                               opts + ("read_only",))
    with BlockDev(ro.path, readonly=True) as b:
        got = b.read_range(0, 32)
    ro.remove()
    assert got[20] == new, "the append after the fallback is lost"
    back = [lba for lba in lost if got[lba] != ddlib.ZERO]
    assert not back, "appends of the lost activation replayed: lbas %s read %s" % (
        back, ["its data" if got[lba] == lost[lba] else "other data" for lba in back])
    assert got[:8] == base
    p = run([ddlib.DEDUP_BIN, "check", "--json", crashed, "--data", data], check=False)
    assert p.returncode == 0, p.stdout + p.stderr
