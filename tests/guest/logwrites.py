"""Reader and replayer for dm-log-writes logs.

Written from Documentation/admin-guide/device-mapper/log-writes.rst and the
on-disk description at the top of drivers/md/dm-log-writes.c:

  * byte 0: the super: le64 magic 0x6a736677736872, le64 version (1),
    le64 nr_entries, le32 sectorsize (the logical block size of the logged
    device; every sector number and count in the log uses this unit);
  * from byte `sectorsize` on, nr_entries times: one sector holding the entry
    (le64 sector, le64 nr_sectors, le64 flags, le64 data_len; for a mark the
    mark text follows the entry inside that sector), then, for a write,
    nr_sectors sectors of the data written.  Discards and marks carry no
    data sectors.

Writes are logged in completion order once they are stable: plain writes
appear just before the FLUSH that made them durable, FUA writes as soon as
they complete.  Replaying entries 0..k onto a zeroed device therefore gives
exactly what a disk could hold after a power cut right after entry k.
"""

import os
import struct

MAGIC = 0x6a736677736872
FLUSH, FUA, DISCARD, MARK, METADATA = 1, 2, 4, 8, 16

_SUPER = struct.Struct("<QQQI")
_ENTRY = struct.Struct("<QQQQ")


class LogError(Exception):
    pass


class Entry:
    __slots__ = ("index", "sector", "nr_sectors", "flags", "data_off", "mark")

    def __init__(self, index, sector, nr_sectors, flags, data_off, mark):
        self.index = index
        self.sector = sector
        self.nr_sectors = nr_sectors
        self.flags = flags
        self.data_off = data_off      # byte offset of the data in the log
        self.mark = mark              # text of a mark, else None

    @property
    def is_write(self):
        return self.nr_sectors > 0 and not self.flags & (DISCARD | MARK)

    @property
    def is_crash_point(self):
        """A prefix ending here is a state the disk can be in after a power
        cut that the writer had to be prepared for."""
        return bool(self.flags & (FLUSH | FUA))

    def __repr__(self):
        kind = "mark %r" % self.mark if self.mark is not None else \
            "discard" if self.flags & DISCARD else \
            "write" if self.nr_sectors else "flush"
        return "<entry %d %s sector %d +%d flags %#x>" % (
            self.index, kind, self.sector, self.nr_sectors, self.flags)


class Log:
    """All entries of one log, parsed up front (entries only: the data stays
    in the file until it is replayed)."""

    def __init__(self, path):
        self.path = path
        with open(path, "rb") as f:
            head = f.read(_SUPER.size)
            if len(head) < _SUPER.size:
                raise LogError("%s: shorter than a log super" % path)
            magic, version, nr, ssize = _SUPER.unpack(head)
            if magic != MAGIC:
                raise LogError("%s: bad magic %#x" % (path, magic))
            if version != 1:
                raise LogError("%s: unknown log version %d" % (path, version))
            if ssize < 512 or ssize & (ssize - 1):
                raise LogError("%s: bad sector size %d" % (path, ssize))
            self.sectorsize = ssize
            self.entries = []
            size = os.fstat(f.fileno()).st_size
            off = ssize
            for i in range(nr):
                f.seek(off)
                raw = f.read(ssize)
                if len(raw) < ssize:
                    raise LogError("%s: entry %d beyond the end" % (path, i))
                sector, nsec, flags, dlen = _ENTRY.unpack_from(raw)
                mark = None
                if flags & MARK:
                    if dlen > ssize - _ENTRY.size:
                        raise LogError("%s: entry %d: mark too long" % (path, i))
                    mark = raw[_ENTRY.size:_ENTRY.size + dlen].rstrip(b"\0").decode()
                off += ssize
                e = Entry(i, sector, nsec, flags, off, mark)
                if e.is_write:
                    off += nsec * ssize
                    if off > size:
                        raise LogError("%s: data of entry %d beyond the end" % (path, i))
                self.entries.append(e)

    def crash_points(self):
        return [e.index for e in self.entries if e.is_crash_point]

    def marks(self):
        return [(e.index, e.mark) for e in self.entries if e.mark is not None]


class Replayer:
    """Applies a log's entries in order onto zeroed targets.  `targets` is a
    path, or a list of (first byte, length, path) segments when the logged
    device is stored as several files (e.g. a metadata and a data slice).
    apply_to(k) replays up to and including entry k; calls must ask for
    increasing k.  `changes` counts the writes and discards applied so far;
    `dirty` holds the index of every target segment written since the
    caller last removed it."""

    def __init__(self, log, targets):
        self.log = log
        self.next = 0
        self.src = open(log.path, "rb")
        if isinstance(targets, str):
            targets = [(0, 1 << 62, targets)]
        self.segs = [(start, length, os.open(path, os.O_WRONLY))
                     for start, length, path in targets]
        self.written = 0
        self.changes = 0
        self.dirty = set()

    def close(self):
        self.src.close()
        for _, _, fd in self.segs:
            os.close(fd)

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()

    def _put(self, pos, buf):
        """Write buf at byte pos of the logged device, split over segments."""
        while buf:
            for i, (start, length, fd) in enumerate(self.segs):
                if start <= pos < start + length:
                    self.dirty.add(i)
                    n = min(len(buf), start + length - pos)
                    os.pwrite(fd, buf[:n], pos - start)
                    pos += n
                    buf = buf[n:]
                    break
            else:
                raise LogError("write at byte %d is outside every replay target" % pos)

    def apply_to(self, k):
        if k < self.next - 1:
            raise LogError("replay cannot go back from %d to %d" % (self.next - 1, k))
        ss = self.log.sectorsize
        for e in self.log.entries[self.next:k + 1]:
            if e.flags & DISCARD or e.is_write:
                self.changes += 1
            if e.flags & DISCARD:
                # what a discarded range reads afterwards is undefined; zeros
                # are what a thin or SSD device most often returns
                pos, left = e.sector * ss, e.nr_sectors * ss
                while left:
                    n = min(left, 1 << 20)
                    self._put(pos, bytes(n))
                    pos += n
                    left -= n
            elif e.is_write:
                self.src.seek(e.data_off)
                left, pos = e.nr_sectors * ss, e.sector * ss
                while left:
                    buf = self.src.read(min(left, 1 << 20))
                    if not buf:
                        raise LogError("short data in entry %d" % e.index)
                    self._put(pos, buf)
                    pos += len(buf)
                    left -= len(buf)
                    self.written += len(buf)
        self.next = max(self.next, k + 1)
