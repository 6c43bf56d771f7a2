"""Power cuts at random moments under load (tests/README.md, "Test levels" 5).

The rig of test_crash.py: metadata and data on memory-backed null_blk disks
with a volatile cache, dm-linear between them and dm-dedup; a cut swaps the
linear layers for dm-flakey drop_writes, then the disks are powered off and
on, which throws their caches away.

A writer thread keeps writing (duplicates, unique blocks, zeros, O_DSYNC
writes, fsync every batch) while the main thread cuts the power after a
random delay.  Only what was synced before the cut began counts as durable;
everything written later, or synced after that instant, may read old or new.
After each cut: `dedup check --data` is clean on what the cut left (before
the recovery), durable blocks read back exactly, the rest read one of their
allowed contents, `mapped` equals the non-zero blocks, `dedup check --data`
is clean on what the recovery wrote (the target removed, then activated
again), and the device keeps working for the next round.
"""

import os
import random
import threading
import time

import ddlib
from ddlib import ZERO, BlockDev, block_data
from test_crash import NB, PowerRig, check_after_cut

CUTS = max(ddlib.TORTURE_TRIALS, 5)


class Writer(threading.Thread):
    def __init__(self, path, seed, rnd, durable):
        super().__init__(daemon=True)
        self.path = path
        self.seed = seed
        self.rng = random.Random(seed * 1000 + rnd)
        self.rnd = rnd
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.cut = False
        self.durable = dict(durable)        # lba -> bytes
        self.maybe = {}                     # lba -> set of bytes
        self.error = None
        self.ops = 0

    def _wrote(self, lba, data):
        with self.lock:
            self.maybe.setdefault(lba, {self.durable.get(lba, ZERO)}).add(data)

    def run(self):
        try:
            self._run()
        except Exception as e:                   # noqa: BLE001 - reported by the test
            self.error = e

    def _run(self):
        pool = [self.rng.randrange(1 << 30) for _ in range(16)]
        with BlockDev(self.path) as bd, BlockDev(self.path, os.O_DSYNC) as sd:
            n = 0
            while not self.stop.is_set():
                last = {}
                for _ in range(self.rng.randint(1, 24)):
                    lba = self.rng.randrange(NB)
                    x = self.rng.random()
                    bid = None if x < 0.1 else self.rng.choice(pool) if x < 0.6 else \
                        (self.rnd + 1) * 10000000 + n
                    n += 1
                    data = block_data(self.seed, bid)
                    self._wrote(lba, data)
                    bd.write(lba, data)
                    last[lba] = data
                    self.ops += 1
                if self.rng.random() < 0.3:
                    lba = self.rng.randrange(NB)
                    data = block_data(self.seed, (self.rnd + 1) * 10000000 + n)
                    n += 1
                    self._wrote(lba, data)
                    sd.write(lba, data)
                    last.pop(lba, None)
                    with self.lock:
                        if not self.cut:
                            # an O_DSYNC write that completed before the cut
                            # is durable, whatever else is still unsynced
                            self.durable[lba] = data
                            if lba not in last:
                                self.maybe.pop(lba, None)
                bd.fsync()
                with self.lock:
                    if not self.cut:
                        for lba, data in last.items():
                            self.durable[lba] = data
                        self.maybe.clear()


def test_power_cut_random_moments(backing, seed):
    rig = PowerRig(backing)
    dev = rig.dev
    dev.activate()
    rng = random.Random(seed)
    state = {}
    total_ops = 0
    for rnd in range(CUTS):
        w = Writer(dev.path, seed, rnd, state)
        w.start()
        time.sleep(rng.uniform(0.05, 2.5))
        with w.lock:
            w.cut = True
        rig.cut()
        w.stop.set()
        w.join(120)
        assert not w.is_alive(), "writer did not stop after the cut"
        assert w.error is None, "writer failed before the cut took effect: %r" % w.error
        total_ops += w.ops
        rig.power_cycle()
        durable = {lba: d for lba, d in w.durable.items() if lba not in w.maybe and d != ZERO}
        maybe = w.maybe
        try:
            state = check_after_cut(dev, durable, maybe, rig)
        except AssertionError as e:
            raise AssertionError("cut %d after %d writes: %s" % (rnd, w.ops, e))
    ddlib.report("random power cuts: %d cuts, %d writes, 0 failures" % (CUTS, total_ops))
    dev.remove()
