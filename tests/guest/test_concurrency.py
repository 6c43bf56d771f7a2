"""Concurrent writers on the same and overlapping logical blocks (level 4).

Writer processes hammer one shared range with O_DIRECT writes drawn from a
small pool of contents (so that duplicates cross writers and blocks), zero
blocks, discards and fsyncs, while the test commits and reloads the table
underneath them. Each writer logs when every operation started and ended.

Oracle, per logical block: the content read back must be that of a write
to this block that nothing overwrote for sure, i.e. no other write to the
block started after it completed (a block never written reads zeros).
Then the accounting: after a commit, the data blocks in use must equal the
distinct contents the device holds, so concurrent writers of one content
stored it once and nothing leaked; after remove and create, the same
content reads back; the teardown runs `dedup check --data`.

Then the race that exact dedup must win: every round, all writers write
the same content, new to the device, at the same moment; it must be
stored once. (A build whose writers never wait for a twin in flight
stored 548 blocks for 256 contents here; the first test did not notice.)

Last, order (architecture D6): overlapping writes submitted together
take effect in the order they were submitted, although a duplicate is
mapped at once and new data only after its data write. The helper
tests/guest/helpers/orderwrite.c submits them with one io_submit call.
"""

import fcntl
import multiprocessing
import os
import random
import struct
import time

import pytest

import ddlib
from ddlib import BLOCK, BlockDev, block_data, digest, run

BLKDISCARD = 0x1277
WRITERS = 4
OPS = 3000              # per writer
RANGE = 512             # logical blocks all writers share
HOT = 16                # half the writes draw from these contents,
POOL = 400              # the other half from all of them: blocks die too
ZERO_ID = -1


def _writer(path, seed, wid, out):
    """One writer process: OPS random operations, each logged as
    (lba, content id, start, end)."""
    rnd = random.Random(seed * 7919 + wid)
    pool = [block_data(seed, i) for i in range(POOL)]
    log = []
    with BlockDev(path) as bd:
        for _ in range(OPS):
            op = rnd.random()
            lba = rnd.randrange(RANGE)
            if op < 0.80:
                cid = rnd.randrange(HOT if rnd.random() < 0.5 else POOL)
                t0 = time.monotonic()
                bd.write(lba, pool[cid])
                log.append((lba, cid, t0, time.monotonic()))
            elif op < 0.88:
                t0 = time.monotonic()
                bd.write(lba, ddlib.ZERO)
                log.append((lba, ZERO_ID, t0, time.monotonic()))
            elif op < 0.96:
                n = min(rnd.randrange(1, 9), RANGE - lba)
                t0 = time.monotonic()
                fcntl.ioctl(bd.fd, BLKDISCARD,
                            struct.pack("QQ", lba * BLOCK, n * BLOCK))
                t1 = time.monotonic()
                log += [(b, ZERO_ID, t0, t1) for b in range(lba, lba + n)]
            else:
                bd.fsync()
    with open(out, "w") as f:
        for e in log:
            f.write("%d %d %.9f %.9f\n" % e)


def _read_log(path):
    with open(path) as f:
        for line in f:
            lba, cid, t0, t1 = line.split()
            yield int(lba), int(cid), float(t0), float(t1)


def _allowed(logs):
    """{lba: set of content ids it may hold}: the writes to it that no
    other write to it surely overwrote."""
    per_lba = {}
    for e in logs:
        per_lba.setdefault(e[0], []).append(e)
    allowed = {}
    for lba, ws in per_lba.items():
        last_start = max(w[2] for w in ws)
        # w survives unless some write started after w had completed
        allowed[lba] = {w[1] for w in ws if w[3] >= last_start}
    return allowed


def _check_contents(path, seed, allowed):
    by_digest = {digest(block_data(seed, i)): i for i in range(POOL)}
    by_digest[digest(ddlib.ZERO)] = ZERO_ID
    bad, held = [], {}
    with BlockDev(path) as bd:
        blocks = bd.read_range(0, RANGE)
    for lba, data in enumerate(blocks):
        cid = by_digest.get(digest(data), "foreign")
        held[lba] = cid
        if cid not in allowed.get(lba, {ZERO_ID}):
            bad.append((lba, cid, sorted(allowed.get(lba, {ZERO_ID}))))
    assert not bad, "%d blocks hold content no surviving write gave them " \
        "(lba, held, allowed): %s" % (len(bad), bad[:20])
    return held


# With early_ack, one-block writes are hashed and decided in batches
# (dd_hash_batch_work), acknowledged before they are decided.
@pytest.mark.parametrize("opts", [(), ("hash", "crc32c", "verify"),
                                  ("hash", "xxhash64", "verify", "early_ack")],
                         ids=["sha256", "crc32c-verify", "xxhash64-verify-early_ack"])
def test_concurrent_writers_overlapping_ranges(make_dedup, backing, seed, opts):
    dd = make_dedup(16, 64, 64, opts=list(opts))
    outs = [os.path.join(backing.tmpfs, "writer%d-%d.log" % (w, os.getpid()))
            for w in range(WRITERS)]
    try:
        _hammer(dd, seed, opts, outs)
    finally:
        for o in outs:
            if os.path.exists(o):
                os.unlink(o)


def _hammer(dd, seed, opts, outs):
    table = dd.table()
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(dd.path, seed, w, outs[w]))
             for w in range(WRITERS)]
    for p in procs:
        p.start()
    # Commits and reloads while the writers run, a reload first.
    reloads = commits = 0
    while any(p.is_alive() for p in procs):
        time.sleep(0.3)
        dd.commit()
        commits += 1
        if commits % 3 == 1:
            run(["dmsetup", "reload", dd.name, "--table", table])
            dd.suspend()
            dd.resume()
            reloads += 1
    for p in procs:
        p.join()
        assert p.exitcode == 0, "writer failed with exit code %s" % p.exitcode
    assert reloads >= 1, "the writers finished before any reload ran"

    logs = [e for o in outs for e in _read_log(o)]
    allowed = _allowed(logs)
    held = _check_contents(dd.path, seed, allowed)

    dd.commit()
    st = dd.status()
    live = {c for c in held.values() if c != ZERO_ID}
    assert st["mode"] == "rw", st["raw"]
    assert st["data_used"] == len(live), \
        "data blocks in use %d, distinct contents held %d: %s" % (
            st["data_used"], len(live), st["raw"])
    assert st["mapped"] == sum(1 for c in held.values() if c != ZERO_ID), st["raw"]
    ddlib.report("concurrency %s: %d writers, %d logged block writes, %d commits, "
                 "%d reloads, %d distinct contents stored" % (
                     "+".join(opts) or "sha256", WRITERS, len(logs), commits,
                     reloads, len(live)))

    dd.remove()
    dd.activate(table)
    assert _check_contents(dd.path, seed, allowed) == held


ROUNDS = 256


def _same_content_writer(path, seed, wid, barrier):
    """Round r: after every writer is ready, write fresh content r to this
    writer's own block r, so that all writers store one new content at
    once."""
    with BlockDev(path) as bd:
        for r in range(ROUNDS):
            data = block_data(seed, 10_000 + r)
            barrier.wait(timeout=120)
            bd.write(wid * ROUNDS + r, data)


@pytest.mark.parametrize("opts", [(), ("hash", "crc32c", "verify")],
                         ids=["sha256", "crc32c-verify"])
def test_concurrent_writers_of_new_content_store_it_once(make_dedup, seed, opts):
    """Every round, all writers write the same content, new to the device,
    at the same moment (a barrier per round): exactly one of them may store
    it, the others must wait for it (or find it) and share it. With verify,
    those that waited are compared with its data in memory
    (dd_inflight_twins), the others read it back."""
    dd = make_dedup(16, 64, 64, opts=list(opts))
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(WRITERS)
    procs = [ctx.Process(target=_same_content_writer, args=(dd.path, seed, w, barrier))
             for w in range(WRITERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        assert p.exitcode == 0, "writer failed with exit code %s" % p.exitcode
    with BlockDev(dd.path) as bd:
        blocks = bd.read_range(0, WRITERS * ROUNDS)
    bad = [lba for lba, data in enumerate(blocks)
           if data != block_data(seed, 10_000 + lba % ROUNDS)]
    assert not bad, "%d blocks read other content, first %s" % (len(bad), bad[:10])
    dd.commit()
    st = dd.status()
    assert (st["data_used"], st["mapped"], st["unique_writes"]) == \
        (ROUNDS, WRITERS * ROUNDS, ROUNDS), \
        "%d contents written %d times each at once: %s" % (ROUNDS, WRITERS, st["raw"])
    if opts:
        stats = dd.stats()
        assert int(stats["verify_mismatches"]) == 0, stats
        ddlib.report("same new content, %d writers x %d rounds: %s verify reads" % (
            WRITERS, ROUNDS, stats["verify_reads"]))


ORDER_ROUNDS = 600


@pytest.mark.parametrize("opts", [(), ("early_ack",)], ids=["default", "early_ack"])
def test_overlapping_writes_in_flight_take_effect_in_submission_order(make_dedup, seed, opts):
    """Round r: eight O_DIRECT writes of 1-4 blocks within the same four
    blocks, each block new content, a duplicate or zeros, submitted at once:
    every block must read back as the last write to it wrote it. (The build
    before logical block cells got 1045 of the 2400 blocks wrong here: a
    duplicate submitted last lost to new data submitted before it whenever
    that data's write finished later.)"""
    orderwrite = ddlib.build_helper("orderwrite")
    dd = make_dedup(16, 64, 64, opts=list(opts))
    p = run([orderwrite, dd.path, str(ORDER_ROUNDS), str(seed)], check=False,
            timeout=1200)
    ddlib.report("order: " + (p.stdout.strip().splitlines() or ["no output"])[-1])
    assert p.returncode == 0, "blocks read back wrong:\n%s%s" % (p.stdout[-4000:], p.stderr)
    # The writes really were in flight together: some waited their turn.
    stats = dd.stats()
    assert int(stats["ordered_waits"]) > 0, stats
    if opts:
        assert int(stats["early_acks"]) > 0, stats
