#!/usr/bin/python3
"""Guest side of `make bench`: every stack and every workload in one boot.

Runs INSIDE the QEMU guest started by scripts/bench.sh.  Five virtio disks
are attached, found by serial: `data` (the backing device every stack uses),
`meta` (the metadata device of dm-thin and dm-dedup; dm-vdo keeps its
metadata on `data`), `pool` (an ext4 disk of VM images, read-only), and
`datasync` and `metasync`, a second data and metadata pair that QEMU
attaches with cache=none: a flush there reaches the host's disk, where on
the others (cache=unsafe) it stops at the host's page cache.  The
workloads fsync_sync and pool_sync repeat fsync and pool on that pair.

Stacks, each created fresh on discarded disks for every workload:
  raw    dm-linear over `data`
  thin   thin-pool (64 KiB chunks, zeroing on: LVM's defaults) + thin volume
  vdo    vdoformat + dm-vdo table, compression off, other settings default
  dedup  dm-dedup with its defaults, or the options of BENCH_DEDUP_OPTS
thin, vdo and dedup get the same logical size (twice the data disk).

Every fio run writes a region no earlier run of that stack touched, with
its own random seed, so runs never duplicate one another.  The first run of
each workload is a warm-up and is not counted.  The sequential and random
write series split their runs over BENCH_ROUNDS rounds (2), each on a fresh
device with its own warm-up, the stacks taking turns within a round.

Writes results to $BENCH_OUT/results.json (rewritten after each workload,
so a failed run keeps what it measured) and a log to stdout.
"""

import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "guest"))
import ddlib  # noqa: E402

BLOCK = 4096
MIB = 1 << 20
OUT = os.environ.get("BENCH_OUT", "/tmp/bench-out")
REPS = int(os.environ.get("BENCH_REPS", "3"))
QUICK = os.environ.get("BENCH_QUICK", "0") == "1"
# Rounds the write series' runs are split over (see write_series).
ROUNDS = max(1, int(os.environ.get("BENCH_ROUNDS", "1" if QUICK else "2")))
STACKS = os.environ.get("BENCH_STACKS", "raw thin vdo dedup").split()
# Table options of the "dedup" stack (the "before" stack runs without).
DEDUP_OPTS = os.environ.get("BENCH_DEDUP_OPTS", "").split()
WORKLOADS = os.environ.get("BENCH_WORKLOADS",
                           "seqwrite randwrite randread fsync pool").split()
DEDUP_BIN = os.environ.get("DEDUP_BIN") or os.path.join(
    ddlib.REPO, "tools", "target", "release", "dedup")

# Sizes per run.  Under TCG a 4 KiB random write costs ~0.4 ms on the raw
# device, so these keep the whole run near 45 minutes.
SEQ_BYTES = (32 if QUICK else 256) * MIB
RAND_BYTES = (8 if QUICK else 64) * MIB
READ_FILL = (32 if QUICK else 256) * MIB
TIMED_SECS = 3 if QUICK else 10
ACT_BLOCKS = (64 if QUICK else 1024) * 1024   # unique blocks held at activation
THIN_CHUNK_SECTORS = 128            # 64 KiB, LVM's default chunk size
VDO_CACHE_BLOCKS = 32768            # dm-vdo's default block map cache (128 MiB)
VDO_ERA = 16380                     # dm-vdo's default block map era length

# QEMU's cache mode of each data+metadata pair, as scripts/bench.sh attaches
# them (the guest cannot see it).
DISK_CACHE = {"data+meta": "unsafe", "datasync+metasync": "none"}

RESULTS = {"version": 1, "config": {}, "machine": {}, "runs": [],
           "checks": [], "pool": [], "memory": []}


def log(msg):
    print("bench: " + msg, flush=True)


def sh(cmd, check=True, timeout=3600):
    return ddlib.run(cmd, check=check, timeout=timeout)


def save():
    os.makedirs(OUT, exist_ok=True)
    tmp = os.path.join(OUT, "results.json.tmp")
    with open(tmp, "w") as f:
        json.dump(RESULTS, f, indent=1, sort_keys=True)
    os.rename(tmp, os.path.join(OUT, "results.json"))


def disk(serial):
    for b in sorted(os.listdir("/sys/block")):
        try:
            with open("/sys/block/%s/serial" % b) as f:
                if f.read().strip() == serial:
                    return "/dev/" + b
        except OSError:
            pass
    return None


def sectors(dev):
    return ddlib.device_bytes(dev) // 512


def key_values(text, sep=None):
    """"key<sep>value" lines as a dict of stripped strings (sep None:
    whitespace); lines without a separator are skipped."""
    out = {}
    for line in text.splitlines():
        parts = line.split(sep, 1)
        if len(parts) == 2:
            out[parts[0].strip()] = parts[1].strip()
    return out


def meminfo():
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":")
            out[k] = int(v.split()[0])
    return out


def kernel_memory():
    """KiB the kernel holds that no cache drop can free (with caches dropped)."""
    sh(["sync"])
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
    time.sleep(1)
    m = meminfo()
    used = m["MemTotal"] - m["MemFree"] - m["Buffers"] - m["Cached"]
    # The total also moves with user space and page tables (a few MiB of
    # noise: see the raw and thin rows); the kernel's own counters do not
    # see large kmallocs and dm-bufio's pages.  Both are kept.
    counted = m["SUnreclaim"] + m["VmallocUsed"] + m.get("Percpu", 0)
    return {"used_kib": used, "kernel_counted_kib": counted, "slab_kib": m["Slab"],
            "sunreclaim_kib": m["SUnreclaim"], "vmalloc_kib": m["VmallocUsed"],
            "percpu_kib": m.get("Percpu", 0)}


# --- stacks -------------------------------------------------------------------

class Stack:
    name = "?"
    # The workloads the stack takes part in (None: all).
    workloads = None

    def __init__(self, data, meta):
        self.data, self.meta = data, meta
        self.data_sectors = sectors(data)
        self.logical_sectors = 2 * self.data_sectors
        self.dev = None

    def data_blocks(self):
        return self.data_sectors // 8

    def physical_blocks(self):
        """4 KiB blocks the stack stores for data, or None (raw)."""
        return None

    def extra(self):
        return {}

    def remove(self):
        for n in self.dm_names():
            if ddlib.dm_exists(n):
                ddlib.dm_remove(n)
        self.dev = None

    def dm_names(self):
        return []


class Raw(Stack):
    name = "raw"

    def create(self):
        self.logical_sectors = self.data_sectors
        sh(["dmsetup", "create", "bench-raw", "--table",
            "0 %d linear %s 0" % (self.data_sectors, self.data)])
        self.dev = "/dev/mapper/bench-raw"

    def dm_names(self):
        return ["bench-raw"]


class Thin(Stack):
    name = "thin"

    def create(self):
        sh(["dmsetup", "create", "bench-pool", "--table",
            "0 %d thin-pool %s %s %d 0" % (self.data_sectors, self.meta, self.data,
                                            THIN_CHUNK_SECTORS)])
        sh(["dmsetup", "message", "bench-pool", "0", "create_thin 0"])
        sh(["dmsetup", "create", "bench-thin", "--table",
            "0 %d thin /dev/mapper/bench-pool 0" % self.logical_sectors])
        self.dev = "/dev/mapper/bench-thin"

    def pool_status(self):
        # <transaction> <meta used>/<total> <data used>/<total> ...
        f = sh(["dmsetup", "status", "bench-pool"]).stdout.split()
        mu, mt = f[4].split("/")
        du, dt = f[5].split("/")
        return int(mu), int(mt), int(du), int(dt)

    def physical_blocks(self):
        return self.pool_status()[2] * THIN_CHUNK_SECTORS // 8

    def extra(self):
        mu, mt, du, dt = self.pool_status()
        return {"metadata_blocks_used": mu, "chunks_used": du}

    def dm_names(self):
        return ["bench-thin", "bench-pool"]


class Vdo(Stack):
    name = "vdo"

    def create(self):
        sh(["vdoformat", "--force", "--logical-size=%dK" % (self.logical_sectors // 2),
            self.data])
        self.activate()

    def activate(self):
        sh(["dmsetup", "create", "bench-vdo", "--table",
            "0 %d vdo V4 %s %d 4096 %d %d compression off" % (
                self.logical_sectors, self.data, self.data_sectors // 8,
                VDO_CACHE_BLOCKS, VDO_ERA)])
        self.dev = "/dev/mapper/bench-vdo"

    def stats(self):
        return key_values(sh(["vdostats", "--verbose", self.dev]).stdout, ":")

    def physical_blocks(self):
        return int(self.stats()["data blocks used"])

    def extra(self):
        s = self.stats()
        keys = ("data blocks used", "overhead blocks used", "logical blocks used",
                "dedupe advice valid", "dedupe advice stale", "dedupe advice timeouts",
                "saving percent")
        return {k.replace(" ", "_"): s.get(k) for k in keys if k in s}

    def dm_names(self):
        return ["bench-vdo"]


class Dedup(Stack):
    name = "dedup"
    opts = DEDUP_OPTS

    def create(self):
        self.activate()

    def activate(self):
        opts = " %d %s" % (len(self.opts), " ".join(self.opts)) if self.opts else ""
        sh(["dmsetup", "create", "bench-dedup", "--table",
            "0 %d dedup %s %s%s" % (self.logical_sectors, self.meta, self.data, opts)])
        self.dev = "/dev/mapper/bench-dedup"

    def stats(self):
        kv = key_values(sh(["dmsetup", "message", "bench-dedup", "0", "stats"]).stdout)
        return {k: int(v) if v.lstrip("-").isdigit() else v for k, v in kv.items()}

    def physical_blocks(self):
        return self.stats()["data_blocks_live"]

    def extra(self):
        s = self.stats()
        keys = ("data_blocks_live", "mapped_blocks", "unique_writes", "duplicate_writes",
                "zero_writes", "index_bytes", "index_entries", "index_full",
                "index_candidates", "index_false_candidates",
                "metadata_blocks_used", "transaction_id", "deferred_reads")
        return {k: s[k] for k in keys if k in s}

    def dm_names(self):
        return ["bench-dedup"]


class DedupBefore(Dedup):
    """dm-dedup built from an earlier commit (BENCH_BEFORE_KO), for before
    and after figures from one boot: its module is swapped in for this
    stack and the tree's module back afterwards (both register "dedup")."""
    name = "before"
    opts = []

    def create(self):
        ddlib.unload_dedup_module()
        ddlib.load_dedup_module(os.environ["BENCH_BEFORE_KO"])
        super().create()

    def remove(self):
        try:
            super().remove()
        finally:
            ddlib.unload_dedup_module()
            ddlib.load_dedup_module()


class DedupAck(Dedup):
    """The tree's dm-dedup with early_ack: writes acknowledged once their
    blocks are decided, as dm-vdo acknowledges them."""
    name = "ack"
    opts = ["early_ack"]


class DedupFast(Dedup):
    """The tree's dm-dedup with a fast hash and verify: candidates are found
    by xxhash64 and compared byte for byte before they are shared, as dm-vdo
    finds them by MurmurHash3 and compares them. Write workloads only."""
    name = "fast"
    opts = ["hash", "xxhash64", "verify"]
    workloads = ("seqwrite", "randwrite", "pool")


class DedupFastAck(DedupFast):
    """The fast stack with early_ack as well: dm-vdo's whole way of working,
    which also acknowledges every write that is not FUA once it has a
    physical block (the same guarantee: durable at the next flush)."""
    name = "fastack"
    opts = ["hash", "xxhash64", "verify", "early_ack"]


STACK_CLASSES = {"raw": Raw, "thin": Thin, "vdo": Vdo, "dedup": Dedup, "before": DedupBefore,
                 "ack": DedupAck, "fast": DedupFast, "fastack": DedupFastAck}


def discard_disks(data, meta):
    """Discard both disks: the host files get holes, every stack starts empty."""
    sh(["blkdiscard", data])
    sh(["blkdiscard", meta])


def fresh(stack_cls, data, meta):
    discard_disks(data, meta)
    s = stack_cls(data, meta)
    s.create()
    ddlib.udev_settle()
    return s


# --- fio ----------------------------------------------------------------------

def fio(dev, **opts):
    args = ["fio", "--name=bench", "--filename=" + dev, "--direct=1",
            "--ioengine=libaio", "--output-format=json", "--group_reporting"]
    args += ["--%s=%s" % (k, v) for k, v in opts.items()]
    return fio_result(sh(args, timeout=1800).stdout)


def fio_result(out):
    """The figures of fio's JSON output, for the side (read or write) that
    did the I/O."""
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = "write" if job["write"]["io_bytes"] > job["read"]["io_bytes"] else "read"
    j = job[side]
    lat = j.get("clat_ns", {}).get("percentile", {})
    return {"iops": j["iops"], "bw_bytes": j["bw_bytes"], "io_bytes": j["io_bytes"],
            "runtime_ms": j["runtime"], "clat_p50_us": lat.get("50.000000", 0) / 1000,
            "clat_p99_us": lat.get("99.000000", 0) / 1000}


def data_opts(dup_percent, seed):
    # refill_buffers + scramble_buffers=0: every buffer is fresh random data
    # unless fio makes it a duplicate on purpose (tests/README.md, "Pitfalls").
    o = {"refill_buffers": 1, "scramble_buffers": 0, "randseed": seed}
    if dup_percent:
        o["dedupe_percentage"] = dup_percent
    return o


def disk_io(dev):
    """Bytes written, bytes discarded, flush requests and write requests
    of a whole disk since boot (/sys/block/<disk>/stat: what reached the
    disk, after the block layer merged or split the stack's bios)."""
    with open("/sys/block/%s/stat" % os.path.basename(os.path.realpath(dev))) as f:
        v = [int(x) for x in f.read().split()]
    return {"written": v[6] * 512, "discarded": v[13] * 512, "flushes": v[15],
            "writes": v[4]}


def io_snapshot(data, meta):
    return {"data": disk_io(data), "meta": disk_io(meta)}


def flush(dev):
    """One flush of the stack: each commits what it holds (thin and dedup
    their metadata, vdo its journal), so amplification counts it."""
    fd = os.open(dev, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def record_amplification(workload, param, stack, user_bytes, before, after):
    """Bytes each disk received per byte the workload wrote."""
    row = {"workload": workload, "param": param, "stack": stack, "user_bytes": user_bytes}
    for d in ("data", "meta"):
        for k in ("written", "discarded", "flushes", "writes"):
            row["%s_%s" % (d, k)] = after[d][k] - before[d][k]
        row["%s_per_user_byte" % d] = round(row["%s_written" % d] / user_bytes, 4)
    RESULTS.setdefault("write_amp", []).append(row)
    log("amplification %-9s %-8s %-6s data %.3f meta %.3f bytes per byte written "
        "(flushes: data %d, meta %d)" % (workload, param, stack, row["data_per_user_byte"],
                                         row["meta_per_user_byte"], row["data_flushes"],
                                         row["meta_flushes"]))


def record(workload, param, stack, metric, unit, runs, better="higher", extra=None):
    vals = [r[metric] for r in runs[1:]]            # runs[0] is the warm-up
    entry = {"workload": workload, "param": param, "stack": stack, "metric": metric,
             "unit": unit, "better": better, "values": vals,
             "median": statistics.median(vals), "min": min(vals), "max": max(vals),
             "warmup": runs[0][metric], "runs": runs, "extra": extra or {}}
    RESULTS["runs"].append(entry)
    log("%-9s %-8s %-6s %s median %.1f %s (min %.1f, max %.1f; warm-up %.1f)" % (
        workload, param, stack, metric, entry["median"], unit, entry["min"], entry["max"],
        entry["warmup"]))


def estimate_region(dev, offset, length):
    """`dedup estimate` over [offset, offset+length) of dev: the real dup ratio."""
    name = "bench-slice"
    sh(["dmsetup", "create", name, "--table",
        "0 %d linear %s %d" % (length // 512, dev, offset // 512)])
    try:
        p = sh([DEDUP_BIN, "estimate", "--json", "--block-sizes", "4096",
                "/dev/mapper/" + name])
    finally:
        ddlib.dm_remove(name)
    b = json.loads(p.stdout)["block_sizes"][0]
    total = b["total_blocks"]
    stored = b["stored_bytes"] // BLOCK
    return {"blocks": total, "zero_blocks": b["zero_blocks"], "stored_blocks": stored,
            "duplicate_percent": round(100.0 * (total - stored) / total, 2)}


def check_dups(workload, param, stack, before, after, est):
    """What the stack itself saw: share of written blocks it did not store."""
    c = {"workload": workload, "param": param, "stack": stack.name}
    if est is not None:
        c["estimate"] = est
    if isinstance(stack, Dedup):
        u = after["unique_writes"] - before["unique_writes"]
        d = (after["duplicate_writes"] - before["duplicate_writes"] +
             after["zero_writes"] - before["zero_writes"])
        c["dedup_duplicate_percent"] = round(100.0 * d / max(1, u + d), 2)
    if isinstance(stack, Vdo):
        lu = int(after["logical_blocks_used"]) - int(before.get("logical_blocks_used", 0))
        du = int(after["data_blocks_used"]) - int(before.get("data_blocks_used", 0))
        c["vdo_duplicate_percent"] = round(100.0 * (lu - du) / max(1, lu), 2)
    RESULTS["checks"].append(c)
    log("duplicates %-9s %-8s %-6s %s" % (workload, param, stack.name,
                                          {k: v for k, v in c.items()
                                           if k.endswith("percent") or k == "estimate"}))


# --- workloads ----------------------------------------------------------------

def write_series(stacks, data, meta, workload, params, fio_base, size, metric, unit):
    """Each stack's measured runs, split over ROUNDS rounds of a fresh device
    and a warm-up each; within a round the stacks take turns, in reverse order
    on odd rounds.  A slow stretch of the host then costs one run of several
    stacks, not a whole row: with one round, a stack's runs went back to
    back, and one such stretch moved a published ratio by a third."""
    per_round = -(-REPS // ROUNDS)
    for dup in params:
        param = "%d%%" % dup
        warm, runs, names, after = {}, {}, {}, {}
        for rnd in range(ROUNDS):
            for cls in stacks if rnd % 2 == 0 else stacks[::-1]:
                s = fresh(cls, data, meta)
                try:
                    before = s.extra()
                    io0 = io_snapshot(data, meta)
                    for i in range(per_round + 1):
                        seed = 1000 + 100 * dup + rnd * (per_round + 1) + i
                        o = dict(fio_base, size=size, offset=i * size,
                                 **data_opts(dup, seed))
                        r = fio(s.dev, **o)
                        (runs if i else warm).setdefault(cls, []).append(r)
                    sh(["sync"])
                    flush(s.dev)
                    names[cls], after[cls] = s.name, s.extra()
                    if rnd:
                        continue
                    # Amplification and duplicates: the first round's device.
                    record_amplification(workload, param, s.name, (per_round + 1) * size,
                                         io0, io_snapshot(data, meta))
                    est = None
                    if cls is Raw:
                        est = estimate_region(s.dev, 0, (per_round + 1) * size)
                    if cls in (Raw, Dedup, Vdo):
                        check_dups(workload, param, s, before, after[cls], est)
                finally:
                    s.remove()
        for cls in stacks:
            record(workload, param, names[cls], metric, unit, warm[cls][:1] + runs[cls],
                   extra=dict(after[cls], warmups=[w[metric] for w in warm[cls]]))
        save()


def w_seqwrite(stacks, data, meta):
    write_series(stacks, data, meta, "seqwrite", (0, 50, 100),
                 {"rw": "write", "bs": "1M", "iodepth": 4}, SEQ_BYTES, "bw_bytes", "B/s")


def w_randwrite(stacks, data, meta):
    write_series(stacks, data, meta, "randwrite", (0, 50, 90),
                 {"rw": "randwrite", "bs": "4k", "iodepth": 32}, RAND_BYTES, "iops", "IOPS")


def w_randread(stacks, data, meta):
    for cls in stacks:
        s = fresh(cls, data, meta)
        try:
            fio(s.dev, rw="write", bs="1M", iodepth=4, size=READ_FILL,
                **data_opts(0, 77))
            runs = [fio(s.dev, rw="randread", bs="4k", iodepth=32, size=READ_FILL,
                        time_based=1, runtime=TIMED_SECS, randseed=500 + i)
                    for i in range(REPS + 1)]
            record("randread", "after fill", s.name, "iops", "IOPS", runs, extra=s.extra())
        finally:
            s.remove()
    save()


def w_fsync(stacks, data, meta, workload="fsync"):
    # Size-bound, so that a fast machine never wraps around its own region.
    region = (1 if QUICK else 4) * MIB
    for cls in stacks:
        s = fresh(cls, data, meta)
        try:
            io0 = io_snapshot(data, meta)
            runs = [fio(s.dev, rw="write", bs="4k", iodepth=1, fsync=1, size=region,
                        offset=i * region, **data_opts(0, 900 + i))
                    for i in range(REPS + 1)]
            record_amplification(workload, "4k+fsync", s.name, (REPS + 1) * region, io0,
                                 io_snapshot(data, meta))
            record(workload, "4k+fsync", s.name, "iops", "IOPS", runs, extra=s.extra())
        finally:
            s.remove()
    save()


DISCARD_BYTES = (64 if QUICK else 1024) * MIB
DISCARD_READ_REGION = 64 * MIB


def timed_discard_with_reader(dev, offset, length):
    """Discard [offset, offset+length) of dev and time it, while fio keeps
    4 KiB random reads (iodepth 4) going on the region after the discarded
    ones; the reader is stopped when the discard returns. Returns the
    discard's seconds and the reader's IOPS and p99 latency meanwhile."""
    import signal
    import subprocess
    read_off = 2 * DISCARD_BYTES
    args = ["fio", "--name=reader", "--filename=" + dev, "--direct=1",
            "--ioengine=libaio", "--output-format=json", "--rw=randread", "--bs=4k",
            "--iodepth=4", "--offset=%d" % read_off, "--size=%d" % DISCARD_READ_REGION,
            "--time_based=1", "--runtime=3600", "--randseed=31"]
    reader = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(2)                       # the reader is up and running
        t0 = time.monotonic()
        sh(["blkdiscard", "-o", str(offset), "-l", str(length), dev], timeout=3600)
        secs = time.monotonic() - t0
    finally:
        reader.send_signal(signal.SIGINT)
        out, _ = reader.communicate(timeout=120)
    r = fio_result(out)
    return {"secs": secs, "read_iops": r["iops"], "read_p99_us": r["clat_p99_us"]}


def w_discard(stacks, data, meta):
    """A 1 GiB discard of mapped, deduplicated data (fio's 50 % duplicates),
    for dm-vdo and dm-dedup: the first of two regions is the warm-up, the
    second is measured. A reader runs meanwhile on a third region."""
    for cls in stacks:
        if cls not in (Vdo, Dedup):
            continue
        s = fresh(cls, data, meta)
        try:
            fio(s.dev, rw="write", bs="1M", iodepth=4,
                size=2 * DISCARD_BYTES + DISCARD_READ_REGION, **data_opts(50, 4242))
            sh(["sync"])
            runs = [timed_discard_with_reader(s.dev, i * DISCARD_BYTES, DISCARD_BYTES)
                    for i in range(2)]
            entry = dict(runs[1], stack=s.name, bytes=DISCARD_BYTES, warmup=runs[0],
                         extra=s.extra())
            RESULTS.setdefault("discard", []).append(entry)
            log("discard  %d MiB %-6s %.1f s, reads meanwhile %.0f IOPS (p99 %.0f us); "
                "warm-up %.1f s" % (DISCARD_BYTES >> 20, s.name, entry["secs"],
                                    entry["read_iops"], entry["read_p99_us"],
                                    runs[0]["secs"]))
        finally:
            s.remove()
    save()


def timed_activate(s):
    """Time the stack's activation (dmsetup create returns once the table
    is live); for dm-dedup also how its index came up."""
    t = time.monotonic()
    s.activate()
    run = {"secs": time.monotonic() - t}
    if isinstance(s, Dedup):
        st = s.stats()
        run.update(index_loaded=st["index_loaded"], kernel_ms=st["activation_ms"])
    return run


def clean_activation(s):
    """Remove the stack cleanly, then time its activation."""
    t = time.monotonic()
    s.remove()
    removed = time.monotonic() - t
    return dict(timed_activate(s), remove_secs=removed)


def crashed_activation(s, linear, disk_path):
    """The stack removed while the disk under @linear (its metadata: the
    metadata disk of dm-dedup, the one disk of dm-vdo) fails every write:
    no final commit, save or clean mark reaches it, as after a crash. Then
    time the activation on the healthy disk: dm-dedup rebuilds from the
    trees, dm-vdo recovers from its journal."""
    n = sectors(disk_path)
    with open("/dev/kmsg", "w") as k:
        k.write("bench: crash of %s\n" % s.name)
    ddlib.dm_swap_table(linear, "0 %d flakey %s 0 0 1 1 error_writes" % (n, disk_path))
    try:
        s.remove()
    finally:
        ddlib.dm_swap_table(linear, "0 %d linear %s 0" % (n, disk_path))
    run = timed_activate(s)
    # What the activation said about the crash (dm-vdo: its recovery).
    log_lines = sh(["dmesg"]).stdout.splitlines()
    mark = max(i for i, l in enumerate(log_lines) if "bench: crash of" in l)
    run["kmsg"] = [l for l in log_lines[mark + 1:]
                   if s.name in l.lower() and ("recover" in l.lower() or "clean" in l.lower() or
                                               "rebuilt" in l or "replay" in l)][-4:]
    return run


def w_activation(stacks, data, meta):
    """Activation of a device holding ACT_BLOCKS unique blocks, for dm-vdo
    and dm-dedup: after a clean shutdown, and after a crash (dm-dedup's
    index rebuilt from the fingerprint records, dm-vdo's recovery)."""
    for cls in stacks:
        if cls not in (Vdo, Dedup):
            continue
        discard_disks(data, meta)
        under = meta if cls is Dedup else data
        linear, _ = ddlib.dm_linear("bench-under", under)
        s = cls(data, linear) if cls is Dedup else cls(linear, meta)
        s.create()
        try:
            fio(s.dev, rw="write", bs="1M", iodepth=4, size=ACT_BLOCKS * BLOCK,
                **data_opts(0, 5151))
            flush(s.dev)
            extra = s.extra()
            runs = [clean_activation(s) for _ in range(REPS + 1)]
            record("activation", "clean", s.name, "secs", "s", runs, better="lower",
                   extra=extra)
            if cls is Dedup:
                assert all(r["index_loaded"] == 1 for r in runs), runs
            try:
                runs = [crashed_activation(s, "bench-under", under)
                        for _ in range(REPS + 1)]
            except Exception as e:      # noqa: BLE001
                if cls is Dedup:
                    raise
                # dm-vdo's own behaviour under failing writes: leave it out
                log("activation after a crash: %s failed: %s" % (s.name, e))
                if not os.path.exists(s.dev):
                    try:
                        s.activate()
                    except Exception:   # noqa: BLE001
                        pass
                continue
            if cls is Dedup:
                assert not any(r["index_loaded"] for r in runs), runs
            record("activation", "crash", s.name, "secs", "s", runs, better="lower",
                   extra=extra)
        finally:
            if os.path.exists(s.dev):
                s.remove()
            ddlib.dm_remove("bench-under")
    save()


def w_pool(stacks, data, meta, key="pool", memory=True):
    """The VM images copied onto ext4 on each stack; the rows go to
    RESULTS[key] (key is also the workload name of their amplification),
    and with memory, the kernel memory each stack held to RESULTS["memory"]."""
    pooldev = disk("pool")
    if pooldev is None:
        raise SystemExit("bench: no disk with serial 'pool' (scripts/bench.sh attaches it)")
    src = "/tmp/bench-pool"
    os.makedirs(src, exist_ok=True)
    sh(["mount", "-o", "ro", pooldev, src])
    try:
        images = sorted(os.path.join(src, "images", f)
                        for f in os.listdir(os.path.join(src, "images")))
        if QUICK:
            images = images[:2]
        apparent = sum(os.path.getsize(f) for f in images)
        log("pool: %d images, %.0f MiB apparent" % (len(images), apparent / MIB))
        if "pool_estimate" not in RESULTS:       # the same images for pool and pool_sync
            pool_estimate(images, apparent)
        mnt = "/tmp/bench-fs"
        os.makedirs(mnt, exist_ok=True)
        for cls in stacks:
            discard_disks(data, meta)
            k0 = kernel_memory() if memory else None
            s = cls(data, meta)
            s.create()
            try:
                # No discard at mkfs (the disks were just discarded) and no
                # background inode-table zeroing during the copy.
                sh(["mkfs.ext4", "-q", "-F", "-E",
                    "nodiscard,lazy_itable_init=1,lazy_journal_init=1", s.dev])
                sh(["mount", "-o", "noinit_itable", s.dev, mnt])
                sh(["sync"])
                phys0 = s.physical_blocks()
                df0 = os.statvfs(mnt)
                for f in images:                     # the source in page cache
                    sh(["dd", "if=" + f, "of=/dev/null", "bs=1M", "status=none"],
                       timeout=1800)
                io0 = io_snapshot(data, meta)
                t0 = time.monotonic()
                sh(["cp", "--sparse=auto"] + images + [mnt + "/"], timeout=7200)
                sh(["sync"])
                secs = time.monotonic() - t0
                flush(s.dev)
                record_amplification(key, "cp", s.name, apparent, io0,
                                     io_snapshot(data, meta))
                df1 = os.statvfs(mnt)
                fs_blocks = (df0.f_bfree - df1.f_bfree) * df1.f_frsize // BLOCK
                phys1 = s.physical_blocks()
                sh(["umount", mnt])
                k1 = kernel_memory() if memory else None
                stored = fs_blocks if phys1 is None else phys1 - phys0
                row = {"stack": s.name, "ingest_secs": round(secs, 2),
                       "ingest_bytes_per_sec": apparent / secs,
                       "fs_blocks_used": fs_blocks, "stored_blocks": stored,
                       "savings_percent": round(100.0 * (1 - stored * BLOCK / apparent), 2),
                       "extra": s.extra()}
                RESULTS.setdefault(key, []).append(row)
                log("%s %-6s ingest %.1f s, stored %d blocks (%.2f %% saved)" % (
                    key, s.name, secs, stored, row["savings_percent"]))
                if memory:
                    record_memory(s, k0, k1, stored)
            finally:
                if os.path.ismount(mnt):
                    sh(["umount", mnt])
                s.remove()
            save()
    finally:
        sh(["umount", src])


def pool_estimate(images, apparent):
    """`dedup estimate` over the images: the exact 4 KiB answer."""
    p = sh([DEDUP_BIN, "estimate", "--json", "--block-sizes", "4096"] + images)
    b = json.loads(p.stdout)["block_sizes"][0]
    est = {"images": [os.path.basename(f) for f in images], "apparent_bytes": apparent,
           "blocks": b["total_blocks"], "zero_blocks": b["zero_blocks"],
           "stored_blocks": b["stored_bytes"] // BLOCK,
           "savings_percent": b["savings_percent"]}
    RESULTS["pool_estimate"] = est
    log("pool estimate: %s" % est)


def record_memory(s, k0, k1, stored):
    """Kernel memory the stack held after the pool copy (k1, caches dropped)
    against before it was created (k0)."""
    mem = {"stack": s.name, "before": k0, "after": k1,
           "delta_kib": k1["used_kib"] - k0["used_kib"],
           "counted_delta_kib": k1["kernel_counted_kib"] - k0["kernel_counted_kib"],
           "data_blocks": s.data_blocks(), "stored_blocks": stored}
    mem["bytes_per_data_block"] = round(mem["delta_kib"] * 1024 / s.data_blocks(), 2)
    mem["bytes_per_stored_block"] = round(mem["delta_kib"] * 1024 / max(1, stored), 2)
    RESULTS["memory"].append(mem)
    log("pool %-6s kernel memory +%d KiB = %.2f B per data block" % (
        s.name, mem["delta_kib"], mem["bytes_per_data_block"]))


def sync_disks():
    """The data and metadata disks attached with cache=none."""
    data, meta = disk("datasync"), disk("metasync")
    if not data or not meta:
        raise SystemExit("bench: no disks with serials 'datasync' and 'metasync' "
                         "(scripts/bench.sh attaches them with cache=none)")
    return data, meta


def w_fsync_sync(stacks, data, meta):
    """w_fsync on the disks that honour flushes."""
    w_fsync(stacks, *sync_disks(), workload="fsync_sync")


def w_pool_sync(stacks, data, meta):
    """w_pool on the disks that honour flushes, without the memory figures."""
    w_pool(stacks, *sync_disks(), key="pool_sync", memory=False)


WORKLOAD_FUNCS = {"seqwrite": w_seqwrite, "randwrite": w_randwrite,
                  "randread": w_randread, "fsync": w_fsync, "fsync_sync": w_fsync_sync,
                  "discard": w_discard, "pool": w_pool, "pool_sync": w_pool_sync,
                  "activation": w_activation}


def cpu_reference():
    """What the (emulated) CPU can do per second: SHA-256 of 4 KiB blocks
    and memory copies, so that a reader can tell CPU-bound ratios from I/O."""
    import hashlib
    buf = os.urandom(1 << 20)
    n, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < 2:
        for i in range(0, len(buf), BLOCK):
            hashlib.sha256(buf[i:i + BLOCK]).digest()
        n += len(buf)
    sha = n / (time.monotonic() - t0)
    n, t0 = 0, time.monotonic()
    dst = bytearray(len(buf))
    while time.monotonic() - t0 < 2:
        dst[:] = buf
        n += len(buf)
    return {"sha256_4k_bytes_per_sec": round(sha), "memcpy_bytes_per_sec": round(
        n / (time.monotonic() - t0)),
        "kernel_sha256_4k_all_cpus_bytes_per_sec": round(kernel_hash_limit())}


def _alg_hash_worker(secs, out):
    """SHA-256 of 4 KiB blocks through the kernel's crypto API (AF_ALG) for
    secs seconds; puts the bytes hashed on out."""
    import socket
    buf = os.urandom(BLOCK)
    with socket.socket(socket.AF_ALG, socket.SOCK_SEQPACKET, 0) as alg:
        alg.bind(("hash", "sha256"))
        op, _ = alg.accept()
        with op:
            n, t0 = 0, time.monotonic()
            while time.monotonic() - t0 < secs:
                for _ in range(64):
                    op.sendall(buf)
                    op.recv(32)
                n += 64 * BLOCK
    out.put(n)


def kernel_hash_limit(secs=3):
    """The most any stack that hashes every block with SHA-256 can write
    here: the kernel's own SHA-256 of 4 KiB blocks (the driver the target
    gets), on every vCPU at once, in bytes per second. Measured in the same
    boot as the workloads."""
    import multiprocessing
    import socket
    ddlib.modprobe("algif_hash", check=False)
    try:
        socket.socket(socket.AF_ALG, socket.SOCK_SEQPACKET, 0).close()
    except OSError as e:
        log("no kernel hashing limit: AF_ALG: %s" % e)
        return 0
    q = multiprocessing.Queue()
    procs = [multiprocessing.Process(target=_alg_hash_worker, args=(secs, q))
             for _ in range(os.cpu_count() or 1)]
    for p in procs:
        p.start()
    total = sum(q.get() for _ in procs)
    for p in procs:
        p.join()
    return total / secs


def versions():
    def out(cmd):
        p = ddlib.run(cmd, check=False)
        return (p.stdout or p.stderr).strip().splitlines()[0] if (p.stdout or p.stderr) else ""
    m = meminfo()
    with open("/proc/cmdline") as f:
        cmdline = f.read().strip()
    return {"guest_kernel": platform.release(), "guest_cpus": os.cpu_count(),
            "guest_cmdline": cmdline,
            "guest_mem_kib": m["MemTotal"], "fio": out(["fio", "--version"]),
            "vdo_tools": out(["vdoformat", "--version"]),
            "dm_targets": sh(["dmsetup", "targets"]).stdout.split("\n"),
            "sha256_driver": crypto_driver("sha256")}


def crypto_driver(alg):
    """The implementation the kernel picks for alg: the highest priority."""
    best, entry = (-1, ""), {}
    with open("/proc/crypto") as f:
        for line in list(f) + [""]:
            if not line.strip():
                if entry.get("name") == alg and int(entry.get("priority", 0)) > best[0]:
                    best = (int(entry["priority"]), entry.get("driver", ""))
                entry = {}
                continue
            k, _, v = line.partition(":")
            entry[k.strip()] = v.strip()
    return best[1]


def main():
    for w in WORKLOADS:
        if w not in WORKLOAD_FUNCS:
            raise SystemExit("bench: unknown workload %r (%s)" % (w, " ".join(WORKLOAD_FUNCS)))
    data, meta = disk("data"), disk("meta")
    if not data or not meta:
        raise SystemExit("bench: disks with serials 'data' and 'meta' are needed")
    ddlib.load_dedup_module()
    for m in ("dm-thin-pool", "dm-vdo"):
        ddlib.modprobe(m)
    RESULTS["machine"] = versions()
    RESULTS["machine"].update(cpu_reference())
    log("guest CPU: %s" % {k: v for k, v in RESULTS["machine"].items() if "per_sec" in k})
    RESULTS["config"] = {"reps": REPS, "rounds": ROUNDS, "quick": QUICK, "stacks": STACKS,
                         "before_commit": os.environ.get("BENCH_BEFORE", ""),
                         "dedup_opts": DEDUP_OPTS,
                         "workloads": WORKLOADS, "seq_bytes": SEQ_BYTES,
                         "rand_bytes": RAND_BYTES, "read_fill_bytes": READ_FILL,
                         "timed_secs": TIMED_SECS, "activation_blocks": ACT_BLOCKS,
                         "data_bytes": sectors(data) * 512,
                         "meta_bytes": sectors(meta) * 512,
                         "disk_cache": {"data+meta": DISK_CACHE["data+meta"]},
                         "thin_chunk_bytes": THIN_CHUNK_SECTORS * 512,
                         "vdo_block_map_cache_bytes": VDO_CACHE_BLOCKS * BLOCK}
    sync_data, sync_meta = disk("datasync"), disk("metasync")
    if sync_data and sync_meta:
        RESULTS["config"].update(sync_data_bytes=sectors(sync_data) * 512,
                                 sync_meta_bytes=sectors(sync_meta) * 512)
        RESULTS["config"]["disk_cache"]["datasync+metasync"] = DISK_CACHE["datasync+metasync"]
    stacks = [STACK_CLASSES[n] for n in STACKS]
    t0 = time.monotonic()
    for w in WORKLOADS:
        t = time.monotonic()
        log("=== %s ===" % w)
        WORKLOAD_FUNCS[w]([c for c in stacks if c.workloads is None or w in c.workloads],
                          data, meta)
        RESULTS.setdefault("workload_secs", {})[w] = round(time.monotonic() - t, 1)
        save()
    RESULTS["total_secs"] = round(time.monotonic() - t0, 1)
    save()
    log("done in %.0f s: %s" % (RESULTS["total_secs"], os.path.join(OUT, "results.json")))


if __name__ == "__main__":
    main()
