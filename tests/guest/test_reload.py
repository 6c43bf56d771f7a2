"""Table reloads and device ownership.

`dmsetup reload` builds the new table while the old one still serves I/O:
whatever is written between the reload and the resume must survive the
swap. A second dedup device over metadata or data already in use is refused.
"""

import ddlib
from ddlib import BlockDev, block_data, run
from test_table import assert_create_fails

META_MIB, DATA_MIB, LOGICAL_MIB = 16, 64, 128


def test_writes_between_reload_and_resume_survive(make_dedup, seed):
    dd = make_dedup(META_MIB, DATA_MIB, LOGICAL_MIB, lvm=True)
    with BlockDev(dd.path) as bd:
        for lba in range(16):
            bd.write(lba, block_data(seed, lba))
        bd.fsync()
    table = dd.table()
    run(["dmsetup", "reload", dd.name, "--table", table])
    assert "inactive" in run(["dmsetup", "status", "--inactive", dd.name]).stdout
    with BlockDev(dd.path) as bd:
        for lba in range(16, 48):
            bd.write(lba, block_data(seed, lba))
        bd.fsync()
    dd.resume()
    st = dd.status()
    assert st["mapped"] == 48 and st["unique_writes"] == 48, st["raw"]
    with BlockDev(dd.path) as bd:
        for lba in range(48):
            assert bd.read(lba) == block_data(seed, lba), "lba %d" % lba
        for lba in range(48, 80):           # new writes must not reuse blocks
            bd.write(lba, block_data(seed, lba))
        bd.fsync()
        for lba in range(80):
            assert bd.read(lba) == block_data(seed, lba), "lba %d" % lba
    dd.remove()
    dd.activate(table)
    with BlockDev(dd.path) as bd:
        for lba in range(80):
            assert bd.read(lba) == block_data(seed, lba), "after re-create, lba %d" % lba


def test_second_device_on_same_metadata_refused(make_dedup, backing):
    dd = make_dedup(META_MIB, DATA_MIB, LOGICAL_MIB)
    other_data = backing.loop(DATA_MIB, "data2")
    for meta, data in ((dd.meta, other_data), (backing.loop(META_MIB, "meta2"), dd.data)):
        table = ddlib.table_line(meta, data, LOGICAL_MIB * ddlib.MIB // 512)
        # the reason is looked for only among the lines this create logged
        assert_create_fails("ddtsecond", table,
                            ["Device already in use by another dedup target"])
    assert dd.status()["mode"] == "rw"
