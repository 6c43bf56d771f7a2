"""RAM the target takes per data block, from the kernel's own accounting.

/proc/vmallocinfo names the allocating function of every vmalloc area; the
fingerprint index and the allocator bitmaps are all vmalloc'd for a data
device of this size. Measured as the difference before and after creating
the device, so nothing else in the kernel is counted.
"""

import re

import ddlib
from ddlib import DedupDev

DATA_MIB = 2048              # 524288 data blocks
LOGICAL_MIB = 4096
META_MIB = 64


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


def test_index_ram_per_data_block(backing, record_property):
    before = sum(dedup_vmalloc().values())
    meta = backing.loop(META_MIB, "meta")
    data = backing.loop(DATA_MIB, "data")
    dd = DedupDev.create("ddtmem", meta, data, LOGICAL_MIB * ddlib.MIB // 512)
    areas = dedup_vmalloc()
    total = sum(areas.values()) - before
    blocks = dd.status()["data_total"]
    assert blocks == DATA_MIB * ddlib.MIB // 4096
    index = areas.get("dd_index_init", 0)
    record_property("vmalloc_by_caller", areas)
    record_property("index_bytes_per_data_block", round(index / blocks, 3))
    record_property("vmalloc_bytes_per_data_block", round(total / blocks, 3))
    assert index > 0, "index allocation not found in /proc/vmallocinfo"
    assert index / blocks <= 12.0
    assert total / blocks <= 12.0
    # the target's own figure agrees with the kernel's accounting
    stats = dd.stats()
    # vmalloc rounds an area up to whole pages (and may align it further)
    assert int(stats["index_bytes"]) <= index <= int(stats["index_bytes"]) * 1.01
    dd.remove()
    assert sum(dedup_vmalloc().values()) == before, "vmalloc areas leaked"
