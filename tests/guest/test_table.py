"""Table line parsing, `dmsetup table` output, status fields, metadata sizing,
superblock checks on reopen (Documentation/dm-dedup.rst: "Table line", "Status")."""

import os
import re

import pytest

import ddlib
from ddlib import BLOCK, MIB, DedupDev, run, try_create

L256 = 256 * MIB // 512          # 256 MiB logical, in sectors


# How a refused table line reaches the kernel log. The constructor of
# dm-dedup (dm-dedup-target.c, dedup_ctr) reports why it refuses through
# ti->error only; device-mapper prints it (drivers/md/dm-table.c,
# dm_table_add_target) as
#   device-mapper: table: <major:minor>: dedup: <ti->error> (<errno>)
# and says "Unknown error" there when the target never set ti->error.  A few
# refusals come after a line of the target's own (DM_MSG_PREFIX "dedup"),
# e.g. "device-mapper: dedup: 253:0: metadata device too small: 1 MiB, needs
# 3 MiB (704 blocks)".  Documentation/dm-dedup.rst, "Kernel log messages".
TABLE_REFUSAL = re.compile(
    r"device-mapper: table: (\d+:\d+): dedup: (.*) \((-E[A-Z0-9]+|-\d+)\)$")
TARGET_LINE = re.compile(r"device-mapper: dedup: (.*)$")
_MESSAGES = None


def target_messages():
    """Every string literal of the module's sources (dm-dedup/*.c, not the
    KUnit tests), adjacent literals joined: a message dm core prints for a
    refusal must be one of them, i.e. set by the target itself."""
    global _MESSAGES
    if _MESSAGES is None:
        src_dir = os.path.join(ddlib.REPO, "dm-dedup")
        files = [f for f in sorted(os.listdir(src_dir))
                 if f.endswith(".c") and not f.endswith("-test.c")] \
            if os.path.isdir(src_dir) else []
        assert files, "no dm-dedup sources under %s to read the messages from" % src_dir
        lit = r'"((?:[^"\\\n]|\\.)*)"'
        out = set()
        for f in files:
            with open(os.path.join(src_dir, f)) as fh:
                text = fh.read()
            for run_ in re.finditer(r"%s(?:\s*%s)*" % (lit, lit), text):
                parts = re.findall(lit, run_.group(0))
                out.update(parts)
                out.add("".join(parts))
        _MESSAGES = out
    return _MESSAGES


def refusal(lines):
    """(message, target's own lines) of ONE refused dedup table line in
    `lines` (kernel log lines logged during that `dmsetup create` only): dm core
    must report it exactly once, with a message the target set."""
    reported = [m for m in (TABLE_REFUSAL.search(l) for l in lines) if m]
    assert len(reported) == 1, \
        "expected one 'device-mapper: table: <dev>: dedup: <message> (-E...)' line, " \
        "found %d; log:\n%s" % (len(reported), "\n".join(lines[-12:]))
    msg = reported[0].group(2)
    assert msg != "Unknown error", \
        "the target refused without setting ti->error: %s" % reported[0].group(0)
    assert msg in target_messages(), \
        "refusal message %r is not one dm-dedup sets (dm-dedup/*.c)" % msg
    own = [m.group(1) for m in (TARGET_LINE.search(l) for l in lines) if m]
    return msg, own


def assert_create_fails(name, table, keywords=None):
    """`dmsetup create` must fail, leave no device behind and log one dm
    core line with the target's reason, whose text (not the prefix)
    contains one of `keywords` if given.  Returns (message, the target's
    own lines)."""
    with ddlib.Kmsg() as k:
        p = try_create(name, table)
        lines = k.lines()
    assert p.returncode != 0, "dmsetup create succeeded with table %r" % table
    assert not ddlib.dm_exists(name), "failed create left device %s behind" % name
    try:
        msg, own = refusal(lines)
    except AssertionError as e:
        raise AssertionError("table %r: %s" % (table, e))
    if keywords:
        assert any(k.lower() in msg.lower() for k in keywords), \
            "error message for %r names none of %s: %r" % (table, keywords, msg)
    return msg, own


@pytest.fixture
def devs(backing):
    """(meta, data) loop devices: 16 MiB and 64 MiB, zeroed."""
    return backing.loop(16, "meta"), backing.loop(64, "data")


# (id, table suffix after "0 <len> dedup", keywords); M/D stand for the
# devices. The keywords are matched against the message the target set (the
# text dm core prints after "dedup: "), so each names that message.
BAD_TABLES = [
    ("no-devices", "", ["Missing arguments"]),
    ("missing-data-dev", "M", ["Missing arguments"]),
    ("nonnumeric-optcount", "M D extra", ["Invalid number of optional arguments"]),
    ("optcount-too-big", "M D 2 verify", ["Invalid number of optional arguments"]),
    ("optcount-too-small", "M D 1 verify discard_passdown", ["Too many arguments"]),
    ("unknown-option", "M D 1 frobnicate", ["Unknown or incomplete optional argument"]),
    ("hash-without-value", "M D 1 hash", ["Unknown or incomplete optional argument"]),
    ("bad-meta-path", "/dev/does-not-exist D", ["Cannot open metadata device"]),
    ("bad-data-path", "M /dev/does-not-exist", ["Cannot open data device"]),
    ("commit-interval-nonnumeric", "M D 2 commit_interval abc", ["Invalid commit_interval"]),
    ("commit-interval-zero", "M D 2 commit_interval 0", ["Invalid commit_interval"]),
    ("commit-interval-too-big", "M D 2 commit_interval 3601", ["Invalid commit_interval"]),
    ("commit-interval-negative", "M D 2 commit_interval -5", ["Invalid commit_interval"]),
    ("commit-interval-missing", "M D 1 commit_interval",
     ["Unknown or incomplete optional argument"]),
    ("low-water-mark-nonnumeric", "M D 2 low_water_mark x12", ["Invalid low_water_mark"]),
    ("low-water-mark-negative", "M D 2 low_water_mark -1", ["Invalid low_water_mark"]),
    ("low-water-mark-overflow", "M D 2 low_water_mark 99999999999999999999999",
     ["Invalid low_water_mark"]),
    ("weak-hash-crc32c-no-verify", "M D 2 hash crc32c", ["not collision resistant"]),
    ("weak-hash-xxhash64-no-verify", "M D 2 hash xxhash64", ["not collision resistant"]),
    ("unknown-hash", "M D 3 hash nosuchhash256 verify", ["unknown hash algorithm"]),
]


@pytest.mark.parametrize("case,suffix,keywords", BAD_TABLES, ids=[c[0] for c in BAD_TABLES])
def test_bad_table_line(devs, case, suffix, keywords):
    meta, data = devs
    suffix = " ".join({"M": meta, "D": data}.get(w, w) for w in suffix.split())
    table = ("0 %d dedup %s" % (L256, suffix)).strip()
    assert_create_fails("ddtbad", table, keywords)


def test_same_table_with_valid_options_succeeds(devs):
    """Control for the table tests: every option with a valid value works."""
    meta, data = devs
    d = DedupDev.create("ddtok", meta, data, L256,
                        ["hash", "crc32c", "verify", "commit_interval", "3600",
                         "discard_passdown", "low_water_mark", "16"])
    st = d.status()
    assert st["hash"] == "crc32c" and st["verify"] == "verify"
    assert st["discard_passdown"] == "discard_passdown"


@pytest.mark.parametrize("length", [L256 - 1, L256 - 4, L256 + 7, 7])
def test_length_not_multiple_of_8_sectors(devs, length):
    meta, data = devs
    assert_create_fails("ddtlen", "0 %d dedup %s %s" % (length, meta, data),
                        ["multiples of 8 sectors"])


def test_metadata_device_too_small(backing):
    """1 MiB of metadata for 4 GiB logical + 1 GiB data: refused, and the
    target's own line before dm core's gives the size it has and needs."""
    meta = backing.loop(1, "meta")
    data = backing.loop(1024, "data")
    msg, own = assert_create_fails("ddtsmall",
                                   "0 %d dedup %s %s" % (4096 * MIB // 512, meta, data),
                                   ["metadata device too small"])
    assert msg == "metadata device too small", msg
    sizes = [re.search(r"metadata device too small: (\d+) MiB, needs (\d+) MiB "
                       r"\((\d+) blocks\)", l) for l in own]
    sizes = [m for m in sizes if m]
    assert len(sizes) == 1, "no 'metadata device too small: <have> MiB, needs <need> " \
        "MiB (<blocks> blocks)' line of the target: %s" % own
    have, need, blocks = (int(x) for x in sizes[0].groups())
    assert have == 1 and need > have and blocks * BLOCK > MIB, sizes[0].group(0)


def test_metadata_64m_covers_4g_logical_1g_data(backing):
    """Documentation/dm-dedup.rst: 64 MiB of metadata covers 4 GiB logical with 1 GiB data."""
    meta = backing.loop(64, "meta")
    data = backing.loop(1024, "data")
    d = DedupDev.create("ddtbig", meta, data, 4096 * MIB // 512)
    st = d.status()
    assert st["data_total"] == 1024 * MIB // BLOCK
    assert st["meta_total"] == 64 * MIB // BLOCK


def test_same_device_for_metadata_and_data_refused(backing):
    dev = backing.loop(64, "both")
    assert_create_fails("ddtsame", "0 %d dedup %s %s" % (L256, dev, dev),
                        ["Metadata and data devices must differ"])


# ---------------------------------------------------------------------------
# status
# ---------------------------------------------------------------------------
def test_status_fresh_device(backing):
    meta = backing.loop(16, "meta")
    data = backing.loop(64, "data")
    d = DedupDev.create("ddtst", meta, data, L256)
    st = d.status()
    assert st["start"] == 0 and st["length"] == L256
    assert st["mode"] == "rw"
    # "1 right after formatting" (Documentation/dm-dedup.rst, "dmsetup
    # status"): the format is the first commit, and with nothing written
    # the periodic commit has nothing to commit.
    assert st["transaction_id"] == 1, st["raw"]
    assert st["data_total"] == ddlib.device_bytes(data) // BLOCK == 64 * MIB // BLOCK
    assert st["meta_total"] == ddlib.device_bytes(meta) // BLOCK == 16 * MIB // BLOCK
    assert 0 < st["meta_used"] < st["meta_total"]
    assert st["data_used"] == 0
    for k in ("mapped", "unique_writes", "duplicate_writes", "zero_writes", "discarded"):
        assert st[k] == 0, (k, st)
    assert st["hash"] == "sha256"
    assert st["verify"] == "no_verify"
    assert st["discard_passdown"] == "no_discard_passdown"


def test_status_reflects_options(backing):
    meta = backing.loop(16, "meta")
    data = backing.loop(64, "data")
    d = DedupDev.create("ddtst", meta, data, L256,
                        ["discard_passdown", "verify", "hash", "crc32c"])
    st = d.status()
    assert (st["mode"], st["hash"], st["verify"], st["discard_passdown"]) == \
        ("rw", "crc32c", "verify", "discard_passdown")


def test_device_geometry(dedup):
    """Logical block size 4096; size = table length."""
    assert run(["blockdev", "--getss", dedup.path]).stdout.strip() == "4096"
    assert ddlib.device_bytes(dedup.path) == dedup.logical_sectors * 512


# ---------------------------------------------------------------------------
# dmsetup table
# ---------------------------------------------------------------------------
def majmin(dev):
    st = os.stat(dev)
    return "%d:%d" % (os.major(st.st_rdev), os.minor(st.st_rdev))


def test_table_defaults_print_no_options(backing):
    meta = backing.loop(16, "meta")
    data = backing.loop(64, "data")
    # explicit defaults are not printed back
    d = DedupDev.create("ddttab", meta, data, L256,
                        ["hash", "sha256", "commit_interval", "1"])
    assert d.table() == "0 %d dedup %s %s" % (L256, majmin(meta), majmin(data))


def test_table_options_canonical_order(backing):
    """Options come back in canonical order (assumed: the order of the
    interface document: hash, verify, commit_interval, discard_passdown,
    low_water_mark, read_only), whatever order they were given in."""
    meta = backing.loop(16, "meta")
    data = backing.loop(64, "data")
    d = DedupDev.create("ddttab", meta, data, L256,
                        ["low_water_mark", "10", "discard_passdown", "commit_interval", "5",
                         "verify", "hash", "crc32c"])
    assert d.table() == ("0 %d dedup %s %s 8 hash crc32c verify commit_interval 5 "
                         "discard_passdown low_water_mark 10" % (L256, majmin(meta), majmin(data)))


@pytest.mark.parametrize("opts", [
    [],
    ["hash", "crc32c", "verify", "commit_interval", "7", "discard_passdown",
     "low_water_mark", "32", "early_ack", "no_read_batching"],
], ids=["defaults", "all-options"])
def test_table_output_loads_back(backing, seed, opts):
    """The printed table line creates an identical device after removal."""
    meta = backing.loop(16, "meta")
    data = backing.loop(64, "data")
    d = DedupDev.create("ddttab", meta, data, L256, opts)
    exp = ddlib.write_ids(d.path, seed, [0, 1, 2, 0, None, 3])
    printed = d.table()
    st1 = ddlib.counters(d.status())
    d.remove()
    d2 = DedupDev("ddttab2", meta, data, L256).activate(table=printed)
    assert d2.table() == printed
    ddlib.verify_blocks(d2.path, exp, nblocks=16)
    assert ddlib.counters(d2.status()) == st1


# ---------------------------------------------------------------------------
# existing metadata must match the table
# ---------------------------------------------------------------------------
def test_reopen_with_smaller_logical_size_refused(backing):
    meta = backing.loop(16, "meta")
    data = backing.loop(64, "data")
    d = DedupDev.create("ddtre", meta, data, L256)
    ddlib.write_ids(d.path, 1, [1, 2])
    d.remove()
    assert_create_fails("ddtre", "0 %d dedup %s %s" % (L256 // 2, meta, data),
                        ["cannot shrink the logical size"])
    # the original table still works: nothing was overwritten
    d.activate()
    assert d.status()["mapped"] == 2


def test_reopen_with_smaller_data_device_refused(backing):
    meta = backing.loop(16, "meta")
    data = backing.loop(96, "data")
    d = DedupDev.create("ddtre", meta, data, L256)
    ddlib.write_ids(d.path, 1, [1, 2])
    d.remove()
    # shrink the data device's file and tell the loop driver
    f = [x for x in backing.files if "data" in os.path.basename(x)][0]
    os.truncate(f, 64 * MIB)
    run(["losetup", "-c", data])
    assert ddlib.device_bytes(data) == 64 * MIB
    assert_create_fails("ddtre", "0 %d dedup %s %s" % (L256, meta, data),
                        ["cannot shrink the data device"])
    # back to the size it was formatted with, so that the teardown's
    # `dedup check --data` can verify what was written
    os.truncate(f, 96 * MIB)
    run(["losetup", "-c", data])
    d.activate()
    assert d.status()["mapped"] == 2


def test_reopen_with_other_hash_refused(backing):
    meta = backing.loop(16, "meta")
    data = backing.loop(64, "data")
    d = DedupDev.create("ddtre", meta, data, L256)
    ddlib.write_ids(d.path, 1, [1, 2])
    d.remove()
    assert_create_fails("ddtre",
                        "0 %d dedup %s %s 3 hash crc32c verify" % (L256, meta, data),
                        ["hash algorithm differs from the metadata"])
