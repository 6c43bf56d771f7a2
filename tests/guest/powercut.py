"""The power-cut rig of test_crash.py: see its docstring for the method."""

import ddlib
from ddlib import DedupDev, run

META_MIB, DATA_MIB, LOGICAL_MIB = 16, 64, 128


class PowerRig:
    """dm-dedup over two null_blk disks with volatile caches, each behind
    a dm layer that cut() swaps for dm-flakey drop_writes. With
    write_delay_ms (meta_delay_ms), the data (metadata) disk's layer is
    dm-delay, holding every write (and flush) that long, so that the
    target's writes stay in flight.

    `dedup check --data` is the oracle here too: on what a crash leaves on
    the disks (power_cycle() and restart(), before the target recovers
    it), on what the recovery wrote (check_recovered()), and at the
    test's cleanup (the disks are registered with the backing)."""

    def __init__(self, backing, opts=(), write_delay_ms=0, meta_delay_ms=0):
        self.backing = backing
        self.nb = {"m": "ddnbm", "d": "ddnbd"}
        self.size = {"m": META_MIB, "d": DATA_MIB}
        self.delay_ms = {"m": meta_delay_ms, "d": write_delay_ms}
        for k in "md":
            backing.nullb(self.nb[k], self.size[k], cache_mib=self.size[k])
        self.layers = {"m": "ddtcrm", "d": "ddtcrd"}
        self._linear()
        backing.pairs.append(("/dev/" + self.nb["m"], "/dev/" + self.nb["d"]))
        self.dev = DedupDev("ddtcr", "/dev/mapper/" + self.layers["m"],
                            "/dev/mapper/" + self.layers["d"],
                            LOGICAL_MIB * ddlib.MIB // 512,
                            ["commit_interval", "3600"] + list(opts))

    def sectors(self, k):
        return self.size[k] * ddlib.MIB // 512

    def _linear(self):
        for k in "md":
            disk = "/dev/" + self.nb[k]
            table = "0 %d linear %s 0" % (self.sectors(k), disk)
            if self.delay_ms[k]:
                table = "0 %d delay %s 0 0 %s 0 %d" % (self.sectors(k), disk, disk,
                                                     self.delay_ms[k])
            run(["dmsetup", "create", self.layers[k], "--table", table])
        ddlib.udev_settle()

    def check(self, what):
        """`dedup check --data` on the two disks as they are now, through
        the layers (the target must be removed): must be clean."""
        return ddlib.check_clean("/dev/mapper/" + self.layers["m"],
                                 "/dev/mapper/" + self.layers["d"], what)

    def check_recovered(self):
        """Remove the target (its clean close commits what the recovery
        and the test did since), check the metadata with its data, and
        activate the target again."""
        self.dev.remove()
        self.check("after the recovery from a power cut")
        self.dev.activate()

    def cut(self, disks="md"):
        """From now on all writes and flushes below dm-dedup to disks ("m"
        metadata, "d" data) are dropped; cutting the data disk alone
        stands for a power cut that comes before its flush arrives."""
        for k in disks:
            run(["dmsetup", "suspend", "--noflush", "--nolockfs", self.layers[k]])
        for k in disks:
            run(["dmsetup", "load", self.layers[k], "--table",
                 "0 %d flakey /dev/%s 0 0 1 1 drop_writes" % (self.sectors(k), self.nb[k])])
        for k in disks:
            run(["dmsetup", "resume", self.layers[k]])

    def restart(self):
        """A crash that keeps the disks powered (a reset, a killed guest):
        remove everything above the disks, which keep their caches, and
        set up again."""
        self.dev.remove()
        for k in "md":
            ddlib.dm_remove(self.layers[k])
        self._linear()
        self.check("what a crash (disks kept powered) left, before the recovery")
        self.dev.activate()

    def power_cycle(self):
        """Remove everything above the disks, lose their caches, set up again."""
        self.dev.remove()
        for k in "md":
            ddlib.dm_remove(self.layers[k])
        for k in "md":
            self.backing.power(self.nb[k], False)
        for k in "md":
            self.backing.power(self.nb[k], True)
        self._linear()
        self.check("what a power cut left, before the recovery")
        self.dev.activate()
