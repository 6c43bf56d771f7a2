"""What a target really sends to its devices, seen with blktrace.

    with IoTrace(data=dev.data, meta=dev.meta) as t:
        ...the operation...
    t.summary("data")   # {"writes": 0, "flushes": 1, ...}
    t.bios("meta")      # [Bio(op="W", preflush=False, fua=False, ...), ...]

A bio counts when it is queued on the traced device (blktrace's Q event):
what the layer above submitted, before any split or merge below. A read
of one block at sector 0 of each device, issued once the trace runs,
marks its start: everything up to it is dropped, and a trace without it
is an error, so an operation can never run before the trace did.
"""

import mmap
import os
import shutil
import signal
import subprocess
import time
from collections import namedtuple

import ddlib
from ddlib import BLOCK, run


class Bio(namedtuple("Bio", "op preflush fua sector sectors seq")):
    """op: "R" read, "W" write, "D" discard, "F" flush request, "N" other.
    An empty flush is op "W", preflush, 0 sectors. seq orders the bios of
    all the traced devices by the time they were queued."""

    @property
    def bytes(self):
        return self.sectors * 512

    @property
    def is_flush(self):
        return self.preflush or self.op == "F"


def parse_rwbs(rwbs):
    """(op, preflush, fua) from blkparse's RWBS field, as the kernel's
    blk_fill_rwbs() writes it: [F]{W,R,D,DE,F,N}[F][A][S][M]."""
    i = 0
    preflush = len(rwbs) > 1 and rwbs[0] == "F" and rwbs[1] in "WRDFN"
    if preflush:
        i = 1
    op = rwbs[i]
    i += 1
    if op == "D" and rwbs[i:i + 1] == "E":
        i += 1
    fua = rwbs[i:i + 1] == "F"
    return op, preflush, fua


class IoTrace:
    def __init__(self, **devices):
        self.devices = devices                  # role -> path
        self.kdev = {r: os.path.basename(os.path.realpath(p)) for r, p in devices.items()}
        self.dir = os.path.join(ddlib.TMPFS, "blktrace-%d" % os.getpid())
        self.proc = None
        self._bios = {}

    def __enter__(self):
        ddlib.ensure_debugfs()
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(self.dir)
        argv = ["blktrace", "-D", self.dir]
        for p in self.devices.values():
            argv += ["-d", os.path.realpath(p)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        # blktrace opens its per-CPU files, then starts the trace.
        ncpu = os.cpu_count()
        want = ["%s.blktrace.%d" % (k, c) for k in self.kdev.values() for c in range(ncpu)]
        deadline = time.time() + 30
        while not all(os.path.exists(os.path.join(self.dir, w)) for w in want):
            if self.proc.poll() is not None or time.time() > deadline:
                out = self._stop()
                raise AssertionError("blktrace did not start: %s" % out)
            time.sleep(0.1)
        time.sleep(0.5)
        for p in self.devices.values():
            fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
            buf = mmap.mmap(-1, BLOCK)          # page-aligned, as O_DIRECT needs
            try:
                os.preadv(fd, [buf], 0)
            finally:
                os.close(fd)
                buf.close()
        return self

    def _stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            out, _ = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return out

    def __exit__(self, exc_type, exc, tb):
        out = self._stop()
        try:
            if exc_type is not None:
                return False
            for line in out.splitlines():
                if "dropped" in line and "(dropped 0)" not in line:
                    raise AssertionError("blktrace dropped events: %s" % line.strip())
            self._parse()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
        return False

    def _parse(self):
        """One blkparse over every device, so that the events of all of
        them come in one time order (Bio.seq)."""
        role_of = {}
        for role, path in self.devices.items():
            rdev = os.stat(os.path.realpath(path)).st_rdev
            role_of["%d,%d" % (os.major(rdev), os.minor(rdev))] = role
        argv = ["blkparse", "-q", "-D", self.dir, "-f", "%M,%m %a %d %S %n\n"]
        for k in self.kdev.values():
            argv += ["-i", k]
        p = run(argv)
        self._bios = {r: [] for r in self.devices}
        marked = set()
        for seq, line in enumerate(p.stdout.splitlines()):
            f = line.split()
            if len(f) != 5 or f[1] != "Q" or f[0] not in role_of:
                continue
            role = role_of[f[0]]
            op, preflush, fua = parse_rwbs(f[2])
            b = Bio(op, preflush, fua, int(f[3]), int(f[4]), seq)
            if role not in marked:
                if op == "R" and b.sector == 0 and b.sectors == BLOCK // 512:
                    marked.add(role)
                continue
            self._bios[role].append(b)
        missing = set(self.devices) - marked
        if missing:
            raise AssertionError("the start marker of the %s trace is missing" %
                                 ", ".join(sorted(missing)))

    def bios(self, role):
        return list(self._bios[role])

    def summary(self, role):
        """Counts and bytes per kind of bio; a flush with data counts as a
        write and a flush."""
        s = {"reads": 0, "read_bytes": 0, "writes": 0, "write_bytes": 0, "flushes": 0,
             "fua": 0, "discards": 0, "discard_bytes": 0}
        for b in self._bios[role]:
            if b.is_flush:
                s["flushes"] += 1
            if b.fua:
                s["fua"] += 1
            if b.op == "R":
                s["reads"] += 1
                s["read_bytes"] += b.bytes
            elif b.op == "W" and b.sectors:
                s["writes"] += 1
                s["write_bytes"] += b.bytes
            elif b.op == "D":
                s["discards"] += 1
                s["discard_bytes"] += b.bytes
        return s


def describe(trace, role):
    """One line per bio, for assertion messages."""
    return "\n".join("  %s%s%s %d+%d" % ("F" if b.preflush else "", b.op, "F" if b.fua else "",
                                          b.sector, b.sectors) for b in trace.bios(role))
