"""The userspace tools against the kernel, byte-compatible both ways.

- `dedup format` writes metadata the kernel opens as its own.
- kernel writes -> `dedup dump` -> `dedup restore` onto a fresh device ->
  the kernel opens it with identical content and counters.
- `dedup estimate` predicts exactly the space the target then uses.
"""

import json

import ddlib
from ddlib import BLOCK, BlockDev, DedupDev, block_data, run, write_ids

META_MIB, DATA_MIB, LOGICAL_MIB = 16, 64, 128
LOGICAL_SECTORS = LOGICAL_MIB * ddlib.MIB // 512


def dedup_tool(*args, check=True):
    return run([ddlib.DEDUP_BIN] + [str(a) for a in args], check=check)


def layout(n_distinct=40, copies=3):
    """ids with duplicates and zero blocks interleaved"""
    ids = []
    for c in range(copies):
        ids += list(range(n_distinct))
        ids += [None] * 5
    return ids


def test_tool_format_is_opened_by_kernel(backing, seed):
    meta = backing.loop(META_MIB, "meta")
    data = backing.loop(DATA_MIB, "data")
    dedup_tool("format", meta, "--data-dev", data, "--logical-blocks",
               LOGICAL_SECTORS // 8)
    k = ddlib.Kmsg()
    dd = DedupDev.create("ddttool", meta, data, LOGICAL_SECTORS)
    assert not any("formatted metadata" in l for l in k.lines()), \
        "the kernel formatted again instead of opening the tool's metadata"
    k.close()
    st = dd.status()
    # The tool wrote generation 1; a read-write load writes it again as 2.
    assert st["mode"] == "rw" and st["transaction_id"] == 2 and st["mapped"] == 0
    exp = write_ids(dd.path, seed, layout())
    ddlib.verify_blocks(dd.path, exp)
    dd.remove()
    assert dedup_tool("check", meta).returncode == 0


def test_format_version_1_is_upgraded_at_the_first_read_write_activation(backing, seed):
    """Metadata of format version 1 (before the journal) opens read-only as
    it is, and the first read-write activation gives it a journal: its
    superblock turns version 2, and a flush appends (Documentation/
    dm-dedup.rst, "The journal")."""
    meta = backing.loop(META_MIB, "meta")
    data = backing.loop(DATA_MIB, "data")
    dedup_tool("format", meta, "--data-dev", data, "--logical-blocks",
               LOGICAL_SECTORS // 8, "--format-version", "1")
    version = lambda: json.loads(dedup_tool("check", "--json", meta).stdout)["superblock"]["version"]
    assert version() == 1
    dd = DedupDev.create("ddttool", meta, data, LOGICAL_SECTORS, ["read_only"])
    st = dd.status()
    assert (st["mode"], st["journal_used"], st["journal_total"]) == ("ro", 0, 0), st["raw"]
    dd.remove()
    assert version() == 1, "a read-only activation wrote the superblock"
    with ddlib.Kmsg() as k:
        # no periodic commit: it would empty the journal before it is read
        dd = DedupDev.create("ddttool", meta, data, LOGICAL_SECTORS,
                             ["commit_interval", "3600"])
        lines = k.lines()
    assert any("metadata format 2: journal of" in l for l in lines), lines
    st = dd.status()
    assert st["mode"] == "rw" and st["journal_total"] >= 64, st["raw"]
    exp = write_ids(dd.path, seed, layout())
    with BlockDev(dd.path) as bd:
        bd.fsync()
    assert dd.status()["journal_used"] > 0, "the flush did not append"
    ddlib.verify_blocks(dd.path, exp)
    dd.remove()
    assert version() == 2
    assert dedup_tool("check", meta).returncode == 0


def test_dump_restore_round_trip(backing, seed, tmp_path):
    meta = backing.loop(META_MIB, "meta")
    data = backing.loop(DATA_MIB, "data")
    dd = DedupDev.create("ddttool", meta, data, LOGICAL_SECTORS)
    exp = write_ids(dd.path, seed, layout())
    ddlib.discard(dd.path, 3, 4)                     # some frees too
    for lba in range(3, 7):
        exp[lba] = ddlib.ZERO
    dd.commit()
    before = dd.status()
    dd.remove()

    dump = tmp_path / "meta.json"
    dedup_tool("dump", meta, "-o", dump)
    doc = json.loads(dump.read_text())
    assert doc, "empty dump"
    meta2 = backing.loop(META_MIB, "meta-restored")
    dedup_tool("restore", dump, meta2)
    assert dedup_tool("check", meta2).returncode == 0

    dd2 = DedupDev.create("ddttool2", meta2, data, LOGICAL_SECTORS)
    after = dd2.status()
    for k in ("mapped", "unique_writes", "duplicate_writes", "zero_writes",
              "discarded", "data_used"):
        assert after[k] == before[k], (k, before[k], after[k])
    ddlib.verify_blocks(dd2.path, exp)
    # the restored metadata keeps working: new data, dedup against old data
    with BlockDev(dd2.path) as bd:
        bd.write(500, block_data(seed, 7))           # duplicate of an old block
        bd.write(501, block_data(seed, 9999))        # new content
        bd.fsync()
        assert bd.read(500) == block_data(seed, 7)
    st = dd2.status()
    assert st["duplicate_writes"] == before["duplicate_writes"] + 1
    assert st["unique_writes"] == before["unique_writes"] + 1


def test_estimate_matches_target(backing, seed, tmp_path):
    """What `estimate` predicts at 4 KiB is what the target stores."""
    ids = layout(60, 4)
    img = tmp_path / "image.raw"
    with open(img, "wb") as f:
        for bid in ids:
            f.write(block_data(seed, bid))
    est = json.loads(dedup_tool("estimate", "--json", img).stdout)
    meta = backing.loop(META_MIB, "meta")
    data = backing.loop(DATA_MIB, "data")
    dd = DedupDev.create("ddtest", meta, data, LOGICAL_SECTORS)
    run(["dd", "if=%s" % img, "of=%s" % dd.path, "bs=1M", "oflag=direct",
         "status=none"])
    st = dd.status()
    at4k = [b for b in est["block_sizes"] if b["block_size"] == BLOCK][0]
    assert at4k["total_blocks"] == len(ids)
    assert st["data_used"] == at4k["unique_blocks"] == 60
    assert st["zero_writes"] == at4k["zero_blocks"] == 20
    assert st["duplicate_writes"] == at4k["duplicate_blocks"] == 180
    assert est["target"]["data_blocks"] == st["data_used"]


def test_stats_of_live_device(make_dedup, seed):
    """`dedup stats` reads a live device: its figures are the target's."""
    dd = make_dedup(META_MIB, DATA_MIB, LOGICAL_MIB)
    write_ids(dd.path, seed, [1, 2, 1, 1, None, 3])
    st = dd.status()
    js = json.loads(dedup_tool("stats", dd.name, "--json").stdout)
    assert js["name"] == dd.name and js["mode"] == "rw"
    assert js["mapped_blocks"] == st["mapped"] == 5
    assert js["data_blocks_live"] == 3
    assert js["unique_writes"] == 3 and js["duplicate_writes"] == 2
    assert js["zero_writes"] == 1
    assert abs(js["dedup_ratio"] - 5 / 3) < 1e-6
    assert abs(js["space_savings_percent"] - 40.0) < 1e-6
    human = dedup_tool("stats", dd.name).stdout
    assert dd.name in human and "rw" in human
    p = dedup_tool("stats", "ddt-no-such-device", check=False)
    assert p.returncode != 0 and p.stderr.strip()
