"""Activation from the state saved at a clean close.

Removing a device saves its fingerprint index and allocation state on the
metadata device; the next activation loads them instead of walking every
tree. A save is used only for exactly the superblock that names it: the
first commit after a load drops it, and a damaged save, one for other
device sizes, or a table reload all fall back to the rebuild, with the
same content and the same dedup decisions.
"""

import os
import re
import struct

import ddlib
from ddlib import BLOCK, BlockDev, DedupDev, block_data, dm_linear, dm_swap_table, \
    run, verify_blocks, write_ids
from test_table import refusal

SB_MAGIC = 0x3130505544454444
# unique, duplicate and zero blocks
LAYOUT = [0, 1, 2, 3, 0, 1, None, 4, 4, 4, None, 5, 2, 6, 7, 0] * 4


def newest_superblock(meta):
    """(generation, saved_root, saved_words) of the newest valid slot."""
    best = None
    with BlockDev(meta, readonly=True) as bd:
        for slot in range(2):
            b = bd.read(slot)
            if struct.unpack_from("<Q", b, 32)[0] != SB_MAGIC:
                continue
            txn = struct.unpack_from("<Q", b, 16)[0]
            if best is None or txn > best[0]:
                best = (txn,) + struct.unpack_from("<QQ", b, 192)
    assert best, "no superblock on %s" % meta
    return best


INDEX_LINE = re.compile(r"device-mapper: dedup: (\d+:\d+): index of (\d+) blocks "
                        r"(loaded from the last clean close|rebuilt from the metadata) "
                        r"in (\d+) ms$")


def index_loaded(dev):
    """Whether the last activation (create, or the resume after a reload)
    loaded the saved index. Its stats must agree with the one line the
    kernel logged for it: "<dev>: index of <n> blocks loaded from the last
    clean close | rebuilt from the metadata in <t> ms" (every device here
    holds blocks, so the line is always there): activation_ms is t,
    index_entries n, index_loaded whether it says loaded."""
    st = dev.stats()
    st_dev = os.stat(dev.path).st_rdev
    name = "%d:%d" % (os.major(st_dev), os.minor(st_dev))
    found = [m for m in (INDEX_LINE.search(l) for l in dev.activation_log) if m]
    assert len(found) == 1 and found[0].group(1) == name, \
        "expected one 'index of ... in <t> ms' line for %s at its activation: %s" % (
            name, dev.activation_log[-10:])
    _, n, how, ms = found[0].groups()
    assert int(st["activation_ms"]) == int(ms), (st["activation_ms"], found[0].group(0))
    assert int(st["index_entries"]) == int(n), (st["index_entries"], found[0].group(0))
    loaded = st["index_loaded"] == "1"
    assert loaded == how.startswith("loaded"), (st["index_loaded"], found[0].group(0))
    return loaded


def remove_with_save(dev):
    with ddlib.Kmsg() as k:
        dev.remove()
        lines = k.lines()
    assert any("saved for the next activation" in l for l in lines), lines[-5:]
    gen, root, words = newest_superblock(dev.meta)
    assert root and words, "the superblock does not name the save"
    return gen


def test_clean_close_saves_and_the_next_activation_loads(dedup, seed):
    exp = write_ids(dedup.path, seed, LAYOUT)
    # Overwriting every copy of one block frees it: the allocation state
    # has a hole. Two commits make it free, not cooling.
    with BlockDev(dedup.path) as bd:
        for lba in (15, 31, 47, 63):
            exp[lba] = block_data(seed, 100)
            bd.write(lba, exp[lba])
    dedup.commit()
    dedup.commit()
    st1 = dedup.status()
    stats1 = dedup.stats()
    remove_with_save(dedup)

    dedup.activate()
    assert index_loaded(dedup)
    assert dedup.stats()["index_entries"] == stats1["index_entries"]
    assert ddlib.counters(dedup.status()) == ddlib.counters(st1)
    # Loading rewrites the loaded state as the next generation: the save
    # is named by no superblock any more.
    assert newest_superblock(dedup.meta)[1] == 0
    verify_blocks(dedup.path, exp, nblocks=len(LAYOUT) + 8)

    # The loaded index still finds every stored block (its key came back).
    dup = write_ids(dedup.path, seed, [0, 1, 2, 3, 4, 5, 6, 100], start=200)
    st2 = dedup.status()
    assert st2["duplicate_writes"] == st1["duplicate_writes"] + 8, st2
    assert st2["data_used"] == st1["data_used"], st2
    # The loaded allocator hands out only free blocks.
    new = write_ids(dedup.path, seed, list(range(300, 340)), start=400)
    dedup.commit()
    exp.update(dup)
    exp.update(new)
    verify_blocks(dedup.path, exp)
    assert dedup.status()["data_used"] == st1["data_used"] + 40


def test_read_only_activation_loads_and_keeps_the_save(dedup, seed):
    exp = write_ids(dedup.path, seed, LAYOUT)
    remove_with_save(dedup)
    named = newest_superblock(dedup.meta)
    table = dedup.table_line()
    ro = DedupDev(dedup.name, dedup.meta, dedup.data, dedup.logical_sectors,
                  ["read_only"])
    ro.activate()
    assert index_loaded(ro)
    verify_blocks(ro.path, exp, nblocks=len(LAYOUT))
    ro.remove()
    assert newest_superblock(dedup.meta) == named, "a read-only activation dropped the save"
    dedup.activate(table)
    assert index_loaded(dedup)
    verify_blocks(dedup.path, exp, nblocks=len(LAYOUT))


def corrupt_a_save_leaf(meta):
    """Flip one byte in a block of the save: a leaf past the header when
    the tree has them, else its root."""
    _, root, _ = newest_superblock(meta)
    with BlockDev(meta) as bd:
        blk = bytearray(bd.read(root))
        level = blk[25]
        victim = root
        if level:
            children = [c for c in struct.unpack_from("<508Q", blk, 32) if c]
            victim = children[-1]
            blk = bytearray(bd.read(victim))
        blk[2048] ^= 0xff
        bd.write(victim, bytes(blk))
        bd.fsync()


def test_damaged_save_is_rebuilt(dedup, seed):
    exp = write_ids(dedup.path, seed, LAYOUT)
    st1 = dedup.status()
    remove_with_save(dedup)
    corrupt_a_save_leaf(dedup.meta)
    with ddlib.Kmsg() as k:
        dedup.activate()
        lines = k.lines()
    assert any("not usable" in l and "rebuilding" in l for l in lines), lines[-8:]
    assert not index_loaded(dedup)
    assert ddlib.counters(dedup.status()) == ddlib.counters(st1)
    verify_blocks(dedup.path, exp, nblocks=len(LAYOUT))
    write_ids(dedup.path, seed, list(range(8)), start=200)
    assert dedup.status()["data_used"] == st1["data_used"]


def test_other_sizes_rebuild(backing, make_dedup, seed):
    dev = make_dedup(data_mib=16)
    exp = write_ids(dev.path, seed, LAYOUT)
    remove_with_save(dev)
    with open(backing.files[-1], "r+b") as f:   # the data loop's file
        f.truncate(32 * ddlib.MIB)
    run(["losetup", "-c", dev.data])
    with ddlib.Kmsg() as k:
        dev.activate()
        lines = k.lines()
    assert any("sizes changed" in l for l in lines), lines[-8:]
    assert not index_loaded(dev)
    assert dev.status()["data_total"] == 32 * ddlib.MIB // BLOCK
    verify_blocks(dev.path, exp, nblocks=len(LAYOUT))


def test_reload_does_not_save(dedup, seed):
    exp = write_ids(dedup.path, seed, LAYOUT)
    with ddlib.Kmsg() as k:
        dedup.suspend()
        dedup.reload()
        lines = k.lines()
    # The old table goes after the new one opened the metadata: no save.
    assert not any("saved for the next activation" in l for l in lines), lines
    assert not index_loaded(dedup)
    verify_blocks(dedup.path, exp, nblocks=len(LAYOUT))


def test_no_save_after_a_failed_final_commit(backing, seed):
    """A crash, as the metadata sees it: the last commit stays, no save is
    written, and the next activation rebuilds."""
    meta_raw = backing.loop(16, "meta")
    data = backing.loop(64, "data")
    meta, sectors = dm_linear("ddtameta", meta_raw)
    dev = DedupDev.create("ddtact", meta, data, 128 * ddlib.MIB // 512,
                          ["commit_interval", "3600"])
    exp = write_ids(dev.path, seed, LAYOUT)
    dev.commit()
    remove_with_save(dev)
    dev.activate()
    assert index_loaded(dev)
    with BlockDev(dev.path) as bd:
        bd.write(500, block_data(seed, 500))   # never committed
    dm_swap_table("ddtameta", "0 %d flakey %s 0 0 1 1 error_writes" % (sectors, meta_raw))
    dev.remove()
    dm_swap_table("ddtameta", "0 %d linear %s 0" % (sectors, meta_raw))
    assert newest_superblock(meta)[1] == 0
    dev.activate()
    assert not index_loaded(dev)
    verify_blocks(dev.path, exp, nblocks=len(LAYOUT))
    with BlockDev(dev.path) as bd:
        assert bd.read(500) == ddlib.ZERO
    dev.remove()
    run(["dmsetup", "remove", "ddtameta"])


def test_every_sixteenth_activation_walks(dedup, seed):
    """A load trusts what the last instance had in RAM: after 16 loads in
    a row the activation walks the trees (and draws a new index key)."""
    exp = write_ids(dedup.path, seed, LAYOUT)
    for _ in range(16):
        dedup.remove()
        dedup.activate()
        assert index_loaded(dedup)
    with ddlib.Kmsg() as k:
        dedup.remove()
        dedup.activate()
        lines = k.lines()
    assert any("loaded 16 times since the last walk" in l for l in lines), lines[-8:]
    assert not index_loaded(dedup)
    verify_blocks(dedup.path, exp, nblocks=len(LAYOUT))
    dedup.remove()
    dedup.activate()
    assert index_loaded(dedup)
    # Still the same dedup decisions after the new key.
    before = dedup.status()
    write_ids(dedup.path, seed, list(range(8)), start=300)
    assert dedup.status()["data_used"] == before["data_used"]


def test_two_targets_of_one_table_on_the_same_devices_refused(backing):
    """Not a reload: both would open the metadata read-write."""
    meta = backing.loop(16, "meta")
    data = backing.loop(64, "data")
    n = 64 * ddlib.MIB // 512
    table = "0 %d dedup %s %s\n%d %d dedup %s %s\n" % (n, meta, data, n, n, meta, data)
    with ddlib.Kmsg() as k:
        p = run(["dmsetup", "create", "ddttwo"], input=table, check=False)
        lines = k.lines()
    assert p.returncode != 0
    assert not ddlib.dm_exists("ddttwo")
    msg, _ = refusal(lines)             # only what this create logged
    assert msg == "Device already in use by another dedup target", msg
