"""Online growth (Documentation/dm-dedup.rst, "Growing a device").

The three sizes of a dedup device grow the way dm-thin's pool does: the
device under it grows (lvextend, or a bigger loop file and `losetup -c`),
then `dmsetup reload` + `dmsetup resume`; the logical size grows with a
longer table. The new resume commits the grown sizes before any I/O.

Oracles: fio's own crc32c verification of everything it wrote while the
device grew under it; the status and stats fields; new data blocks really
used (more unique data stored than the old data device held); the same
content after remove and create; `dedup check --data` at teardown on the
grown metadata. Shrinking, and growing read-only or past the metadata
device's capacity, are refused with the documented reason while the device
keeps serving.
"""

import subprocess

import ddlib
from ddlib import BLOCK, MIB, BlockDev, block_data, run
from lvm import lvm

FIO_MIB = 24
FIO_SECONDS = 45


def _fio(path):
    """fio writing 4 KiB blocks at random over the first FIO_MIB MiB of
    @path for FIO_SECONDS, reading back and checking (crc32c header) what
    it wrote as it goes; any mismatch or I/O error ends it with an error."""
    return subprocess.Popen(
        ["fio", "--name=grow", "--filename=" + path, "--direct=1",
         "--ioengine=libaio", "--iodepth=8", "--rw=randwrite", "--bs=4k",
         "--size=%dm" % FIO_MIB, "--time_based", "--runtime=%d" % FIO_SECONDS,
         "--verify=crc32c", "--verify_backlog=256", "--verify_fatal=1",
         "--output-format=terse"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _reload(dev, table=None):
    """dmsetup reload that may be refused: the CompletedProcess and the
    kernel log lines it produced."""
    k = ddlib.Kmsg()
    p = run(["dmsetup", "reload", dev.name, "--table", table or dev.table_line()],
            check=False)
    lines = k.lines()
    k.close()
    return p, lines


def _grow(dev, table=None):
    """reload + resume; returns the kernel log lines of both."""
    k = ddlib.Kmsg()
    try:
        dev.reload(table)
        return k.lines()
    finally:
        k.close()


def test_grow_all_three_while_fio_verifies(make_dedup, backing, seed):
    """Data, metadata and logical size grown one after the other under a
    running fio with verification; then unique data beyond the old data
    capacity, written past the old logical end; then remove and create."""
    dev = make_dedup(meta_mib=16, data_mib=32, logical_mib=128, lvm=True,
                     vg_spare_mib=64)
    vg = dev.vg
    st0 = dev.stats()
    assert int(st0["data_blocks_total"]) == (32 * MIB) // BLOCK
    meta_total0 = int(st0["metadata_blocks_total"])

    fio = _fio(dev.path)
    try:
        assert vg.extend("data", 32) == 64 * MIB
        lines = _grow(dev)
        assert any("growing the data device from 8192 to 16384 blocks" in l
                   for l in lines), "\n".join(lines)
        assert int(dev.stats()["data_blocks_total"]) == 16384

        assert vg.extend("meta", 16) == 32 * MIB
        _grow(dev)
        assert int(dev.stats()["metadata_blocks_total"]) == meta_total0 + (16 * MIB) // BLOCK

        old_sectors = dev.logical_sectors
        dev.logical_sectors = 2 * old_sectors
        lines = _grow(dev)
        assert any("growing the logical size from 32768 to 65536 blocks" in l
                   for l in lines), "\n".join(lines)
        assert ddlib.device_bytes(dev.path) == dev.logical_sectors * 512
        st = dev.stats()
        assert int(st["logical_blocks"]) == 65536
        assert dev.status()["mode"] == "rw"
        assert fio.poll() is None, "fio ended before the growth did: not grown under I/O"
    finally:
        out, err = fio.communicate(timeout=900)
    assert fio.returncode == 0, "fio failed under growth:\n%s\n%s" % (out[-2000:], err[-2000:])
    with BlockDev(dev.path) as bd:
        fio_region = bd.read_range(0, FIO_MIB * MIB // BLOCK)

    # Unique data past the old logical end, more than the old data device
    # held in all (8192 blocks): only the grown space can take it.
    first = old_sectors // 8
    n = 9000
    with BlockDev(dev.path) as bd:
        for i in range(0, n, 64):
            bd.write_range(first + i, [block_data(seed, first + j)
                                       for j in range(i, min(n, i + 64))])
        bd.fsync()
    st = dev.stats()
    assert int(st["data_blocks_used"]) > 8192 + n // 2, st
    assert dev.status()["mode"] == "rw"

    dev.remove()
    dev.activate()
    st = dev.stats()
    assert int(st["data_blocks_total"]) == 16384
    assert int(st["logical_blocks"]) == 65536
    ddlib.verify_blocks(dev.path, {first + j: block_data(seed, first + j) for j in range(n)})
    with BlockDev(dev.path) as bd:
        assert bd.read_range(0, FIO_MIB * MIB // BLOCK) == fio_region


def test_grow_data_on_a_loop_file(make_dedup, backing, seed):
    """Without LVM: a bigger file under the loop device, `losetup -c`, then
    reload and resume. The new blocks take new data."""
    dev = make_dedup(meta_mib=8, data_mib=4, logical_mib=64)
    data_file = backing.files[backing.loops.index(dev.data)]
    with BlockDev(dev.path) as bd:
        bd.write_range(0, [block_data(seed, i) for i in range(1024)])
        bd.fsync()
    with open(data_file, "r+b") as f:
        f.truncate(12 * MIB)
    run(["losetup", "-c", dev.data])
    assert ddlib.device_bytes(dev.data) == 12 * MIB
    _grow(dev)
    assert int(dev.stats()["data_blocks_total"]) == 3072
    with BlockDev(dev.path) as bd:
        bd.write_range(1024, [block_data(seed, i) for i in range(1024, 3072)])
        bd.fsync()
    assert int(dev.stats()["data_blocks_used"]) == 3072
    ddlib.verify_blocks(dev.path, {i: block_data(seed, i) for i in range(3072)})


def test_shrink_and_impossible_growth_refused(make_dedup, backing, seed):
    """Each refusal names its reason in one kernel line, the table in use
    stays, and the device keeps serving reads and writes."""
    dev = make_dedup(meta_mib=16, data_mib=64, logical_mib=256, lvm=True, vg_spare_mib=16)
    vg = dev.vg
    with BlockDev(dev.path) as bd:
        bd.write_range(0, [block_data(seed, i) for i in range(256)])
        bd.fsync()

    def refused(table, reason):
        p, lines = _reload(dev, table)
        assert p.returncode != 0, "taken: %s" % table
        assert any(reason in l for l in lines), "\n".join(lines)
        assert dev.status()["mode"] == "rw"

    # a shorter table would drop mapped logical blocks
    refused(ddlib.table_line(dev.meta, dev.data, dev.logical_sectors // 2, dev.opts),
            "cannot shrink the logical size (field logical_blocks)")
    # read_only never writes, so it cannot commit a new size
    refused(ddlib.table_line(dev.meta, dev.data, dev.logical_sectors * 2, ["read_only"]),
            "cannot grow a read-only device")
    # the metadata device must hold the grown trees: 16 MiB cannot map 64 GiB
    refused(ddlib.table_line(dev.meta, dev.data, 64 * 1024 * MIB // 512, dev.opts),
            "metadata device too small")
    # a data volume shrunk under the device
    lvm("lvreduce", "-q", "-f", "-L", "-8m", "%s/data" % vg.name, devices=vg.pv)
    refused(None, "cannot shrink the data device (field data_blocks)")
    vg.extend("data", 8)

    with BlockDev(dev.path) as bd:
        bd.write_range(256, [block_data(seed, i) for i in range(256, 512)])
        bd.fsync()
    dev.remove()
    dev.activate()
    ddlib.verify_blocks(dev.path, {i: block_data(seed, i) for i in range(512)})
    assert int(dev.stats()["logical_blocks"]) == dev.nblocks
