"""The datastore use end to end (issue: VM datastore): a dedup device
exported over NFS (ext4 or XFS on it) and over iSCSI (the device itself as
a LIO LUN), between two network namespaces joined by a veth pair, with the
real servers and clients of Debian 12 and the 6.12 kernel.

Through each export: VM disk images (raw and qcow2, sharing most of their
blocks) are copied in and read back byte for byte; the dedup status shows
the duplicates found; deleting images and trimming (fstrim on the server
for NFS, on the initiator for iSCSI, which LIO turns into UNMAP and then
discards) gives the space back. fio with crc32c verification checks a
file over NFS and, over iSCSI, runs while the dedup device is suspended,
resumed and reloaded underneath; nothing may fail or differ.
"""

import os
import shutil
import subprocess
import time

import pytest

import ddlib
import vmimages
from ddlib import BLOCK, MIB, run
from iscsi import Initiator, LioLun
from netns import NetPair
from nfs import NfsServer

IMAGES = ["vm1.raw", "vm2.raw", "vm3.qcow2"]
IQN = "iqn.2026-11.org.dm-dedup:datastore"


class Stack:
    """What a test started, torn down before the backing devices: the
    client side first (its mounts, the NFS client and server, the iSCSI
    sessions), then the LUNs, then the server's mounts of the device."""

    def __init__(self):
        self.net = None
        self.nfs = None
        self.initiator = None
        self.luns = []
        self.client_mounts = []
        self.server_mounts = []

    def stop(self):
        errors = []

        def umount(mounts):
            for m in reversed(mounts):
                if os.path.ismount(m):
                    p = run(["umount", m], check=False)
                    if p.returncode:
                        errors.append("umount %s: %s" % (m, p.stderr.strip()))

        umount(self.client_mounts)
        if self.nfs:
            errors += self.nfs.stop()
        if self.initiator:
            errors += self.initiator.stop()
        for lun in self.luns:
            try:
                lun.delete()
            except ddlib.CmdError as e:
                errors.append("LIO delete: %s" % e)
        umount(self.server_mounts)
        if self.net:
            errors += self.net.close()
        return errors


@pytest.fixture
def stack(backing, request):
    """NFS: server and client namespaces; iSCSI (tests marked by name):
    the initiator in the initial namespace (see netns.NetPair)."""
    s = Stack()
    s.net = NetPair(client_in_init="iscsi" in request.node.name)
    yield s
    errors = s.stop()
    if errors:
        pytest.fail("export teardown: " + "; ".join(errors), pytrace=False)


@pytest.fixture(scope="module")
def images():
    """The VM images, built once for this module in the guest's tmpfs."""
    d = os.path.join(ddlib.TMPFS, "vmimages")
    os.makedirs(d, exist_ok=True)
    t0 = time.monotonic()
    imgs = vmimages.build(d, IMAGES, seed=7)
    ddlib.report("vm images: %s built in %.0f s" % (
        ", ".join("%s %d MiB" % (n, imgs[n][2] >> 20) for n in IMAGES), time.monotonic() - t0))
    yield imgs
    shutil.rmtree(d, ignore_errors=True)


def copy_in(imgs, dst):
    for name in IMAGES:
        shutil.copyfile(imgs[name][0], os.path.join(dst, name))


def assert_same(imgs, where):
    vmimages.drop_caches()
    for name in IMAGES:
        got = vmimages.sha256_of(os.path.join(where, name))
        assert got == imgs[name][1], "%s read back differs through %s" % (name, where)


def image_blocks(imgs):
    return sum(imgs[n][2] for n in IMAGES) // BLOCK


def store_images(dev, imgs, mnt):
    """Copy the images in through @mnt and read them back; check that the
    device stored their common OS once. Returns the data blocks in use
    before, the blocks the images took, and the blocks they hold."""
    base = settled_used(dev)
    dups0 = int(dev.stats()["duplicate_writes"])
    copy_in(imgs, mnt)
    run(["sync"])
    assert_same(imgs, mnt)
    used = settled_used(dev) - base
    dups = int(dev.stats()["duplicate_writes"]) - dups0
    total = image_blocks(imgs)
    # three images, one OS: vm2 and vm3 repeat vm1's
    assert dups > 1.5 * vmimages.OS_BYTES // BLOCK, (dups, total)
    assert used < total * 0.6, (used, total)
    return base, used, total


def settled_used(dev):
    """data_blocks_used once freed blocks are reusable: the commit message
    commits twice when a freed block needs a second commit."""
    dev.commit()
    return int(dev.stats()["data_blocks_used"])


def trim_until_freed(dev, srv_dir, stack, before, want, secs=60):
    """fstrim on the server until @want blocks are free again (or @secs
    pass); returns the blocks freed. nfsd keeps the files it served open
    in its file cache for a while after the client's last use, and an
    unlinked file's extents are freed only at its last close: a trim
    right after the delete can miss them (it did, once, with XFS)."""
    deadline = time.monotonic() + secs
    while True:
        run(["sync"])
        stack.nfs.net.cli(["sync"])
        run(["fstrim", srv_dir])
        freed = before - settled_used(dev)
        if freed > want or time.monotonic() > deadline:
            return freed
        time.sleep(2)


@pytest.mark.parametrize("fs", ["ext4", "xfs"])
def test_nfs_datastore(make_dedup, stack, images, fs, seed):
    t0 = time.monotonic()
    dev = make_dedup(meta_mib=16, data_mib=256, logical_mib=1024)
    srv_dir = os.path.join(ddlib.TMPFS, "nfs-export")
    os.makedirs(srv_dir, exist_ok=True)
    run(["mkfs.xfs", "-q", "-f", dev.path] if fs == "xfs" else
        ["mkfs.ext4", "-q", "-F", "-E", "nodiscard", dev.path])
    run(["mount", dev.path, srv_dir])
    stack.server_mounts.append(srv_dir)
    stack.nfs = NfsServer(stack.net)
    stack.nfs.export(srv_dir)
    mnt = os.path.join(ddlib.TMPFS, "nfs-client")
    stack.nfs.mount(mnt)

    base, used, total = store_images(dev, images, mnt)

    # fio writes a file through the mount and verifies it (crc32c)
    p = run(["fio", "--name=nfsverify", "--filename=" + os.path.join(mnt, "fio.dat"),
             "--size=16m", "--bs=64k", "--rw=randwrite", "--ioengine=psync",
             "--verify=crc32c", "--do_verify=1", "--verify_fatal=1", "--end_fsync=1"],
            check=False, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]

    # delete the images through the mount, trim on the server
    for name in IMAGES:
        os.unlink(os.path.join(mnt, name))
    os.unlink(os.path.join(mnt, "fio.dat"))
    freed = trim_until_freed(dev, srv_dir, stack, base + used, used * 0.9)
    assert freed > used * 0.9, (freed, used)
    ddlib.report("nfs %s: %d image blocks written, %d stored (%.1f %% saved), %d freed by "
                 "delete + fstrim; %.0f s" % (fs, total, used, 100.0 * (1 - used / total),
                                              freed, time.monotonic() - t0))
    assert dev.status()["mode"] == "rw"


def test_iscsi_lun_persists_and_unmaps(make_dedup, stack, images):
    t0 = time.monotonic()
    dev = make_dedup(meta_mib=16, data_mib=256, logical_mib=1024)
    stack.luns.append(LioLun(stack.net, dev.path, IQN, "ddlun%d" % os.getpid()))
    stack.initiator = Initiator(stack.net)
    disk = stack.initiator.login(IQN)
    assert ddlib.device_bytes(disk) == 1024 * MIB

    mnt = os.path.join(ddlib.TMPFS, "iscsi-client")
    os.makedirs(mnt, exist_ok=True)
    run(["mkfs.ext4", "-q", "-F", disk])
    run(["mount", disk, mnt])
    stack.client_mounts.append(mnt)
    base, used, total = store_images(dev, images, mnt)

    # persistence: log out, take the device down and up again, log in
    run(["umount", mnt])
    stack.initiator.logout(IQN)
    stack.luns[-1].delete()
    dev.remove()
    dev.activate()
    stack.luns.append(LioLun(stack.net, dev.path, IQN, "ddlun%db" % os.getpid()))
    disk = stack.initiator.login(IQN)
    run(["mount", disk, mnt])
    assert_same(images, mnt)

    # delete two images, fstrim on the initiator: UNMAP reaches the device
    kept = IMAGES[0]
    for name in IMAGES[1:]:
        os.unlink(os.path.join(mnt, name))
    run(["sync"])
    discarded0 = int(dev.stats()["discarded_blocks"])
    run(["fstrim", mnt])
    after = settled_used(dev)
    st = dev.stats()
    discarded = int(st["discarded_blocks"]) - discarded0
    assert discarded > 0, st
    freed = base + used - after
    # what the two images had of their own came back; what they shared with
    # vm1 stays
    assert freed > 0.5 * vmimages.OWN_BYTES * 2 // BLOCK, (freed, used)
    vmimages.drop_caches()
    assert vmimages.sha256_of(os.path.join(mnt, kept)) == images[kept][1]
    run(["umount", mnt])
    stack.client_mounts.remove(mnt)
    ddlib.report("iscsi: %d image blocks written, %d stored (%.1f %% saved), %d freed by "
                 "delete + fstrim (%d blocks discarded); %.0f s" % (
                     total, used, 100.0 * (1 - used / total), freed, discarded,
                     time.monotonic() - t0))


def test_iscsi_writer_sees_no_error_across_suspend_and_reload(make_dedup, stack):
    """fio with verification on the LUN while the dedup device below LIO is
    suspended and resumed, and its table reloaded (as growing it does)."""
    dev = make_dedup(meta_mib=16, data_mib=128, logical_mib=256)
    stack.luns.append(LioLun(stack.net, dev.path, IQN, "ddlun%dc" % os.getpid()))
    stack.initiator = Initiator(stack.net)
    disk = stack.initiator.login(IQN)
    fio = subprocess.Popen(
        ["fio", "--name=lunverify", "--filename=" + disk, "--direct=1",
         "--ioengine=libaio", "--iodepth=8", "--rw=randwrite", "--bs=16k", "--size=64m",
         "--time_based", "--runtime=40", "--verify=crc32c", "--verify_backlog=128",
         "--verify_fatal=1", "--output-format=terse"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(5)
        for _ in range(2):
            dev.suspend()
            time.sleep(2)
            dev.resume()
            time.sleep(3)
        dev.reload()
        assert fio.poll() is None, "fio ended before the suspends did"
    finally:
        out, err = fio.communicate(timeout=900)
    assert fio.returncode == 0, "fio over iSCSI failed:\n%s\n%s" % (out[-2000:], err[-2000:])
    assert dev.status()["mode"] == "rw"
