"""A cgroup v2 group with the io controller, for the tests of whose I/O
the target charges: the test process joins the group for a while, and the
group's io.stat says what it did on each device.

The guest may boot without cgroup2 mounted: it is mounted on
/sys/fs/cgroup then, and stays (over cgroup v1 hierarchies, if a system
had them there: the test guest has none). A kernel without the io
controller fails the test (RuntimeError), it is not skipped.
"""

import contextlib
import os

from ddlib import run

ROOT = "/sys/fs/cgroup"
IO_KEYS = ("rbytes", "wbytes", "rios", "wios", "dbytes", "dios")


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _own_group():
    """The cgroup v2 directory the calling process is in."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            if line.startswith("0::"):
                return os.path.join(ROOT, line.strip()[3:].lstrip("/"))
    raise RuntimeError("/proc/self/cgroup names no cgroup v2 group")


class IoGroup:
    def __init__(self, name):
        if not os.path.exists(os.path.join(ROOT, "cgroup.controllers")):
            os.makedirs(ROOT, exist_ok=True)
            run(["mount", "-t", "cgroup2", "cgroup2", ROOT])
        with open(os.path.join(ROOT, "cgroup.controllers")) as f:
            if "io" not in f.read().split():
                raise RuntimeError("cgroup2 at %s has no io controller" % ROOT)
        _write(os.path.join(ROOT, "cgroup.subtree_control"), "+io")
        self.path = os.path.join(ROOT, name)
        os.mkdir(self.path)

    @contextlib.contextmanager
    def joined(self):
        """The calling process (all its threads) is in the group inside
        the block, and back in its own group after it."""
        home = _own_group()
        _write(os.path.join(self.path, "cgroup.procs"), str(os.getpid()))
        try:
            yield
        finally:
            _write(os.path.join(home, "cgroup.procs"), str(os.getpid()))

    def io_stat(self, dev):
        """What the group did on block device `dev` (a path), from its
        io.stat: {rbytes, wbytes, rios, wios, dbytes, dios}, zeros for a
        device it never used."""
        st = os.stat(dev)
        key = "%d:%d" % (os.major(st.st_rdev), os.minor(st.st_rdev))
        with open(os.path.join(self.path, "io.stat")) as f:
            for line in f:
                fields = line.split()
                if fields and fields[0] == key:
                    got = dict(x.split("=", 1) for x in fields[1:])
                    return {k: int(got.get(k, 0)) for k in IO_KEYS}
        return dict.fromkeys(IO_KEYS, 0)

    def io_stat_text(self):
        """The group's io.stat as the kernel prints it (for messages)."""
        with open(os.path.join(self.path, "io.stat")) as f:
            return f.read()

    def remove(self):
        os.rmdir(self.path)
