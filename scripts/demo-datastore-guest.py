#!/usr/bin/python3
"""The guest half of `make demo` (scripts/demo.sh): a VM datastore.

Two "disks" (a small one for the metadata, a large one for the data) in
one LVM volume group, a dedup device over a logical volume on each, XFS
on it, exported over NFSv4 by the kernel's nfsd from a "storage server"
network namespace and mounted by the NFS client in a "hypervisor"
namespace (a veth pair between them). VM disk images, raw and qcow2, all
of one "distribution", are copied onto the datastore through the mount,
read back and compared byte for byte, one is deleted and the free space
trimmed; then the savings and the device status are printed.

It uses the test suite's helpers (tests/guest: netns.py, nfs.py,
vmimages.py), so the demo and the tests run the same set-up. Exits
non-zero if anything fails or an image reads back different.
Environment: DEDUP_KO, DEMO_IMAGES (5), DEMO_OS_MB (64), DEMO_IMAGE_MB (128),
DEMO_SRC (/usr/lib/python3/dist-packages).
"""

import os
import shutil
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "guest"))

import ddlib  # noqa: E402
import vmimages  # noqa: E402
from ddlib import BLOCK, MIB, DedupDev, run  # noqa: E402
from lvm import lvm  # noqa: E402
from netns import NetPair  # noqa: E402
from nfs import NfsServer  # noqa: E402

NAME = "dddemo"
VG = "dddemo_vg"
T = ddlib.TMPFS
EXPORT = "/tmp/dd-demo-export"
MOUNT = "/tmp/dd-demo-nfs"


def say(msg):
    print("demo: " + msg, flush=True)


def trim_until_settled(dd, used_before, secs=60):
    """fstrim on the server until the blocks it gives back stop growing;
    returns the stats after the last one. nfsd keeps the files it served
    open in its file cache for a while, and an unlinked file's extents
    are freed only at its last close: a single trim right after the
    delete can miss them."""
    deadline = time.monotonic() + secs
    last = None
    while True:
        os.sync()
        out = run(["fstrim", "-v", EXPORT]).stdout.strip()
        dd.commit()
        st = dd.stats()
        freed = used_before - int(st["data_blocks_used"])
        if (freed > 0 and freed == last) or time.monotonic() > deadline:
            say("fstrim: %s; %d blocks freed" % (out, freed))
            return st
        last = freed
        time.sleep(2)


def main(undo):
    n_images = int(os.environ.get("DEMO_IMAGES", "5"))
    os_mb = int(os.environ.get("DEMO_OS_MB", "64"))
    image_mb = int(os.environ.get("DEMO_IMAGE_MB", "128"))
    src = os.environ.get("DEMO_SRC", "/usr/lib/python3/dist-packages")

    say("loading modules")
    ddlib.load_dedup_module(os.environ["DEDUP_KO"])
    ddlib.mount_tmpfs(T, "3G")
    undo.append(lambda: ddlib.umount_tmpfs(T))

    disks = []
    for name, size in (("ssd", "128M"), ("hdd", "2G")):
        path = os.path.join(T, name + ".img")
        run(["truncate", "-s", size, path])
        disks.append(run(["losetup", "-f", "--show", path]).stdout.strip())
        undo.append(lambda d=disks[-1]: run(["losetup", "-d", d], check=False))
    ssd, hdd = disks
    devs = "%s,%s" % (ssd, hdd)
    say("LVM: volume group %s on %s (metadata disk) and %s (data disk)" % (VG, ssd, hdd))
    lvm("pvcreate", "-q", "-y", ssd, hdd, devices=devs)
    lvm("vgcreate", "-q", VG, ssd, hdd, devices=devs)
    undo.append(lambda: lvm("vgremove", "-q", "-f", VG, devices=devs, check=False))
    lvm("lvcreate", "-q", "-y", "-Wy", "-Zy", "-n", "meta", "-l", "100%PVS", VG, ssd, devices=devs)
    lvm("lvcreate", "-q", "-y", "-Wy", "-Zy", "-n", "data", "-l", "100%PVS", VG, hdd, devices=devs)
    dd = DedupDev(NAME, "/dev/%s/meta" % VG, "/dev/%s/data" % VG, (4 << 30) // 512)
    say('dmsetup create %s --table "%s"' % (NAME, dd.table_line()))
    dd.activate()
    undo.append(lambda: run(["dmsetup", "remove", "--retry", NAME], check=False))
    dev = dd.path

    say("mkfs.xfs on the dedup device, mounted at %s on the storage server" % EXPORT)
    run(["mkfs.xfs", "-q", "-f", dev])
    os.makedirs(EXPORT, exist_ok=True)
    run(["mount", dev, EXPORT])
    undo.append(lambda: run(["umount", EXPORT], check=False))

    say("network: namespaces 'server' and 'hypervisor' joined by a veth pair")
    net = NetPair()
    undo.append(lambda: [say(e) for e in net.close()])
    say("NFS: nfsd, rpc.mountd and exportfs in the server namespace")
    nfs = NfsServer(net)
    undo.append(lambda: [say(e) for e in nfs.stop()])
    nfs.export(EXPORT)
    nfs.mount(MOUNT)
    say("the hypervisor mounted the datastore: %s" % run(
        ["findmnt", "-n", "-o", "SOURCE,FSTYPE,OPTIONS", MOUNT]).stdout.strip()[:110])

    names = ["vm%d.raw" % i for i in range(1, n_images)] + ["vm%d.qcow2" % n_images]
    say("building %d VM images of %d MiB (ext4, %d MB of the same OS files from %s, "
        "2 MiB of their own; the last one qcow2)" % (n_images, image_mb, os_mb, src))
    work = os.path.join(T, "images")
    os.makedirs(work, exist_ok=True)
    t0 = time.monotonic()
    imgs = vmimages.build(work, names, seed=1, os_source=src, os_bytes=os_mb * MIB,
                          image_mib=image_mb)
    say("images built in %.0f s: %s" % (time.monotonic() - t0, ", ".join(
        "%s %d MiB" % (n, imgs[n][2] >> 20) for n in names)))

    dd.commit()
    st0 = dd.stats()
    t0 = time.monotonic()
    for n in names:
        t1 = time.monotonic()
        shutil.copyfile(imgs[n][0], os.path.join(MOUNT, n))
        os.sync()
        say("copied %s over NFS: %.1f s" % (n, time.monotonic() - t1))
    copy_s = time.monotonic() - t0
    written = sum(imgs[n][2] for n in names)
    dd.commit()
    st1 = dd.stats()

    say("reading every image back through NFS (caches dropped) and comparing")
    vmimages.drop_caches()
    bad = [n for n in names if vmimages.sha256_of(os.path.join(MOUNT, n)) != imgs[n][1]]
    for n in names:
        say("  %s: %s" % (n, "DIFFERS" if n in bad else "identical (sha256)"))

    victim = names[1]
    say("deleting %s on the datastore, fstrim on the server" % victim)
    os.unlink(os.path.join(MOUNT, victim))
    st2 = trim_until_settled(dd, int(st1["data_blocks_used"]))

    used = int(st1["data_blocks_used"]) - int(st0["data_blocks_used"])
    dups = int(st1["duplicate_writes"]) - int(st0["duplicate_writes"])
    zeros = int(st1["zero_writes"]) - int(st0["zero_writes"])
    freed = int(st1["data_blocks_used"]) - int(st2["data_blocks_used"])
    print()
    print("---- df -h %s (the hypervisor's view) ----" % MOUNT)
    print(run(["df", "-h", MOUNT]).stdout.rstrip())
    print()
    print("---- dmsetup status %s ----" % NAME)
    print(dd.status_line())
    print()
    print("---- summary ----")
    print("VM images copied over NFS:      %d, %.1f MiB in %.0f s (%.1f MiB/s)" % (
        len(names), written / MIB, copy_s, written / MIB / copy_s))
    print("blocks the device received:     %d duplicate, %d all-zero (no space), rest new" % (
        dups, zeros))
    print("data device space they took:    %.1f MiB (%d blocks)" % (used * BLOCK / MIB, used))
    if used > 0:
        print("space saved:                    %.1f %%  (%.2f : 1)" % (
            100.0 * (1 - used * BLOCK / written), written / (used * BLOCK)))
    print("freed by delete + fstrim:       %.1f MiB (%s)" % (freed * BLOCK / MIB, victim))
    print("mode:                           %s" % dd.status()["mode"])
    if bad:
        say("verification FAILED: %s" % ", ".join(bad))
        return 1
    say("verification passed")
    return 0


if __name__ == "__main__":
    undo = []
    try:
        rc = main(undo)
    finally:
        for f in reversed(undo):
            try:
                f()
            except Exception as e:      # cleanup goes on; say what failed
                say("cleanup: %s" % e)
        if ddlib.module_loaded():
            run(["rmmod", "dm_dedup"], check=False)
    sys.exit(rc)
