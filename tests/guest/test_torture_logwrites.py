"""Crash consistency by log replay (tests/README.md, "Test levels" 5).

One loop device carries both the metadata and the data of a dedup device, as
two dm-linear slices of a dm-log-writes device, so a single log records every
write the target makes to either, in the order the disk made them stable.
The workload sends a log mark after every point where it is owed durability
(an fsync returned, an O_DSYNC write completed).

Afterwards every crash point (a prefix of the log ending at a FLUSH or FUA
entry) is replayed, in order, onto zeroed files and examined on a scratch
copy (so recovery may write without disturbing the replay):
  * `dedup check` on the metadata slice is clean (or the device was never
    formatted: no superblock reached the disk yet); it runs again only once
    a replayed write has touched the metadata slice;
  * the target activates read-write, status mode rw (raw workload, once
    formatted: also read-only, straight on the replayed files);
  * once the read-write view is removed, `dedup check --data` is clean on
    the scratch copy the recovery wrote (replayed journal, its checkpoint,
    and the clean close): after every examined crash point in the raw and
    small-fsync workloads, after every fourth and the last one in the
    filesystem workloads (RECOVERED_CHECK_EVERY; about a second each there,
    a hundred points);
  * raw workload: every block made durable before the last mark reads back
    exactly, every other block reads its durable content or one written after
    that mark, never anything else; `mapped` equals the non-zero blocks; a
    new write after recovery reads back;
  * filesystem workloads: the filesystem mounts (journal recovery), every file
    fsynced before the last mark has its exact content, other files hold only
    their own blocks or zeros, and fsck is clean after unmount.
A crash point with no write or discard since the previous one and the same
last mark holds the same bytes under the same expectations: it is counted
as a repeat and not examined again.  With DD_TORTURE_TRIALS=N (make torture)
each workload runs N times with other seeds, and longer.
"""

import contextlib
import errno
import hashlib
import os
import random
import time

import pytest

import ddlib
import logwrites
from ddlib import BLOCK, MIB, ZERO, BlockDev, DedupDev, block_data, run

META_MIB, DATA_MIB = 16, 48
NB = 1024                       # raw workload: LBAs used (4 MiB)
TRIALS = ddlib.TORTURE_TRIALS
# The small-fsync workload: LBAs, fsyncs, and crash points examined. Its
# journal holds 64 blocks and each fsync appends one: the test command's
# 150 fsyncs wrap it 2.3 times (the test asserts two wraps) and 40 points
# took 210 s on a slow TCG host (200 fsyncs and 64 points took 418 s);
# make torture: 360 fsyncs, over five rings, and 120 points.
DB_LBAS = 16
DB_FSYNCS, DB_POINTS = (360, 120) if TRIALS else (150, 40)
# Files per filesystem workload; make torture examines 40 per trial. With
# the test command's 10, about 90 crash points on ext4 and 75 on XFS, in
# 278 s and 248 s on a slow TCG host (14 gave 110 and 83 in 389 s and
# 273 s): each workload stays well inside the 900 s per-test limit.
FS_FILES = 40 if TRIALS else 10
# `dedup check --data` on the recovered scratch copy: after every Nth
# read-write examination (and the last one) of a workload.
RECOVERED_CHECK_EVERY = {"raw": 1, "db": 1, "fs": 4}


class LogRig:
    """log-writes over one loop device, sliced into metadata and data."""

    def __init__(self, backing, logical_mib, opts=(), meta_mib=META_MIB, data_mib=DATA_MIB):
        self.backing = backing
        self.meta_mib, self.data_mib = meta_mib, data_mib
        self.total_mib = meta_mib + data_mib
        self.dev = backing.loop(self.total_mib, "lwdev")
        self.log = backing.loop(1024, "lwlog")
        self.log_file = backing.files[-1]
        self.lw = "ddtlw"
        run(["dmsetup", "create", self.lw, "--table", "0 %d log-writes %s %s" % (
            self.sectors(self.total_mib), self.dev, self.log)])
        self.slices = slice_pair("/dev/mapper/" + self.lw, "ddtlws", meta_mib, data_mib)
        self.logical = logical_mib * MIB // 512
        self.opts = list(opts)
        self.dedup = DedupDev("ddtlwx", self.slices[0], self.slices[1], self.logical, self.opts)
        self.marks = 0

    @staticmethod
    def sectors(mib):
        return mib * MIB // 512

    def mark(self):
        """Log mark k (k = 0, 1, ...): everything owed durability so far."""
        run(["dmsetup", "message", self.lw, "0", "mark", "d%d" % self.marks])
        self.marks += 1
        return self.marks - 1

    def finish(self):
        """Tear the stack down and return the parsed log."""
        if ddlib.dm_exists(self.dedup.name):
            self.dedup.remove()
        for s in ("ddtlwsm", "ddtlwsd"):
            ddlib.dm_remove(s)
        ddlib.dm_remove(self.lw)
        return logwrites.Log(self.log_file)


def slice_pair(dev, prefix, meta_mib, data_mib):
    """dm-linear slices <prefix>m (metadata) and <prefix>d (data) of dev."""
    m = meta_mib * MIB // 512
    d = data_mib * MIB // 512
    run(["dmsetup", "create", prefix + "m", "--table", "0 %d linear %s 0" % (m, dev)])
    run(["dmsetup", "create", prefix + "d", "--table", "0 %d linear %s %d" % (d, dev, m)])
    ddlib.udev_settle()
    return "/dev/mapper/" + prefix + "m", "/dev/mapper/" + prefix + "d"


class CrashImage:
    """The replay targets (metadata and data as two files), read-only loops
    over them, and two ways to look at one crash state:
      * read-only: the target opened with read_only straight on those loops;
      * read-write: the target on scratch copies of the replayed files, so
        recovery (and a filesystem's journal replay) may write without
        disturbing the replay.  Copying the sparse files is about twice as
        fast under TCG as a pair of throw-away dm-snapshots.
    It also tells which crash points are worth examining: flushes and marks
    change nothing on disk, so a point with no write or discard since the
    previous one holds the same bytes; when the durability owed (the last
    mark) is also the same, the examination would repeat itself."""

    def __init__(self, backing, rig, log, check_every=1):
        self.backing = backing
        self.rig = rig
        self.check_every = check_every
        self.files, self.loops, self.scratch, self.scratch_loops = {}, {}, {}, {}
        for k, mib in (("m", rig.meta_mib), ("d", rig.data_mib)):
            self.loops[k] = backing.loop(mib, "replay" + k, read_only=True)
            self.files[k] = backing.files[-1]
            self.scratch_loops[k] = backing.loop(mib, "scratch" + k)
            self.scratch[k] = backing.files[-1]
        self.replayer = logwrites.Replayer(log, [
            (0, rig.meta_mib * MIB, self.files["m"]),
            (rig.meta_mib * MIB, rig.data_mib * MIB, self.files["d"])])
        self.checked = 0            # metadata states `dedup check` found clean
        self.ro_points = 0
        self.rw_points = 0
        self.states = 0             # crash points examined
        self.repeats = 0            # crash points identical to the previous one
        self._last_state = None
        self._formatted = None      # verdict of the last `dedup check`
        self.recovered_checked = 0  # recovered scratch copies checked clean
        self._unchecked = None      # crash point whose recovered copy is unchecked
        self.seconds = {}           # phase -> seconds spent, for the report

    @contextlib.contextmanager
    def phase(self, name):
        t = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - t

    def close(self):
        self.replayer.close()

    def distinct_points(self, points):
        """Replay through each crash point in turn.  Yields (k, m,
        formatted) for each point whose disk or last mark m differs from
        the point before, once its metadata checked clean (formatted is
        False while no superblock reached the disk, allowed only before the
        first mark)."""
        log = self.replayer.log
        for k in points:
            m = last_mark_before(log, k)
            with self.phase("replay"):
                self.replayer.apply_to(k)
            state = (self.replayer.changes, m)
            if state == self._last_state:
                self.repeats += 1
                continue
            self._last_state = state
            self.states += 1
            with self.phase("dedup check"):
                formatted = self.check(k)
            if not formatted:
                assert m is None, "crash point %d after mark %s: superblock missing" % (k, m)
            yield k, m, formatted

    def check(self, upto):
        """`dedup check` on the replayed metadata, unless no replayed write
        touched it since the last check.  Returns False when no superblock
        reached the disk yet."""
        if self._formatted is None or 0 in self.replayer.dirty:
            self.replayer.dirty.discard(0)
            p = run([ddlib.DEDUP_BIN, "check", self.files["m"]], check=False)
            unformatted = p.returncode == 8 and "not formatted" in p.stderr
            assert p.returncode == 0 or unformatted, \
                "crash point %d: dedup check exit %d:\n%s%s" % (upto, p.returncode, p.stdout, p.stderr)
            self._formatted = not unformatted
            self.checked += self._formatted
        return self._formatted

    def open_ro(self, upto):
        dev = DedupDev("ddtlwy", self.loops["m"], self.loops["d"], self.rig.logical,
                       self.rig.opts + ["read_only"])
        dev.activate()
        st = dev.status()
        assert st["mode"] == "ro", "crash point %d: %s" % (upto, st)
        self.ro_points += 1
        return dev

    def open_rw(self, upto):
        assert self._unchecked is None or self.check_every > 1, \
            "crash point %d: the recovered copy of point %d was not checked" % (
                upto, self._unchecked)
        with self.phase("copy"):
            for k in "md":
                copy_sparse(self.files[k], self.scratch[k])
        dev = DedupDev("ddtlwy", self.scratch_loops["m"], self.scratch_loops["d"],
                       self.rig.logical, self.rig.opts)
        with self.phase("activate"):
            dev.activate()
        st = dev.status()
        assert st["mode"] == "rw", "crash point %d: %s" % (upto, st)
        self.rw_points += 1
        return dev

    def removed_rw(self, upto):
        """The read-write view of crash point @upto was removed: `dedup
        check --data` on the scratch copy its recovery (and clean close)
        wrote, for every check_every-th one; finish() checks the last."""
        self._unchecked = upto
        if (self.rw_points - 1) % self.check_every == 0:
            self.check_recovered()

    def check_recovered(self):
        upto, self._unchecked = self._unchecked, None
        with self.phase("dedup check recovered"):
            ddlib.check_clean(self.scratch["m"], self.scratch["d"],
                              "crash point %d, recovered read-write" % upto)
        self.recovered_checked += 1

    def finish(self):
        """After the last examination: the last recovered copy is checked
        too, and at least one was."""
        if self._unchecked is not None:
            self.check_recovered()
        assert self.recovered_checked >= 1 or not self.rw_points, \
            "no recovered copy was checked"

    def summary(self, points):
        return "%d crash points: %d distinct and examined, %d repeats of the " \
            "point before (same bytes, same last mark) skipped; %d metadata " \
            "states checked clean, and %d recovered copies with their data; " \
            "seconds spent: %s" % (
                len(points), self.states, self.repeats, self.checked,
                self.recovered_checked,
                ", ".join("%s %.0f" % kv for kv in sorted(self.seconds.items())))


def copy_sparse(src, dst):
    """Make dst (same size, under a loop device) a copy of src, copying
    only src's data extents.  The loop device reads the file through the
    page cache on every request, so the target sees the new bytes."""
    with open(src, "rb") as s, open(dst, "r+b") as d:
        si, di = s.fileno(), d.fileno()
        size = os.fstat(si).st_size
        os.ftruncate(di, 0)
        os.ftruncate(di, size)
        off = 0
        while off < size:
            try:
                start = os.lseek(si, off, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:       # only a hole is left
                    break
                raise
            end = os.lseek(si, start, os.SEEK_HOLE)
            pos = start
            while pos < end:
                n = os.copy_file_range(si, di, end - pos, pos, pos)
                assert n > 0, "copy_file_range %s -> %s stopped at %d" % (src, dst, pos)
                pos += n
            off = end


def our_marks(log):
    """[(entry index, k)] of the marks "d<k>" the workload sent (the log
    also ends with the target's own "dm-log-writes-end")."""
    return [(idx, int(t[1:])) for idx, t in log.marks()
            if t[:1] == "d" and t[1:].isdigit()]


def last_mark_before(log, k):
    """Number of the last mark at or before entry k, or None."""
    m = None
    for idx, n in our_marks(log):
        if idx > k:
            break
        m = n
    return m


# ---------------------------------------------------------------------------
# raw block workload
# ---------------------------------------------------------------------------
class RawModel:
    """What the device may hold: per mark, the durable content of each LBA
    and, per LBA, every content written after that mark."""

    def __init__(self):
        self.durable = {}          # lba -> bid (None: zero), synced
        self.unsynced = {}         # lba -> set of bids written since its last sync
        self.latest = {}           # lba -> last bid written since its last sync
        self.at_mark = []          # mark k -> (durable copy, unsynced copy)
        self.writes = []           # (mark count when issued, lba, bid)

    def write(self, lba, bid, marks):
        self.unsynced.setdefault(lba, set()).add(bid)
        self.latest[lba] = bid
        self.writes.append((marks, lba, bid))

    def synced_one(self, lba, bid):
        """An O_DSYNC write completed: that block is durable."""
        self.durable[lba] = bid
        self.unsynced.pop(lba, None)
        self.latest.pop(lba, None)

    def synced_all(self):
        """fsync returned: the last write of every LBA is durable."""
        self.durable.update(self.latest)
        self.unsynced.clear()
        self.latest.clear()

    def mark(self):
        self.at_mark.append((dict(self.durable),
                             {k: set(v) for k, v in self.unsynced.items()}))

    def allowed(self, m):
        """{lba: set of bids} allowed at a crash point whose last mark is m."""
        if m is None:
            durable, unsynced = {}, {}
        else:
            durable, unsynced = self.at_mark[m]
        ok = {lba: {bid} for lba, bid in durable.items()}
        for lba, bids in unsynced.items():
            ok.setdefault(lba, {None}).update(bids)
        after = m + 1 if m is not None else 0
        for marks, lba, bid in self.writes:
            if marks >= after:
                ok.setdefault(lba, {durable.get(lba)}).add(bid)
        return ok


def start_raw(rig, seed):
    """Activate the rig's device and send mark 0: (rng, model, device)."""
    model = RawModel()
    rig.dedup.activate()
    model.mark()
    rig.mark()
    return random.Random(seed), model, rig.dedup


def raw_workload(rig, seed, rounds):
    rng, model, dev = start_raw(rig, seed)
    pool = [rng.randrange(1 << 20) for _ in range(24)]       # duplicate content ids
    for r in range(rounds):
        with BlockDev(dev.path) as bd:
            for i in range(rng.randint(8, 48)):
                lba = rng.randrange(NB)
                x = rng.random()
                bid = None if x < 0.1 else rng.choice(pool) if x < 0.6 else \
                    (r + 1) * 100000 + i
                bd.write(lba, block_data(seed, bid))
                model.write(lba, bid, rig.marks)
            if rng.random() < 0.3:
                lba = rng.randrange(NB - 8)
                ddlib.discard(dev.path, lba, 4)
                for b in range(lba, lba + 4):
                    model.write(b, None, rig.marks)
            if r % 3 == 1:
                # an O_DSYNC write in the middle of unsynced ones
                with BlockDev(dev.path, os.O_DSYNC) as sd:
                    lba = rng.randrange(NB)
                    bid = rng.choice(pool) if r % 2 else (r + 1) * 100000 + 999
                    sd.write(lba, block_data(seed, bid))
                    model.write(lba, bid, rig.marks)
                model.synced_one(lba, bid)
                model.mark()
                rig.mark()
            if r % 4 != 3:          # some rounds stay unsynced
                bd.fsync()
                model.synced_all()
                model.mark()
                rig.mark()
    dev.remove()
    return model


class Contents:
    """sha256 of block_data(seed, bid), computed once per bid: generating
    the blocks again at every crash point would dominate the run."""

    def __init__(self, seed):
        self.seed = seed
        self.memo = {None: hashlib.sha256(ZERO).digest()}

    def __call__(self, bid):
        d = self.memo.get(bid)
        if d is None:
            d = self.memo[bid] = hashlib.sha256(block_data(self.seed, bid)).digest()
        return d


def verify_raw(dev, model, m, contents, point):
    allowed = model.allowed(m)
    with BlockDev(dev.path) as bd:
        got = bd.read_range(0, NB)
    zero = contents(None)
    bad = []
    nonzero = 0
    for lba in range(NB):
        h = hashlib.sha256(got[lba]).digest()
        nonzero += h != zero
        ok = {contents(b) for b in allowed.get(lba, {None})}
        if h not in ok:
            bad.append((lba, sorted(x.hex()[:16] for x in ok), h.hex()[:16]))
    assert not bad, "crash point %d (last mark %s): %d blocks wrong (lba, allowed, got): %s" % (
        point, m, len(bad), bad[:10])
    st = dev.status()
    assert st["mapped"] == nonzero, "crash point %d: mapped %d, non-zero blocks %d" % (
        point, st["mapped"], nonzero)


@pytest.mark.parametrize("opts", [[], ["early_ack"]], ids=["default", "early_ack"])
@pytest.mark.parametrize("trial", range(max(1, TRIALS)))
def test_logwrites_raw_every_crash_point(backing, seed, trial, opts):
    """With early_ack too: a write acknowledged before its data and its
    mapping are written must still be covered by the next flush."""
    seed += trial * 7919
    rig = LogRig(backing, 64, ["commit_interval", "3600"] + opts)
    rounds = 8 if not TRIALS else 16
    model = raw_workload(rig, seed, rounds=rounds // 2 if opts else rounds)
    log = rig.finish()
    points = log.crash_points()
    assert rig.marks == len(model.at_mark)
    assert len(our_marks(log)) == rig.marks, "marks missing from the log"
    assert len(points) >= 10, "too few crash points: %d" % len(points)
    img = CrashImage(backing, rig, log, RECOVERED_CHECK_EVERY["raw"])
    contents = Contents(seed)
    try:
        for k, m, formatted in img.distinct_points(points):
            for view in ([img.open_ro] if formatted else []) + [img.open_rw]:
                dev = view(k)
                verify_raw(dev, model, m, contents, k)
                if view == img.open_rw:
                    # recovered: a new unique block goes somewhere free
                    with BlockDev(dev.path) as bd:
                        new = block_data(seed, 123456789)
                        bd.write(NB + 1, new)
                        bd.fsync()
                        assert bd.read(NB + 1) == new
                dev.remove()
                if view == img.open_rw:
                    img.removed_rw(k)
        img.finish()
    finally:
        img.close()
    ddlib.METADATA_CHECKS += img.checked
    ddlib.report("log-writes raw: %d entries, %s (%d read-only, %d read-write "
                 "activations), 0 failures" % (
                     len(log.entries), img.summary(points), img.ro_points, img.rw_points))


def small_fsyncs_workload(rig, seed, n):
    """A database's pattern: one block written, then fsync, n times, over
    a few hot blocks (so old blocks are freed) with some duplicates."""
    rng, model, dev = start_raw(rig, seed)
    with BlockDev(dev.path) as bd:
        for i in range(n):
            lba = rng.randrange(DB_LBAS)
            bid = rng.randrange(8) if rng.random() < 0.3 else 1000 + i
            bd.write(lba, block_data(seed, bid))
            model.write(lba, bid, rig.marks)
            bd.fsync()
            model.synced_all()
            model.mark()
            rig.mark()
    stats = dev.stats()
    dev.remove()
    return model, stats


def test_logwrites_small_fsyncs_wrap_the_journal(backing, seed):
    """Many small fsyncs on a metadata device so small that its journal
    holds 64 blocks: the journal is checkpointed and wraps around its ring
    at least twice. DB_POINTS crash points, evenly spread, are examined
    read-write (recovery replays the journal), every fourth of them also
    read-only (replay in memory): examining all of them would take a
    quarter of an hour."""
    rig = LogRig(backing, 16, ["commit_interval", "3600"], meta_mib=1, data_mib=16)
    model, stats = small_fsyncs_workload(rig, seed, DB_FSYNCS)
    journal = int(stats["journal_blocks_total"])
    written = int(stats["journal_blocks_written"])
    assert journal <= 256 and written > 2 * journal, \
        "the journal (%d blocks) did not wrap twice: %d blocks written" % (journal, written)
    assert int(stats["checkpoints"]) >= 3, stats
    # Each fsync follows one write: most appends begin when that write
    # completes, ahead of the fsync, so the crash points cover them.
    ahead = int(stats["appends_ahead"])
    assert ahead > DB_FSYNCS // 2, stats
    log = rig.finish()
    points = log.crash_points()
    img = CrashImage(backing, rig, log, RECOVERED_CHECK_EVERY["db"])
    contents = Contents(seed)
    examined = 0
    try:
        stride = max(1, len(points) // DB_POINTS)
        chosen = points[::stride] + ([points[-1]] if (len(points) - 1) % stride else [])
        for n, (k, m, formatted) in enumerate(img.distinct_points(chosen)):
            views = ([img.open_ro] if formatted and n % 4 == 0 else []) + [img.open_rw]
            for view in views:
                dev = view(k)
                verify_db(dev, model, m, contents, k)
                dev.remove()
                if view == img.open_rw:
                    img.removed_rw(k)
            examined += 1
        img.finish()
    finally:
        img.close()
    assert examined >= DB_POINTS * 2 // 3, "only %d crash points examined" % examined
    ddlib.METADATA_CHECKS += img.checked
    ddlib.report("log-writes small fsyncs: journal of %d blocks, %d written (%.1f rings), "
                 "%d of %s appends begun ahead of their fsync, "
                 "%s checkpoints; %s (%d read-only, %d read-write activations), 0 failures" % (
                     journal, written, written / journal, ahead, stats["journal_appends"],
                     stats["checkpoints"],
                     img.summary(chosen), img.ro_points, img.rw_points))


def verify_db(dev, model, m, contents, point):
    allowed = model.allowed(m)
    with BlockDev(dev.path) as bd:
        got = bd.read_range(0, DB_LBAS)
    bad = [(lba, hashlib.sha256(got[lba]).digest().hex()[:16]) for lba in range(DB_LBAS)
           if hashlib.sha256(got[lba]).digest() not in
           {contents(b) for b in allowed.get(lba, {None})}]
    assert not bad, "crash point %d (last mark %s): blocks wrong: %s" % (point, m, bad[:10])


# ---------------------------------------------------------------------------
# filesystem workloads
# ---------------------------------------------------------------------------
FS = {
    "ext4": (["mkfs.ext4", "-q", "-F"], ["fsck.ext4", "-f", "-n"]),
    "xfs": (["mkfs.xfs", "-q", "-f"], ["xfs_repair", "-n"]),
}


def file_blocks(seed, i, rng_pool):
    """Content of file i: duplicate-heavy (blocks from a small pool), with a
    unique block and an odd tail."""
    rng = random.Random(seed * 31 + i)
    n = rng.randint(1, 12)
    blocks = [block_data(seed, rng.choice(rng_pool) if rng.random() < 0.7 else 500000 + i * 100 + j)
              for j in range(n)]
    tail = rng.randint(0, BLOCK - 1)
    return b"".join(blocks) + block_data(seed, 900000 + i)[:tail]


def fs_workload(rig, fstype, seed, nfiles):
    mkfs, _ = FS[fstype]
    dev = rig.dedup
    dev.activate()
    run(mkfs + [dev.path], timeout=600)
    mnt = "/tmp/ddt-lw-mnt"
    os.makedirs(mnt, exist_ok=True)
    run(["mount", dev.path, mnt])
    rig.backing.mounts.append(mnt)
    pool = list(range(10))
    files = {}           # name -> (content, mark after which it is durable or None)
    first = rig.mark()   # the filesystem exists from here on
    for i in range(nfiles):
        name = "f%03d" % i
        data = file_blocks(seed, i, pool)
        fd = os.open(os.path.join(mnt, name), os.O_CREAT | os.O_WRONLY, 0o644)
        os.write(fd, data)
        if i % 3 != 2:
            os.fsync(fd)
            os.close(fd)
            dfd = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)
            os.fsync(dfd)
            os.close(dfd)
            files[name] = (data, rig.mark())
        else:
            os.close(fd)
            files[name] = (data, None)
    run(["umount", mnt])
    rig.backing.mounts.remove(mnt)
    files_end = rig.mark()
    return files, first, files_end


def verify_fs(dev, fstype, files, m, point):
    _, fsck = FS[fstype]
    mnt = "/tmp/ddt-lw-chk"
    os.makedirs(mnt, exist_ok=True)
    run(["mount", dev.path, mnt])
    try:
        bad = []
        for name, (data, durable_at) in files.items():
            p = os.path.join(mnt, name)
            must = durable_at is not None and durable_at <= m
            if not os.path.exists(p):
                if must:
                    bad.append((name, "missing"))
                continue
            with open(p, "rb") as f:
                got = f.read()
            if must:
                if got != data:
                    bad.append((name, "content differs (len %d vs %d)" % (len(got), len(data))))
                continue
            if len(got) > len(data):
                bad.append((name, "longer than written"))
                continue
            for off in range(0, len(got), BLOCK):
                g = got[off:off + BLOCK]
                if g != data[off:off + len(g)] and g.count(0) != len(g):
                    bad.append((name, "foreign data at %d" % off))
                    break
        assert not bad, "crash point %d (mark %d): %s" % (point, m, bad[:10])
    finally:
        run(["umount", mnt])
    p = run(fsck + [dev.path], check=False, timeout=600)
    assert p.returncode == 0, "crash point %d: %s exit %d:\n%s%s" % (
        point, fsck[0], p.returncode, p.stdout[-3000:], p.stderr[-2000:])


@pytest.mark.parametrize("fstype", ["ext4", "xfs"])
@pytest.mark.parametrize("trial", range(max(1, TRIALS)))
def test_logwrites_filesystem(backing, seed, trial, fstype):
    seed += trial * 7919
    logical = 320 if fstype == "xfs" else 128           # mkfs.xfs wants >= 300 MiB
    rig = LogRig(backing, logical)
    files, first, end = fs_workload(rig, fstype, seed, nfiles=FS_FILES)
    log = rig.finish()
    points = log.crash_points()
    marks = {n: idx for idx, n in our_marks(log)}
    assert first in marks and end in marks, "marks missing from the log"
    assert len(points) >= 3 * FS_FILES, "too few crash points: %d" % len(points)
    img = CrashImage(backing, rig, log, RECOVERED_CHECK_EVERY["fs"])
    try:
        for k, m, _ in img.distinct_points(points):
            dev = img.open_rw(k)
            if m is not None and m >= first:
                with img.phase("mount, verify, fsck"):
                    verify_fs(dev, fstype, files, m, k)
            with img.phase("remove"):
                dev.remove()
            img.removed_rw(k)
        img.finish()
    finally:
        img.close()
    ddlib.METADATA_CHECKS += img.checked
    ddlib.report("log-writes %s: %d entries, %s, 0 failures" % (
        fstype, len(log.entries), img.summary(points)))
