"""ext4 and XFS on top of dm-dedup: copies of a real directory tree dedup,
fsck is clean, content survives unmount/mount.

The source tree is read once over the guest's 9p root (slow, ~10 MB/s), so
it is bounded (DD_FS_TREE_MB, default 20 MB) and read into memory once; the further copies are made
inside the filesystem and go through the dedup target.
"""

import os

import pytest

import ddlib
from ddlib import BLOCK, run

SRC_CANDIDATES = ["/usr/lib/python3.11", "/usr/lib/python3/dist-packages", "/usr/share/doc"]
TREE_BYTES = int(os.environ.get("DD_FS_TREE_MB", "20")) * ddlib.MIB
COPIES = 4


@pytest.fixture(scope="module")
def source_tree():
    for src in SRC_CANDIDATES:
        if os.path.isdir(src):
            files, total = ddlib.pick_tree(src, TREE_BYTES)
            if total > TREE_BYTES // 4:
                break
    else:
        pytest.fail("no source tree found among %s" % SRC_CANDIDATES)
    contents = ddlib.read_tree(src, files)
    return src, contents, total, ddlib.manifest_of(contents), ddlib.data_blocks_in(contents)


MKFS = {
    "ext4": (["mkfs.ext4", "-q", "-F"], ["fsck.ext4", "-f", "-n"]),
    "xfs": (["mkfs.xfs", "-q", "-f"], ["xfs_repair", "-n"]),
}


@pytest.mark.parametrize("fstype", ["ext4", "xfs"])
def test_filesystem_on_dedup(make_dedup, backing, source_tree, fstype):
    src, contents, total, man, src_blocks = source_tree
    files = sorted(contents)
    # On two LVM logical volumes, as a datastore would be set up.
    d = make_dedup(meta_mib=32, data_mib=512, logical_mib=1024, lvm=True)
    mkfs, fsck = MKFS[fstype]
    run(mkfs + [d.path], timeout=600)
    mnt = "/tmp/dd-mnt-" + fstype
    os.makedirs(mnt, exist_ok=True)
    run(["mount", "-t", fstype, d.path, mnt])
    backing.mounts.append(mnt)

    before = d.status()
    ddlib.write_tree(contents, os.path.join(mnt, "c0"))
    run(["sync"])
    for i in range(1, COPIES):
        # --reflink=never: XFS has reflink on by default and cp would share
        # extents instead of writing the data again.
        run(["cp", "-a", "--reflink=never", os.path.join(mnt, "c0"),
             os.path.join(mnt, "c%d" % i)], timeout=900)
    run(["sync"])
    d.commit()
    st = d.status()
    written = (st["unique_writes"] + st["duplicate_writes"]) - \
        (before["unique_writes"] + before["duplicate_writes"])
    dups = st["duplicate_writes"] - before["duplicate_writes"]
    print("%s: source %d files %.1f MB (%d data blocks); %d blocks written, "
          "%d duplicates; status %s" % (fstype, len(files), total / 1e6, src_blocks,
                                        written, dups, st["raw"]))
    assert dups >= 0.9 * (COPIES - 1) * src_blocks, \
        "only %d duplicate writes for %d copies of %d blocks" % (dups, COPIES - 1, src_blocks)
    assert st["data_used"] < 0.6 * (st["unique_writes"] + st["duplicate_writes"]), st
    assert st["data_used"] * BLOCK < 0.6 * COPIES * total + 32 * ddlib.MIB, st

    run(["umount", mnt])
    p = run(fsck + [d.path], check=False, timeout=600)
    assert p.returncode == 0, "%s reports problems (%d):\n%s\n%s" % (
        fsck[0], p.returncode, p.stdout[-3000:], p.stderr[-2000:])
    run(["mount", "-t", fstype, d.path, mnt])
    for i in range(COPIES):
        got = ddlib.manifest(os.path.join(mnt, "c%d" % i), files)
        bad = [f for f in files if got.get(f) != man[f]]
        assert not bad, "copy %d: %d files differ, e.g. %s" % (i, len(bad), bad[:5])
    run(["umount", mnt])
