"""Table line parsing, `dmsetup table` output, status fields, metadata sizing,
superblock checks on reopen (Documentation/dm-dedup.rst: "Table line", "Status")."""

import os
import re

import pytest

import ddlib
from ddlib import BLOCK, MIB, DedupDev, run, try_create

L256 = 256 * MIB // 512          # 256 MiB logical, in sectors


def dedup_error_lines(kmsg):
    """Kernel log lines that carry a dedup error description, e.g.
    'device-mapper: table: 254:0: dedup: Invalid argument count (-EINVAL)'
    or 'device-mapper: dedup: commit_interval out of range'."""
    out = []
    for l in kmsg.lines():
        m = re.search(r"dedup[^:]*:\s*(.*)$", l, re.I)
        if m and len(re.sub(r"\(-?E[A-Z]+\)|[^A-Za-z]", "", m.group(1))) >= 5:
            out.append(l)
    return out


def assert_create_fails(kmsg, name, table, keywords=None):
    """`dmsetup create` must fail, leave no device behind and log a dedup
    line with an error description (containing one of `keywords`, if any)."""
    p = try_create(name, table)
    assert p.returncode != 0, "dmsetup create succeeded with table %r" % table
    assert not ddlib.dm_exists(name), "failed create left device %s behind" % name
    lines = dedup_error_lines(kmsg)
    assert lines, "no dedup error description in the kernel log for %r; log:\n%s" % (
        table, "\n".join(kmsg.lines()[-10:]))
    if keywords:
        text = "\n".join(lines).lower()
        assert any(k.lower() in text for k in keywords), \
            "error message for %r names none of %s:\n%s" % (table, keywords, "\n".join(lines))
    return lines


@pytest.fixture
def devs(backing):
    """(meta, data) loop devices: 16 MiB and 64 MiB, zeroed."""
    return backing.loop(16, "meta"), backing.loop(64, "data")


# (id, table suffix after "0 <len> dedup", keywords); M/D stand for the devices
BAD_TABLES = [
    ("no-devices", "", None),
    ("missing-data-dev", "M", None),
    ("nonnumeric-optcount", "M D extra", None),
    ("optcount-too-big", "M D 2 verify", None),
    ("optcount-too-small", "M D 1 verify discard_passdown", None),
    ("unknown-option", "M D 1 frobnicate", ["frobnicate", "unknown", "option", "argument"]),
    ("hash-without-value", "M D 1 hash", ["hash", "argument"]),
    ("bad-meta-path", "/dev/does-not-exist D", ["meta", "device"]),
    ("bad-data-path", "M /dev/does-not-exist", ["data", "device"]),
    ("commit-interval-nonnumeric", "M D 2 commit_interval abc", ["commit_interval"]),
    ("commit-interval-zero", "M D 2 commit_interval 0", ["commit_interval"]),
    ("commit-interval-too-big", "M D 2 commit_interval 3601", ["commit_interval"]),
    ("commit-interval-negative", "M D 2 commit_interval -5", ["commit_interval"]),
    ("commit-interval-missing", "M D 1 commit_interval", ["commit_interval", "argument"]),
    ("low-water-mark-nonnumeric", "M D 2 low_water_mark x12", ["low_water_mark"]),
    ("low-water-mark-negative", "M D 2 low_water_mark -1", ["low_water_mark"]),
    ("low-water-mark-overflow", "M D 2 low_water_mark 99999999999999999999999",
     ["low_water_mark"]),
    ("weak-hash-crc32c-no-verify", "M D 2 hash crc32c", ["verify"]),
    ("weak-hash-xxhash64-no-verify", "M D 2 hash xxhash64", ["verify"]),
    ("unknown-hash", "M D 3 hash nosuchhash256 verify", ["nosuchhash256", "hash"]),
]


@pytest.mark.parametrize("case,suffix,keywords", BAD_TABLES, ids=[c[0] for c in BAD_TABLES])
def test_bad_table_line(devs, kmsg_check, case, suffix, keywords):
    meta, data = devs
    suffix = " ".join({"M": meta, "D": data}.get(w, w) for w in suffix.split())
    table = ("0 %d dedup %s" % (L256, suffix)).strip()
    assert_create_fails(kmsg_check, "ddtbad", table, keywords)


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
def test_length_not_multiple_of_8_sectors(devs, kmsg_check, length):
    meta, data = devs
    assert_create_fails(kmsg_check, "ddtlen", "0 %d dedup %s %s" % (length, meta, data),
                        ["length", "multiple", "size", "align", "4096", "block"])


def test_metadata_device_too_small(backing, kmsg_check):
    """1 MiB of metadata for 4 GiB logical + 1 GiB data: refused, the message
    talks about the metadata (and should give the needed size)."""
    meta = backing.loop(1, "meta")
    data = backing.loop(1024, "data")
    lines = assert_create_fails(kmsg_check, "ddtsmall",
                                "0 %d dedup %s %s" % (4096 * MIB // 512, meta, data),
                                ["meta"])
    assert any(re.search(r"\d", l.split("dedup", 1)[-1]) for l in lines), \
        "the message should state the needed size: %s" % lines


def test_metadata_64m_covers_4g_logical_1g_data(backing):
    """Documentation/dm-dedup.rst: 64 MiB of metadata covers 4 GiB logical with 1 GiB data."""
    meta = backing.loop(64, "meta")
    data = backing.loop(1024, "data")
    d = DedupDev.create("ddtbig", meta, data, 4096 * MIB // 512)
    st = d.status()
    assert st["data_total"] == 1024 * MIB // BLOCK
    assert st["meta_total"] == 64 * MIB // BLOCK


def test_same_device_for_metadata_and_data_refused(backing, kmsg_check):
    dev = backing.loop(64, "both")
    assert_create_fails(kmsg_check, "ddtsame", "0 %d dedup %s %s" % (L256, dev, dev))


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
    assert st["transaction_id"] >= 0
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
def test_reopen_with_smaller_logical_size_refused(backing, kmsg_check):
    meta = backing.loop(16, "meta")
    data = backing.loop(64, "data")
    d = DedupDev.create("ddtre", meta, data, L256)
    ddlib.write_ids(d.path, 1, [1, 2])
    d.remove()
    assert_create_fails(kmsg_check, "ddtre", "0 %d dedup %s %s" % (L256 // 2, meta, data),
                        ["cannot shrink the logical size"])
    # the original table still works: nothing was overwritten
    d.activate()
    assert d.status()["mapped"] == 2


def test_reopen_with_smaller_data_device_refused(backing, kmsg_check):
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
    assert_create_fails(kmsg_check, "ddtre", "0 %d dedup %s %s" % (L256, meta, data),
                        ["cannot shrink the data device"])
    # back to the size it was formatted with, so that the teardown's
    # `dedup check --data` can verify what was written
    os.truncate(f, 96 * MIB)
    run(["losetup", "-c", data])
    d.activate()
    assert d.status()["mapped"] == 2


def test_reopen_with_other_hash_refused(backing, kmsg_check):
    meta = backing.loop(16, "meta")
    data = backing.loop(64, "data")
    d = DedupDev.create("ddtre", meta, data, L256)
    ddlib.write_ids(d.path, 1, [1, 2])
    d.remove()
    assert_create_fails(kmsg_check, "ddtre",
                        "0 %d dedup %s %s 3 hash crc32c verify" % (L256, meta, data),
                        ["hash"])
