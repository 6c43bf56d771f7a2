"""Small VM disk images, as a datastore holds them: each an ext4 file
system (mkfs.ext4 -d packs a tree without mounting anything) with the same
"operating system" (a slice of the guest's Python library) and a few MiB
of its own data, in raw or qcow2 format (qemu-img convert). Like real VM
images of one distribution, they share most of their blocks.
"""

import hashlib
import os
import random
import shutil

import ddlib
from ddlib import MIB, run

OS_SOURCE = "/usr/lib/python3.11"
OS_BYTES = 24 * MIB
OWN_BYTES = 2 * MIB
IMAGE_MIB = 48


def build(workdir, names, seed, os_source=OS_SOURCE, os_bytes=OS_BYTES,
          image_mib=IMAGE_MIB):
    """Images @names (a .raw or .qcow2 suffix each) under @workdir, of
    @image_mib MiB with @os_bytes of files from @os_source; returns
    {name: (path, sha256 hex, size)}."""
    tree = os.path.join(workdir, "os-tree")
    if not os.path.isdir(tree):
        rel, _ = ddlib.pick_tree(os_source, os_bytes)
        ddlib.copy_files(os_source, rel, tree)
    out = {}
    for i, name in enumerate(names):
        base, fmt = os.path.splitext(name)
        root = os.path.join(workdir, base + "-root")
        shutil.copytree(tree, os.path.join(root, "usr"), dirs_exist_ok=True)
        os.makedirs(os.path.join(root, "var"), exist_ok=True)
        rnd = random.Random("%s-%d-%s" % (seed, i, name))
        with open(os.path.join(root, "var", "own-data"), "wb") as f:
            f.write(rnd.randbytes(OWN_BYTES))
        raw = os.path.join(workdir, base + ".raw")
        with open(raw, "wb") as f:
            f.truncate(image_mib * MIB)
        run(["mkfs.ext4", "-q", "-F", "-b", "4096", "-d", root, raw])
        shutil.rmtree(root)
        path = raw
        if fmt == ".qcow2":
            path = os.path.join(workdir, name)
            run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", raw, path])
            os.unlink(raw)
        out[name] = (path, sha256_of(path), os.path.getsize(path))
    return out


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(MIB)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def drop_caches():
    """So that a read back comes from the device (or the server), not from
    this guest's page cache."""
    run(["sync"])
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
