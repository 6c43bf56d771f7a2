"""LVM as the substrate, set up as a datastore would be: a volume group on
a disk, logical volumes for the dedup metadata and data devices
(Documentation/dm-dedup.rst, "On LVM").

Every command names the group's one physical volume with --devices, so
that LVM never scans (and reads from) the suite's other devices, dedup
devices included: an I/O trace of a test must show only the test's I/O.
"""

import os

import ddlib
from ddlib import run

_seq = 0


def lvm(cmd, *args, devices=None, check=True):
    """Run an LVM command (quietly about the descriptors pytest leaves
    open; only LVM's own devices when @devices is given)."""
    argv = ["env", "LVM_SUPPRESS_FD_WARNINGS=1", cmd]
    if devices:
        argv += ["--devices", devices]
    return run(argv + list(args), check=check)


class VolumeGroup:
    """A volume group over one fresh loop device of @backing (a sparse file
    in the guest's tmpfs). Backing.cleanup removes it after the dm devices
    above it and checks the dedup metadata on its volumes first."""

    def __init__(self, backing, size_mib):
        global _seq
        _seq += 1
        self.name = "ddlvm%d_%d" % (os.getpid(), _seq)
        self.pv = backing.loop(size_mib, "pv")
        self.volumes = []           # (name, path), in creation order
        backing.vgs.append(self)
        lvm("pvcreate", "-q", "-y", self.pv, devices=self.pv)
        lvm("vgcreate", "-q", self.name, self.pv, devices=self.pv)

    def lv(self, name, size_mib):
        """A new logical volume; returns its /dev/VG/LV path. A name that
        starts with "meta" or "data" makes it part of the dedup check at
        cleanup, as Backing.loop's files are."""
        lvm("lvcreate", "-q", "-y", "-Wy", "-Zy", "-n", name, "-L", "%dm" % size_mib,
            self.name, devices=self.pv)
        ddlib.udev_settle()
        path = "/dev/%s/%s" % (self.name, name)
        assert os.path.exists(path), path + " did not appear"
        self.volumes.append((name, path))
        return path

    def extend(self, name, add_mib):
        """lvextend by @add_mib; returns the new size in bytes."""
        lvm("lvextend", "-q", "-L", "+%dm" % add_mib, "%s/%s" % (self.name, name),
            devices=self.pv)
        ddlib.udev_settle()
        return ddlib.device_bytes("/dev/%s/%s" % (self.name, name))

    def remove(self):
        """Remove every volume, the group and the label; returns errors."""
        errors = []
        p = lvm("vgremove", "-q", "-f", self.name, devices=self.pv, check=False)
        if p.returncode:
            errors.append("vgremove %s: %s" % (self.name, p.stderr.strip()))
        p = lvm("pvremove", "-q", "-y", self.pv, devices=self.pv, check=False)
        if p.returncode:
            errors.append("pvremove %s: %s" % (self.pv, p.stderr.strip()))
        ddlib.udev_settle()
        self.volumes = []
        return errors
