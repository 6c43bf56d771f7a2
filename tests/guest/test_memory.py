"""RAM the target takes per data block, from the kernel's own accounting.

/proc/vmallocinfo names the allocating function of every vmalloc area; the
fingerprint index and the allocator bitmaps are all vmalloc'd for a data
device of these sizes. Measured as the difference before and after
creating the device, so nothing else in the kernel is counted.

Issue 16's budget: at most 4 bytes per data block for the index, at most
4.5 with everything the target keeps per data block (the index and the
allocator's bitmaps).
"""

import re

import pytest

import ddlib
from ddlib import DedupDev

LOGICAL_MIB = 4096
INDEX_MAX = 4.0
TOTAL_MAX = 4.5


def dedup_vmalloc():
    """Bytes of vmalloc areas allocated by dm_dedup, by caller."""
    areas = {}
    with open("/proc/vmallocinfo") as f:
        for line in f:
            if "[dm_dedup]" not in line:
                continue
            parts = line.split()
            size = int(parts[1])
            caller = re.sub(r"\+.*", "", parts[2])
            # vmallocinfo counts the guard page of each area
            areas[caller] = areas.get(caller, 0) + size - 4096
    return areas


# 16384, 524288 and 2097152 data blocks; the metadata device holds the
# fingerprint records of every one (32 bytes each).
@pytest.mark.parametrize("data_mib", [64, 2048, 8192])
def test_index_ram_per_data_block(backing, record_property, data_mib):
    before = sum(dedup_vmalloc().values())
    meta = backing.loop(48 + data_mib // 64, "meta")
    data = backing.loop(data_mib, "data")
    dd = DedupDev.create("ddtmem", meta, data, LOGICAL_MIB * ddlib.MIB // 512)
    areas = dedup_vmalloc()
    total = sum(areas.values()) - before
    blocks = dd.status()["data_total"]
    assert blocks == data_mib * ddlib.MIB // 4096
    index = areas.get("dd_index_init", 0)
    record_property("vmalloc_by_caller", areas)
    record_property("index_bytes_per_data_block", round(index / blocks, 3))
    record_property("vmalloc_bytes_per_data_block", round(total / blocks, 3))
    assert index > 0, "index allocation not found in /proc/vmallocinfo"
    assert index / blocks <= INDEX_MAX
    assert total / blocks <= TOTAL_MAX
    # the target's own figure agrees with the kernel's accounting
    stats = dd.stats()
    ib = int(stats["index_bytes"])
    # vmalloc rounds an area up to whole pages (and may align it further)
    assert ib <= index <= max(ib * 1.01, -(-ib // 4096) * 4096), (ib, index)
    # Everything kept per data block: the index and the allocator's
    # bitmaps (kvcalloc'd: small ones come from kmalloc, which
    # vmallocinfo does not show, so this is the target's own count).
    ram = ib + int(stats["data_space_bytes"])
    record_property("target_ram_bytes_per_data_block", round(ram / blocks, 3))
    assert int(stats["ram_bytes_per_data_block_x100"]) == ram * 100 // blocks
    assert int(stats["data_space_bytes"]) >= 2 * blocks // 8
    assert ram / blocks <= TOTAL_MAX
    dd.remove()
    assert sum(dedup_vmalloc().values()) == before, "vmalloc areas leaked"
