"""Metadata corruption campaign (tests/README.md, "Test levels" 5; tools issue: the checker
names every corrupted block).

A dedup device is filled in two committed steps (states S1 and S2), then
a third step is made durable by fsyncs only (S3, in the journal) and the
device stops as in a crash (its metadata device fails under the final
commit).  Each trial damages one metadata block of a copy of that metadata:
flipped bits, a zeroed block, or another block's content written over it (a
misdirected write).  Then:
  * `dedup check --json` must not call the device clean with the damage in
    place: a damaged tree block is listed as a problem at that block; a
    damaged superblock slot is reported as not valid (the checker, like the
    kernel, may then use the other slot); a damaged journal block ends the
    journal there (a torn append, not an error: the checker reports fewer
    blocks replayed);
  * damage the format says the kernel must tolerate (Documentation/
    dedup-format.rst, "Superblock slots and generations", "Replay") must
    activate read-write and read back exactly the state it leaves: the
    older superblock slot (1 - cur) damaged, the kernel uses the newest one
    and replays its whole journal (S3; a damaged, not zeroed, slot is
    logged); a damaged journal block ends the journal there (a torn tail),
    and the state is the one after the last append whole before it (S2 if
    none), the number of appends `dedup check` replayed;
  * any other damage (a tree block, the current slot): the kernel either
    refuses the table with one dm core line carrying the target's reason,
    or activates it; then every logical block reads its S2 content, or its
    S1 content (the previous commit, if the newest superblock was lost), or
    fails with EIO, or its content after one of the three fsyncs whose
    append the journal still holds whole (S3 after the last): never
    another block's content, never garbage.  A write
    of a new block either fails or reads back.  The kernel log must stay
    free of WARN/BUG/Oops (the kmsg fixture).
Damaged blocks are picked among the blocks the current superblock reaches,
found here by walking the trees independently of the checker, and the
journal blocks that follow it.
"""

import errno
import json
import random
import shutil
import struct

import ddlib
from ddlib import BLOCK, MIB, ZERO, BlockDev, DedupDev, block_data, digest, run
from test_table import refusal

META_MIB, DATA_MIB, LOGICAL_MIB = 16, 32, 64
NB = 1024
TRIALS = max(24, ddlib.TORTURE_TRIALS * 8)   # make torture TRIALS=N: 8N damaged copies
FANOUT = (BLOCK - 32) // 8


def fill(dev, seed):
    """Two committed states, then three appends; returns S1, S2 and the
    state after each append (S3 is the last), each as {lba: bytes}."""
    rng = random.Random(seed)
    pool = [rng.randrange(1 << 30) for _ in range(64)]
    state = {}
    with BlockDev(dev.path) as bd:
        for lba in range(0, 700):
            bid = None if lba % 17 == 0 else rng.choice(pool) if rng.random() < 0.5 else lba
            bd.write(lba, block_data(seed, bid))
            if bid is not None:
                state[lba] = block_data(seed, bid)
    dev.commit()
    s1 = dict(state)
    with BlockDev(dev.path) as bd:
        for lba in rng.sample(range(NB), 250):
            bid = rng.choice(pool) if rng.random() < 0.4 else 5000 + lba
            bd.write(lba, block_data(seed, bid))
            state[lba] = block_data(seed, bid)
    ddlib.discard(dev.path, 100, 16)
    for lba in range(100, 116):
        state.pop(lba, None)
    dev.commit()
    s2 = dict(state)
    appended = []
    with BlockDev(dev.path) as bd:
        for k in range(3):                  # three appends
            for lba in rng.sample(range(NB), 40):
                bid = rng.choice(pool) if rng.random() < 0.4 else 9000 + 100 * k + lba
                bd.write(lba, block_data(seed, bid))
                state[lba] = block_data(seed, bid)
            bd.fsync()
            appended.append(dict(state))
    return s1, s2, appended


def journal_blocks(rep):
    """The metadata blocks of the journal that follows the superblock."""
    j = rep["journal"]
    return [j["start"] + (j["epoch"] + k) % j["blocks"] for k in range(j["blocks_in_epoch"])]


def live_tree_blocks(img, sb):
    """{block: (array name, level)} reachable from the superblock's roots."""
    out = {}
    for name in ("map", "refcount", "fingerprint"):
        todo = [sb[name + "_root"]]
        while todo:
            b = todo.pop()
            if not b or b in out:
                continue
            hdr = img[b * BLOCK:b * BLOCK + 32]
            level = hdr[25]
            out[b] = (name, level)
            if level:
                todo += [c for c in struct.unpack_from("<%dQ" % FANOUT, img, b * BLOCK + 32) if c]
    return out


def corrupt(img, target, kind, rng, live):
    blk = bytearray(img[target * BLOCK:(target + 1) * BLOCK])
    if kind == "bitflip":
        for _ in range(rng.randint(1, 8)):
            bit = rng.randrange(BLOCK * 8)
            blk[bit // 8] ^= 1 << (bit % 8)
    elif kind == "zero":
        blk = bytearray(BLOCK)
    else:                                   # misdirected: another block's content
        other = rng.choice([b for b in live if b != target] or [0 if target else 1])
        blk = bytearray(img[other * BLOCK:(other + 1) * BLOCK])
        if blk == img[target * BLOCK:(target + 1) * BLOCK]:
            blk[40] ^= 0xff
    out = bytearray(img)
    out[target * BLOCK:(target + 1) * BLOCK] = blk
    return bytes(out)


def check_names(meta, target, where, kind, rep0_replayed):
    p = run([ddlib.DEDUP_BIN, "check", "--json", "--max-problems", "0", meta], check=False)
    rep = json.loads(p.stdout)
    if where == "journal":
        assert rep["exit_code"] == 0 and \
            rep["journal"]["replayed_blocks"] < rep0_replayed, \
            "check after %s of journal block %d: exit %d, journal %s" % (
                kind, target, p.returncode, json.dumps(rep.get("journal")))
    elif where == "tree":
        hit = [q for q in rep.get("problems", []) if q.get("block") == target or
               " %d" % target in q.get("message", "")]
        assert rep["exit_code"] == 4 and hit, \
            "check did not name damaged block %d (%s): exit %d, %s" % (
                target, kind, p.returncode, json.dumps(rep.get("problems", [])[:5]))
    else:
        states = {s["slot"]: s["state"] for s in rep.get("slots", [])}
        assert states.get(target) in ("bad", "zero"), \
            "check says superblock slot %d is %s after %s" % (target, states.get(target), kind)
    return rep


def read_all(path, allowed):
    """Every LBA reads one of its allowed contents or fails with EIO."""
    bad, eio = [], 0
    with BlockDev(path) as bd:
        for lba in range(NB):
            try:
                got = bd.read(lba)
            except OSError as e:
                assert e.errno == errno.EIO, "read of block %d: %s" % (lba, e)
                eio += 1
                continue
            if got not in allowed[lba]:
                bad.append((lba, [digest(a) for a in allowed[lba]], digest(got)))
    assert not bad, "%d blocks read wrong data: %s" % (len(bad), bad[:10])
    return eio


def test_metadata_corruption_campaign(backing, kmsg_check, seed):
    meta_loop = backing.loop(META_MIB, "meta")
    meta_file = backing.files[-1]
    meta, meta_sectors = ddlib.dm_linear("ddtccm", meta_loop)
    data = backing.loop(DATA_MIB, "data")
    data_file = backing.files[-1]
    # only the two explicit commits: the older superblock slot holds S1
    opts = ["commit_interval", "3600"]
    table = ddlib.table_line(meta, data, LOGICAL_MIB * MIB // 512, opts)
    dev = DedupDev.create("ddtcc", meta, data, LOGICAL_MIB * MIB // 512, opts)
    s1, s2, s3s = fill(dev, seed)
    # the crash: the final commit fails, the appends stay in the journal
    ddlib.dm_swap_table("ddtccm", "0 %d error" % meta_sectors)
    dev.remove()
    ddlib.dm_swap_table("ddtccm", "0 %d linear %s 0" % (meta_sectors, meta_loop))
    # a damaged journal block ends replay after an earlier append
    allowed = {lba: {s.get(lba, ZERO) for s in [s1, s2] + s3s} for lba in range(NB)}

    p = run([ddlib.DEDUP_BIN, "check", "--json", meta_file])
    rep0 = json.loads(p.stdout)
    sb = rep0["superblock"]
    jblocks = journal_blocks(rep0)
    assert rep0["journal"]["appends"] == 3 and len(jblocks) >= 3, rep0["journal"]
    with open(meta_file, "rb") as f:
        pristine = f.read()
    shutil.copyfile(data_file, data_file + ".pristine")
    backing.files.append(data_file + ".pristine")
    live = live_tree_blocks(pristine, sb)
    assert len(live) >= 8, live
    cur = sb["slot"]
    targets = [("tree", b) for b in sorted(live)] + [("sb", cur), ("sb", 1 - cur)] + \
        [("journal", b) for b in jblocks]

    rng = random.Random(seed)
    states = [s2] + s3s                     # after 0, 1, 2 and 3 appends
    tally = {"refused": 0, "rw": 0, "ro": 0, "eio_reads": 0, "writes_ok": 0,
             "older_slot_tolerated": 0, "torn_journal_tolerated": 0}
    trials = max(TRIALS, len(targets))      # every block at least once
    for trial in range(trials):
        where, target = targets[trial % len(targets)] if trial < len(targets) else \
            rng.choice(targets)
        kind = ("bitflip", "zero", "misdirect")[rng.randrange(3)]
        ctx = "trial %d: %s block %d (%s)" % (
            trial, kind, target, "journal" if where == "journal" else
            live.get(target, ("superblock",))[0])
        img = corrupt(pristine, target, kind, rng, list(live))
        with open(meta_file, "r+b") as f:
            f.write(img)
        try:
            # the image file, not the loop: its block cache may be stale
            rep = check_names(meta_file, target, where, kind,
                              rep0["journal"]["replayed_blocks"])
        except AssertionError as e:
            raise AssertionError("%s: %s" % (ctx, e))
        # Damage the kernel must tolerate, and the state it then serves.
        tolerated = None
        if where == "sb" and target == 1 - cur:
            tolerated, expect = "older_slot_tolerated", states[-1]
        elif where == "journal":
            n = rep["journal"]["appends"]
            assert 0 <= n < len(states) - 1, "%s: check replayed %d appends" % (ctx, n)
            tolerated, expect = "torn_journal_tolerated", states[n]

        k = ddlib.Kmsg()
        p = ddlib.try_create("ddtcc", table)
        lines = k.lines()
        k.close()
        if p.returncode:
            assert not ddlib.dm_exists("ddtcc")
            try:
                msg, _ = refusal(lines)
            except AssertionError as e:
                raise AssertionError("%s: %s" % (ctx, e))
            assert tolerated is None, \
                "%s: the kernel must tolerate this damage, but refused the table: %s" % (
                    ctx, msg)
            tally["refused"] += 1
            continue
        path = "/dev/mapper/ddtcc"
        ddlib.udev_settle()
        mode = ddlib.parse_status(run(["dmsetup", "status", "ddtcc"]).stdout)["mode"]
        tally[mode if mode in tally else "ro"] += 1
        try:
            if tolerated:
                assert mode == "rw", "mode %s, not rw" % mode
                if where == "sb" and kind != "zero":
                    assert any("superblock slot %d is damaged; using slot %d" % (target, cur)
                               in l for l in lines), \
                        "no 'superblock slot %d is damaged' line: %s" % (target, lines[-8:])
                # exactly that state: no EIO, no other content
                eio = read_all(path, {lba: {expect.get(lba, ZERO)} for lba in range(NB)})
                assert eio == 0, "%d reads failed" % eio
                tally[tolerated] += 1
            else:
                tally["eio_reads"] += read_all(path, allowed)
        except AssertionError as e:
            raise AssertionError("%s (mode %s): %s" % (ctx, mode, e))
        lba = rng.randrange(NB, 2 * NB)
        new = block_data(seed, 77777 + trial)
        try:
            with BlockDev(path) as bd:
                bd.write(lba, new)
                bd.fsync()
                got = bd.read(lba)
            assert got == new, "%s: a new block read back wrong" % ctx
            tally["writes_ok"] += 1
        except OSError:
            if tolerated:
                raise AssertionError("%s: a write after tolerated damage failed" % ctx)
        ddlib.dm_remove("ddtcc")
        shutil.copyfile(data_file + ".pristine", data_file)
    ddlib.report("corruption campaign: %d trials over %d blocks (%d of the journal): %s" % (
        trials, len(targets), len(jblocks), tally))
    # every target is damaged at least once, so both kinds were activated
    assert tally["older_slot_tolerated"] >= 1 and tally["torn_journal_tolerated"] >= 1, tally
    # leave the pristine metadata for the oracle at cleanup
    with open(meta_file, "r+b") as f:
        f.write(pristine)
    shutil.copyfile(data_file + ".pristine", data_file)
