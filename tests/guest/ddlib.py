"""Helpers for the dm-dedup guest test suite (runs INSIDE the QEMU guest).

Everything here talks to the kernel through the ordinary tools (dmsetup,
losetup, blkdiscard, insmod/modprobe) and through O_DIRECT I/O on the device
nodes.  Written against Documentation/dm-dedup.rst.
"""

import hashlib
import mmap
import os
import random
import re
import subprocess
import time

BLOCK = 4096                   # dedup block size (bytes)
SECTORS_PER_BLOCK = BLOCK // 512
MIB = 1 << 20

REPO = os.environ.get("DEDUP_REPO") or os.path.abspath(
    os.path.join(os.path.dirname(__file__), "..", ".."))
DEDUP_KO = os.environ.get("DEDUP_KO") or os.path.join(REPO, "dm-dedup", "dm-dedup.ko")
METADATA_CHECKS = 0           # metadata devices checked clean so far
DATA_CHECKS = 0               # of those, checked with their data device
DEDUP_BIN = os.environ.get("DEDUP_BIN") or os.path.join(REPO, "tools", "target", "release", "dedup")
TMPFS = os.environ.get("DEDUP_TMPFS", "/tmp/dd-tmpfs")
NAME_PREFIX = "ddt"            # every dm device the suite creates starts with this
# 0: the bounded runs of the test command; N > 0 (make torture TRIALS=N):
# N trials per torture test, with longer workloads
TORTURE_TRIALS = int(os.environ.get("DD_TORTURE_TRIALS", "0") or 0)
REPORT = []                    # lines for the end of the run (trial counts)


def report(line):
    """A figure for the terminal summary, e.g. how many crash points a
    torture test checked; printed even when output is captured."""
    REPORT.append(line)
    print(line)


# --------------------------------------------------------------------------
# processes
# --------------------------------------------------------------------------
def build_helper(name):
    """Compile tests/guest/helpers/NAME.c with gcc into the tmpfs; return
    the binary's path."""
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers",
                       name + ".c")
    out = os.path.join(TMPFS, name)
    run(["gcc", "-O2", "-Wall", "-Werror", "-pthread", "-o", out, src])
    return out


class CmdError(AssertionError):
    pass


# Where the suite's own time goes (the end of the run lists the largest):
# {what: [calls, seconds]} by command and its first argument.
SPENT = {}


def spent(what, seconds):
    s = SPENT.setdefault(what, [0, 0.0])
    s[0] += 1
    s[1] += seconds


def _command_name(cmd, shell):
    words = cmd.split() if shell else [str(w) for w in cmd]
    if not words:
        return "?"
    name = os.path.basename(words[0])
    # the verb: "dmsetup remove", "dedup check", but not a path or an option
    if len(words) > 1 and re.match(r"^[a-z][a-z_-]*$", words[1]):
        name += " " + words[1]
    return name


def run(cmd, check=True, input=None, timeout=300, quiet=False):
    """Run a command (list or shell string); return CompletedProcess (text)."""
    shell = isinstance(cmd, str)
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, shell=shell, input=input, capture_output=True,
                           text=True, timeout=timeout)
    finally:
        spent(_command_name(cmd, shell), time.monotonic() - t0)
    if check and p.returncode != 0:
        raise CmdError("command failed (%d): %s\nstdout: %s\nstderr: %s" % (
            p.returncode, cmd if shell else " ".join(map(str, cmd)),
            p.stdout.strip(), p.stderr.strip()))
    return p


def udev_settle():
    run(["udevadm", "settle", "--timeout=30"], check=False)


# --------------------------------------------------------------------------
# kernel log
# --------------------------------------------------------------------------
BAD_KMSG = re.compile(
    r"WARNING:|\bBUG\b|KFENCE|Oops|general protection|list_add corruption|"
    r"list_del corruption|UBSAN|kernel BUG|Call Trace|INFO: task .* blocked|"
    r"stack-protector|refcount_t:")


class Kmsg:
    """Reads kernel log records produced after its creation (/dev/kmsg)."""

    def __init__(self):
        self.fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
        os.lseek(self.fd, 0, os.SEEK_END)
        self._lines = []

    def _drain(self):
        while True:
            try:
                rec = os.read(self.fd, 16384)
            except BlockingIOError:
                break
            except BrokenPipeError:      # records overwritten: skip ahead
                continue
            if not rec:
                break
            text = rec.decode("utf-8", "replace")
            head, _, msg = text.partition(";")
            msg = msg.split("\n", 1)[0]  # drop the dictionary lines
            msg = msg.replace("\\x0a", "\n")
            self._lines.extend(msg.split("\n"))

    def lines(self):
        """All kernel log lines since creation."""
        self._drain()
        return list(self._lines)

    def bad_lines(self):
        return [l for l in self.lines() if BAD_KMSG.search(l)]

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def dmesg_tail(n=20):
    """The last n lines of the kernel log (for error-message assertions)."""
    out = run(["dmesg"], check=False).stdout.splitlines()
    return out[-n:]


# --------------------------------------------------------------------------
# modules
# --------------------------------------------------------------------------
BASE_MODULES = ["dm-mod", "dm-bufio", "libcrc32c", "crc32c", "loop"]


def modprobe(*mods, check=True):
    for m in mods:
        run(["modprobe", m], check=check)


def module_loaded(name="dm_dedup"):
    return os.path.isdir("/sys/module/" + name)


# The modules load_dedup_module() has seen to, by module file: the suite
# reloads dm-dedup after every test, and asking modprobe again for each
# module it needs cost more than the reload itself.
_DEPS_DONE = {}


def load_dedup_module(ko=None):
    ko = ko or DEDUP_KO
    if not os.path.isfile(ko):
        raise AssertionError("dm-dedup module not found: %s (build it with make)" % ko)
    if ko not in _DEPS_DONE:
        for m in BASE_MODULES:
            run(["modprobe", m], check=False)   # some may not exist; fine
        deps = run(["modinfo", "-F", "depends", ko], check=False).stdout.strip()
        _DEPS_DONE[ko] = list(filter(None, deps.split(",")))
        modprobe(*_DEPS_DONE[ko])
    else:
        # the same modules, unless one went away (insmod would fail)
        modprobe(*[d for d in _DEPS_DONE[ko]
                   if not module_loaded(d.replace("-", "_"))])
    if not module_loaded():
        run(["insmod", ko])
    assert module_loaded(), "dm_dedup not in /sys/module after insmod"
    assert "dedup" in run(["dmsetup", "targets"]).stdout.split(), \
        "target 'dedup' not registered (dmsetup targets)"


def unload_dedup_module():
    run(["rmmod", "dm_dedup"])
    assert not module_loaded(), "dm_dedup still loaded after rmmod"


# --------------------------------------------------------------------------
# device mapper
# --------------------------------------------------------------------------
def dm_names():
    out = run(["dmsetup", "ls"], check=False).stdout
    if "No devices found" in out:
        return []
    return [l.split()[0] for l in out.splitlines() if l.strip()]


def dm_exists(name):
    return run(["dmsetup", "info", name], check=False).returncode == 0


def dm_remove(name, force=False):
    cmd = ["dmsetup", "remove", "--retry"]
    if force:
        cmd.append("--force")
    run(cmd + [name], timeout=300)


def dm_devices_with_target(target):
    out = run(["dmsetup", "table", "--target", target], check=False).stdout
    names = []
    for l in out.splitlines():
        if ":" in l and "No devices found" not in l:
            names.append(l.split(":", 1)[0].strip())
    return names


def dm_open_count(name):
    out = run(["dmsetup", "info", "-c", "--noheadings", "-o", "open", name],
              check=False).stdout.strip()
    try:
        return int(out)
    except ValueError:
        return 0


def remove_dm_devices(prefix=NAME_PREFIX):
    """Remove our dm devices (names starting with prefix), top of the stacks
    first.  Returns a list of errors (empty when all went away cleanly)."""
    errors = []
    last_err = {}
    for _ in range(10):
        names = [n for n in dm_names() if n.startswith(prefix)]
        if not names:
            return errors
        udev_settle()
        progress = False
        for n in names:
            if dm_open_count(n) > 0:
                continue            # held by a device above it (or a mount)
            p = run(["dmsetup", "remove", "--retry", n], check=False, timeout=300)
            if p.returncode == 0:
                progress = True
            else:
                last_err[n] = p.stderr.strip()
        if not progress:
            time.sleep(1)
    left = [n for n in dm_names() if n.startswith(prefix)]
    if left:
        errors.append("dm devices could not be removed: %s %s" % (left, last_err))
        for n in left:
            run(["dmsetup", "remove", "--force", n], check=False, timeout=300)
    return errors


STATUS_FIELDS = ("mode", "transaction_id", "metadata", "data", "mapped",
                 "unique_writes", "duplicate_writes", "zero_writes", "discarded",
                 "hash", "verify", "discard_passdown", "journal")


def parse_status(line):
    """Parse a `dmsetup status` line of a dedup device into a dict.

    Keys: mode, transaction_id, meta_used, meta_total, data_used, data_total,
    mapped, unique_writes, duplicate_writes, zero_writes, discarded, hash,
    verify, discard_passdown (these three as printed), journal_used,
    journal_total, and raw.
    """
    parts = line.split()
    assert len(parts) >= 3 and parts[2] == "dedup", "not a dedup status: %r" % line
    f = parts[3:]
    assert len(f) >= len(STATUS_FIELDS), \
        "dedup status has %d fields, expected %d: %r" % (len(f), len(STATUS_FIELDS), line)
    st = {"raw": line, "start": int(parts[0]), "length": int(parts[1])}
    st["mode"] = f[0]
    st["transaction_id"] = int(f[1])
    mu, mt = f[2].split("/")
    du, dt = f[3].split("/")
    st.update(meta_used=int(mu), meta_total=int(mt), data_used=int(du), data_total=int(dt))
    for i, k in enumerate(("mapped", "unique_writes", "duplicate_writes",
                           "zero_writes", "discarded"), start=4):
        st[k] = int(f[i])
    st["hash"] = f[9]
    st["verify"] = f[10]
    st["discard_passdown"] = f[11]
    ju, jt = f[12].split("/")
    st.update(journal_used=int(ju), journal_total=int(jt))
    return st


def wait_for_append_ahead(dev, before):
    """An append sent ahead (Documentation/dm-dedup.rst, "The journal")
    runs on its own: wait until it is written and the data flush it relied
    on is done (counted as skipped once the append has waited for the one
    sent ahead, or found nothing to flush), so that later writes go to the
    next append. @before: the stats before the write. Returns the stats."""
    deadline = time.time() + 30
    while True:
        st = dev.stats()
        if int(st["journal_appends"]) > int(before["journal_appends"]) and \
                int(st["data_flushes_skipped"]) > int(before["data_flushes_skipped"]):
            return st
        assert time.time() < deadline, "no append ahead within 30 s: %s" % st
        time.sleep(0.1)


def durable_point(st):
    """Where durability stands, from a status dict: (transaction_id, journal
    blocks appended since that commit). A flush moves it forward: an append
    grows the second, a commit raises the first (and empties the journal)."""
    return (st["transaction_id"], st["journal_used"])


COUNTERS = ("data_used", "mapped", "unique_writes", "duplicate_writes",
            "zero_writes", "discarded")


def counters(st):
    return {k: st[k] for k in COUNTERS}


def table_line(meta, data, logical_sectors, opts=()):
    opts = [str(o) for o in opts]
    line = "0 %d dedup %s %s" % (logical_sectors, meta, data)
    if opts:
        line += " %d %s" % (len(opts), " ".join(opts))
    return line


def try_create(name, table):
    """dmsetup create; return the CompletedProcess (never raises)."""
    p = run(["dmsetup", "create", name, "--table", table], check=False, timeout=300)
    udev_settle()
    return p


class DedupDev:
    """A dm-dedup device driven through dmsetup."""

    def __init__(self, name, meta, data, logical_sectors, opts=()):
        self.name = name
        self.meta = meta
        self.data = data
        self.logical_sectors = logical_sectors
        self.opts = list(opts)
        self.activation_log = []

    @property
    def path(self):
        return "/dev/mapper/" + self.name

    @property
    def nblocks(self):
        return self.logical_sectors // SECTORS_PER_BLOCK

    def table_line(self):
        return table_line(self.meta, self.data, self.logical_sectors, self.opts)

    @classmethod
    def create(cls, name, meta, data, logical_sectors, opts=()):
        d = cls(name, meta, data, logical_sectors, opts)
        d.activate()
        return d

    def activate(self, table=None):
        """dmsetup create; the kernel log lines it caused are kept in
        self.activation_log (reload() keeps those of its resume there)."""
        table = table or self.table_line()
        with Kmsg() as k:
            p = try_create(self.name, table)
            self.activation_log = k.lines()
        if p.returncode != 0:
            raise CmdError("dmsetup create %s --table %r failed: %s\nkernel log:\n%s" % (
                self.name, table, p.stderr.strip(), "\n".join(dmesg_tail(8))))
        for _ in range(100):
            if os.path.exists(self.path):
                break
            time.sleep(0.1)
        assert os.path.exists(self.path), "%s did not appear" % self.path
        return self

    def remove(self):
        udev_settle()
        run(["dmsetup", "remove", "--retry", self.name], timeout=300)
        assert not dm_exists(self.name)

    def status_line(self):
        return run(["dmsetup", "status", self.name]).stdout.strip()

    def status(self):
        return parse_status(self.status_line())

    def table(self):
        return run(["dmsetup", "table", self.name]).stdout.strip()

    def message(self, *args, check=True):
        p = run(["dmsetup", "message", self.name, "0"] + [str(a) for a in args],
                check=check)
        return p if not check else p.stdout

    def stats(self):
        """The `stats` message as a dict of strings."""
        return dict(l.split(None, 1) for l in self.message("stats").splitlines()
                    if l.strip())

    def commit(self):
        self.message("commit")

    def events(self):
        out = run(["dmsetup", "info", "-c", "--noheadings", "-o", "events",
                   self.name]).stdout.strip()
        return int(out)

    def suspend(self, *flags):
        run(["dmsetup", "suspend"] + list(flags) + [self.name])

    def reload(self, table=None):
        """dmsetup reload with @table (default: this device's table line),
        then resume: the new table takes over at the resume."""
        with Kmsg() as k:
            run(["dmsetup", "reload", self.name, "--table", table or self.table_line()])
            self.resume()
            self.activation_log = k.lines()

    def resume(self):
        run(["dmsetup", "resume", self.name])


# --------------------------------------------------------------------------
# backing devices: loop devices over files on a guest tmpfs, null_blk
# --------------------------------------------------------------------------
def mount_tmpfs(path=TMPFS, size="3G"):
    os.makedirs(path, exist_ok=True)
    if not os.path.ismount(path):
        run(["mount", "-t", "tmpfs", "-o", "size=%s,mode=0755" % size, "dd-tmpfs", path])


def umount_tmpfs(path=TMPFS):
    if os.path.ismount(path):
        run(["umount", path], check=False)


def dedup_check(meta, data=None):
    """`dedup check META [--data DATA]`, its CompletedProcess."""
    return run([DEDUP_BIN, "check", meta] + (["--data", data] if data else []), check=False)


def check_clean(meta, data=None, what=""):
    """`dedup check META [--data DATA]` must exit 0 (clean; warnings
    allowed): the oracle on metadata a test leaves at a point it names
    (@what), e.g. after a crash and the recovery. No dedup target may hold
    the devices (the tool opens them with O_EXCL). Counted in the run's
    summary."""
    global METADATA_CHECKS, DATA_CHECKS
    p = dedup_check(meta, data)
    assert p.returncode == 0, "%sdedup check %s%s: exit %d (0 = clean):\n%s%s" % (
        what + ": " if what else "", meta, " --data " + data if data else "",
        p.returncode, p.stdout[-4000:], p.stderr[-2000:])
    METADATA_CHECKS += 1
    DATA_CHECKS += bool(data)
    return p


class Backing:
    """Creates and tears down backing block devices for one test."""

    def __init__(self, tmpfs=TMPFS):
        self.tmpfs = tmpfs
        self.files = []
        self.loops = []
        self.nullbs = []
        self.mounts = []
        self.vgs = []                # lvm.VolumeGroup, registered by itself
        # (metadata, data) pairs that are neither loops nor volumes named
        # meta*/data* (null_blk disks of a power-cut rig), checked too
        self.pairs = []
        self._n = 0
        self.checked = 0
        self.data_checked = 0

    def loop(self, size_mib, name=None, read_only=False):
        """A zero-filled (sparse) loop device of size_mib MiB; returns its
        path.  Its file is self.files[-1] until the next loop()."""
        self._n += 1
        name = name or "b%d" % self._n
        path = os.path.join(self.tmpfs, "%s-%d.img" % (name, os.getpid()))
        with open(path, "wb") as f:
            f.truncate(int(size_mib * MIB))
        self.files.append(path)
        dev = run(["losetup"] + (["-r"] if read_only else []) +
                  ["-f", "--show", path]).stdout.strip()
        self.loops.append(dev)
        udev_settle()
        return dev

    def nullb(self, name, size_mib, cache_mib=0, blocksize=4096):
        """A memory-backed null_blk disk /dev/NAME with a volatile write cache
        of cache_mib MiB (0: none).  power_cycle() loses unflushed writes."""
        ensure_configfs_nullb()
        d = "/sys/kernel/config/nullb/" + name
        os.mkdir(d)
        self.nullbs.append(d)
        for attr, val in (("memory_backed", 1), ("blocksize", blocksize),
                          ("size", size_mib), ("cache_size", cache_mib),
                          ("discard", 1), ("power", 1)):
            with open(os.path.join(d, attr), "w") as f:
                f.write("%s\n" % val)
        udev_settle()
        dev = "/dev/" + name
        for _ in range(100):
            if os.path.exists(dev):
                break
            time.sleep(0.1)
        assert os.path.exists(dev), dev + " did not appear"
        return dev

    def power(self, name, on):
        with open("/sys/kernel/config/nullb/%s/power" % name, "w") as f:
            f.write("1\n" if on else "0\n")
        udev_settle()
        if on:
            for _ in range(100):
                if os.path.exists("/dev/" + name):
                    break
                time.sleep(0.1)

    def named_devices(self):
        """(name, device) of every loop (named by its file) and logical
        volume, in creation order per kind."""
        out = [(os.path.basename(f), dev) for f, dev in zip(self.files, self.loops)]
        for vg in self.vgs:
            out += vg.volumes
        return out

    @staticmethod
    def data_for(devs, i):
        """The data device made for the metadata device devs[i]: the next
        device named data*, before the next meta* one."""
        for name, dev in devs[i + 1:]:
            if name.startswith("meta"):
                return None
            if name.startswith("data"):
                return dev
        return None

    def check_metadata(self):
        """The offline checker is the oracle: every metadata device a test
        leaves behind (a loop over a file named meta*, or a logical volume
        named meta*) must check clean, and with its data device (the next
        data* one) every live data block must hash to its fingerprint
        record; so must every pair registered in self.pairs. A
        never-formatted one (both superblock slots zero) is fine."""
        errors = []
        devs = self.named_devices()
        todo = [(name, dev, self.data_for(devs, i)) for i, (name, dev) in enumerate(devs)
                if name.startswith("meta")]
        todo += [(os.path.basename(m), m, d) for m, d in self.pairs]
        for name, dev, data in todo:
            p = dedup_check(dev, data)
            if p.returncode == 8 and "not formatted" in p.stderr:
                continue
            if p.returncode != 0:
                errors.append("dedup check %s (%s) exit %d:\n%s%s" % (
                    dev, name, p.returncode, p.stdout, p.stderr))
            self.checked += 1
            self.data_checked += bool(data)
        global METADATA_CHECKS, DATA_CHECKS
        METADATA_CHECKS += self.checked
        DATA_CHECKS += self.data_checked
        return errors

    def cleanup(self):
        """Tear everything down; return a list of error strings."""
        errors = []
        for m in reversed(self.mounts):
            if os.path.ismount(m):
                p = run(["umount", m], check=False)
                if p.returncode:
                    run(["umount", "-l", m], check=False)
                    errors.append("umount %s: %s" % (m, p.stderr.strip()))
        udev_settle()
        errors += remove_dm_devices()
        errors += self.check_metadata()
        for vg in reversed(self.vgs):
            errors += vg.remove()
        for dev in reversed(self.loops):
            run(["losetup", "-d", dev], check=False)
        for f in self.files:
            try:
                os.unlink(f)
            except FileNotFoundError:
                pass
        for d in reversed(self.nullbs):
            try:
                with open(os.path.join(d, "power"), "w") as f:
                    f.write("0\n")
            except OSError:
                pass
            try:
                os.rmdir(d)
            except OSError as e:
                errors.append("rmdir %s: %s" % (d, e))
        self.files, self.loops, self.nullbs, self.mounts = [], [], [], []
        self.vgs, self.pairs = [], []
        return errors


def ensure_configfs():
    """configfs at /sys/kernel/config (null_blk's and LIO's settings)."""
    if not os.path.ismount("/sys/kernel/config"):
        run(["mount", "-t", "configfs", "none", "/sys/kernel/config"])


def ensure_debugfs():
    """debugfs at /sys/kernel/debug (blktrace's relay files, scsi_debug's
    error injection); returns its path."""
    path = "/sys/kernel/debug"
    if not os.path.ismount(path):
        run(["mount", "-t", "debugfs", "none", path])
    return path


def ensure_configfs_nullb():
    if not os.path.isdir("/sys/kernel/config/nullb"):
        run(["modprobe", "null_blk", "nr_devices=0"])
        ensure_configfs()
    assert os.path.isdir("/sys/kernel/config/nullb")


# --------------------------------------------------------------------------
# deterministic block content and direct I/O
# --------------------------------------------------------------------------
ZERO = bytes(BLOCK)


def block_data(seed, bid):
    """Content of 4 KiB block `bid` for `seed`: a PRNG stream; never all-zero.
    bid None means the zero block.  Duplicates = reuse an id."""
    if bid is None:
        return ZERO
    return random.Random(seed * 1_000_000_007 + bid).randbytes(BLOCK)


def digest(b):
    return hashlib.sha256(b).hexdigest()[:16]


class BlockDev:
    """O_DIRECT block I/O, 4 KiB aligned, with an mmap (page aligned) buffer."""

    def __init__(self, path, flags=0, readonly=False):
        self.path = path
        self.fd = os.open(path, (os.O_RDONLY if readonly else os.O_RDWR) | os.O_DIRECT |
                          flags)
        self.buf = mmap.mmap(-1, BLOCK)
        self.big = None

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        self.buf.close()
        if self.big is not None:
            self.big.close()

    def write(self, lba, data):
        """Write one 4 KiB block at logical block `lba` (raises OSError)."""
        assert len(data) == BLOCK
        self.buf[:] = data
        n = os.pwrite(self.fd, self.buf, lba * BLOCK)
        assert n == BLOCK, "short write %d at block %d" % (n, lba)

    def read(self, lba):
        n = os.preadv(self.fd, [self.buf], lba * BLOCK)
        assert n == BLOCK, "short read %d at block %d" % (n, lba)
        return bytes(self.buf)

    def read_range(self, lba, count):
        """Read `count` blocks starting at `lba`; returns a list of bytes."""
        out = []
        chunk = 256
        if self.big is None:
            self.big = mmap.mmap(-1, chunk * BLOCK)
        while count > 0:
            c = min(count, chunk)
            mv = memoryview(self.big)[:c * BLOCK]
            n = os.preadv(self.fd, [mv], lba * BLOCK)
            assert n == c * BLOCK, "short read %d at block %d" % (n, lba)
            data = bytes(mv)
            mv.release()
            out += [data[i * BLOCK:(i + 1) * BLOCK] for i in range(c)]
            lba += c
            count -= c
        return out

    def write_range(self, lba, blocks, flags=0):
        """Write the 4 KiB `blocks` (a list of bytes) from logical block
        `lba` in ONE pwritev (one bio up to the device's limits; dm splits
        it at the target's maximum I/O size).  `flags`: os.RWF_*."""
        size = len(blocks) * BLOCK
        if self.big is None or len(self.big) < size:
            if self.big is not None:
                self.big.close()
            self.big = mmap.mmap(-1, max(size, 256 * BLOCK))
        with memoryview(self.big)[:size] as mv:
            mv[:] = b"".join(blocks)
            n = os.pwritev(self.fd, [mv], lba * BLOCK, flags)
        assert n == size, "short write %d at block %d" % (n, lba)

    def fsync(self):
        os.fsync(self.fd)


def write_ids(path, seed, layout, start=0):
    """layout: list of content ids (None = zero block) written sequentially,
    one O_DIRECT write per block, at LBAs start, start+1, ...  Returns the
    expected content map {lba: bytes}."""
    exp = {}
    with BlockDev(path) as bd:
        for i, bid in enumerate(layout):
            data = block_data(seed, bid)
            bd.write(start + i, data)
            exp[start + i] = data
    return exp


def verify_blocks(path, expected, nblocks=None):
    """expected: {lba: bytes}.  If nblocks is given, every other LBA below
    nblocks must read zeros.  Raises AssertionError listing mismatches."""
    bad = []
    # Read only: closing a writable descriptor makes udev probe the device.
    with BlockDev(path, readonly=True) as bd:
        if nblocks is None:
            for lba in sorted(expected):
                got = bd.read(lba)
                if got != expected[lba]:
                    bad.append((lba, digest(expected[lba]), digest(got)))
        else:
            got_all = bd.read_range(0, nblocks)
            for lba in range(nblocks):
                exp = expected.get(lba, ZERO)
                if got_all[lba] != exp:
                    bad.append((lba, digest(exp), digest(got_all[lba])))
    assert not bad, "%d blocks differ (lba, expected, got): %s" % (len(bad), bad[:20])


def discard(path, first_block, nblocks):
    run(["blkdiscard", "-o", str(first_block * BLOCK), "-l", str(nblocks * BLOCK), path])


def zeroout(path, first_block, nblocks):
    run(["blkdiscard", "-z", "-o", str(first_block * BLOCK), "-l",
         str(nblocks * BLOCK), path])


def device_bytes(path):
    return int(run(["blockdev", "--getsize64", path]).stdout)


def dm_linear(name, dev):
    """A dm-linear device NAME over all of DEV, so that a fault can be
    switched in under a running target; returns (path, sectors)."""
    sectors = device_bytes(dev) // 512
    run(["dmsetup", "create", name, "--table", "0 %d linear %s 0" % (sectors, dev)])
    return "/dev/mapper/" + name, sectors


def dm_swap_table(name, table):
    """Replace NAME's table (e.g. linear by flakey) without flushing."""
    run(["dmsetup", "suspend", "--noflush", "--nolockfs", name])
    run(["dmsetup", "reload", name, "--table", table])
    run(["dmsetup", "resume", name])


# --------------------------------------------------------------------------
# directory trees (filesystem tests, demo)
# --------------------------------------------------------------------------
def pick_tree(src, max_bytes):
    """Regular files under src (sorted walk, no __pycache__) until max_bytes."""
    picked, total = [], 0
    for root, dirs, files in os.walk(src):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for fn in sorted(files):
            p = os.path.join(root, fn)
            if not os.path.isfile(p) or os.path.islink(p):
                continue
            sz = os.path.getsize(p)
            if total + sz > max_bytes:
                continue
            picked.append(os.path.relpath(p, src))
            total += sz
        if total >= max_bytes * 0.98:
            break
    return picked, total


def copy_files(src, relpaths, dst):
    for rel in relpaths:
        s = os.path.join(src, rel)
        d = os.path.join(dst, rel)
        os.makedirs(os.path.dirname(d), exist_ok=True)
        with open(s, "rb") as fi, open(d, "wb") as fo:
            while True:
                b = fi.read(1 << 20)
                if not b:
                    break
                fo.write(b)


def read_tree(src, relpaths):
    """{relpath: bytes} (read the source once: 9p reads are slow)."""
    out = {}
    for rel in relpaths:
        with open(os.path.join(src, rel), "rb") as f:
            out[rel] = f.read()
    return out


def write_tree(contents, dst):
    for rel, data in contents.items():
        d = os.path.join(dst, rel)
        os.makedirs(os.path.dirname(d), exist_ok=True)
        with open(d, "wb") as f:
            f.write(data)


def manifest_of(contents):
    return {rel: hashlib.sha256(b).hexdigest() for rel, b in contents.items()}


def data_blocks_in(contents):
    """Number of non-zero 4 KiB file blocks (what one copy must write)."""
    n = 0
    for b in contents.values():
        for off in range(0, len(b), BLOCK):
            blk = b[off:off + BLOCK]
            if blk.count(0) != len(blk):
                n += 1
    return n


def file_sha256(path):
    """Hex SHA-256 of a file's content, read 1 MiB at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def manifest(root, relpaths=None):
    """{relpath: sha256} of the regular files under root."""
    out = {}
    if relpaths is None:
        relpaths = []
        for r, dirs, files in os.walk(root):
            if "lost+found" in dirs:
                dirs.remove("lost+found")
            for fn in files:
                relpaths.append(os.path.relpath(os.path.join(r, fn), root))
    for rel in relpaths:
        out[rel] = file_sha256(os.path.join(root, rel))
    return out


def data_blocks_of(root, relpaths):
    """Number of non-zero 4 KiB file blocks (what a copy must write)."""
    n = 0
    for rel in relpaths:
        with open(os.path.join(root, rel), "rb") as f:
            while True:
                b = f.read(BLOCK)
                if not b:
                    break
                if b.count(0) != len(b):
                    n += 1
    return n
