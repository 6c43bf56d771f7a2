"""Data device full (ENOSPC for new content, dups and zeros still succeed) and
the low_water_mark event."""

import errno
import multiprocessing
import time

import pytest

import ddlib
from ddlib import BlockDev, ZERO, block_data, verify_blocks


def fill_unique(d, seed, first_id, start_lba, limit):
    """Write unique blocks until a write fails.  Returns (expected map,
    number written, the OSError that stopped it or None)."""
    exp = {}
    err = None
    with BlockDev(d.path) as bd:
        for i in range(limit):
            data = block_data(seed, first_id + i)
            try:
                bd.write(start_lba + i, data)
            except OSError as e:
                err = e
                break
            exp[start_lba + i] = data
    return exp, len(exp), err


# With early_ack, a write is acknowledged before its decision only once a
# data block is promised to each of its blocks: a write that would need a
# block the device does not have still gets ENOSPC itself, never a later
# flush.
EARLY_ACK = pytest.mark.parametrize("opts", [(), ("early_ack",)], ids=["default", "early_ack"])


@EARLY_ACK
def test_data_device_full(make_dedup, seed, opts):
    # 2 MiB data = 512 blocks; 8 MiB logical = 2048 blocks
    d = make_dedup(meta_mib=8, data_mib=2, logical_mib=8, opts=opts)
    total = d.status()["data_total"]
    assert total == 512
    exp, n, err = fill_unique(d, seed, 0, 0, total + 16)
    assert err is not None, "no error after %d unique blocks on a %d-block data device" % (
        n, total)
    assert err.errno == errno.ENOSPC, "expected ENOSPC, got %r" % err
    assert n == total, "only %d of %d data blocks could be used" % (n, total)
    if opts:
        assert int(d.stats()["early_acks_undecided"]) >= total - 16, d.stats()
    st = d.status()
    assert st["data_used"] == total, st
    assert st["mapped"] == total, st
    assert st["mode"] == "rw", st

    with BlockDev(d.path) as bd:
        # the failed LBA was not mapped
        assert bd.read(n) == ZERO
        # another new content still fails
        try:
            bd.write(n + 1, block_data(seed, 10**6))
            raise AssertionError("second unique write succeeded on a full device")
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
        # duplicates and zeros still succeed
        bd.write(1000, block_data(seed, 0))
        exp[1000] = block_data(seed, 0)
        bd.write(1001, block_data(seed, 5))
        exp[1001] = block_data(seed, 5)
        bd.write(1002, ZERO)
        # overwrite a duplicate with another duplicate: fine too (and frees
        # nothing: id 0 is still at LBA 0)
        bd.write(1000, block_data(seed, 9))
        exp[1000] = block_data(seed, 9)
    st = d.status()
    assert st["data_used"] == total, st
    assert st["duplicate_writes"] == 3, st
    assert st["zero_writes"] == 1, st
    verify_blocks(d.path, exp, nblocks=d.nblocks)

    # free 10 blocks (LBAs 20..29 hold unshared contents), commit, write again
    ddlib.discard(d.path, 20, 10)
    for lba in range(20, 30):
        del exp[lba]
    d.commit()
    assert d.status()["data_used"] == total - 10
    more, m, err = fill_unique(d, seed, 5000, 1500, 20)
    exp.update(more)
    assert m == 10, "after freeing 10 blocks, %d unique writes succeeded (%r)" % (m, err)
    assert err is not None and err.errno == errno.ENOSPC, err
    verify_blocks(d.path, exp, nblocks=d.nblocks)


def test_low_water_mark_event(make_dedup, seed):
    d = make_dedup(meta_mib=8, data_mib=2, logical_mib=8,
                   opts=["low_water_mark", "16"])
    total = d.status()["data_total"]
    ev0 = d.events()
    # free = total - n; stay above the mark
    exp, n, err = fill_unique(d, seed, 0, 0, total - 17)
    assert err is None and d.status()["data_used"] == total - 17
    assert d.events() == ev0, "event raised while free blocks (17) > low_water_mark (16)"
    more, m, err = fill_unique(d, seed, 10000, n, 1)       # free = 16
    assert err is None
    exp.update(more)
    deadline = time.time() + 10          # the event may be raised from a worker
    while d.events() == ev0 and time.time() < deadline:
        time.sleep(0.2)
    assert d.events() > ev0, "no dm event when free blocks reached low_water_mark"
    verify_blocks(d.path, exp)


STRIDE = 2048      # LBAs between two writers' ranges


def _fill_worker(path, seed, first_id, lbas, out):
    """One writer: unique blocks at @lbas in order, until a write fails."""
    done, err = [], None
    with BlockDev(path) as bd:
        for i, lba in enumerate(lbas):
            try:
                bd.write(lba, block_data(seed, first_id + i))
            except OSError as e:
                err = e.errno
                break
            done.append((lba, first_id + i))
    out.put((done, err))


def fill_concurrently(d, seed, first_id, writers, lbas_each, base=0):
    """@writers processes write unique blocks at once, writer w to LBAs
    base + w * STRIDE + [0, lbas_each), until each gets an error. Returns
    the expected map and the errors."""
    out = multiprocessing.Queue()
    procs = [multiprocessing.Process(
        target=_fill_worker,
        args=(d.path, seed, first_id + w * lbas_each,
              range(base + w * STRIDE, base + w * STRIDE + lbas_each), out))
        for w in range(writers)]
    for p in procs:
        p.start()
    results = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0, "writer exited with %r" % p.exitcode
    exp = {lba: block_data(seed, i) for done, _ in results for lba, i in done}
    return exp, [err for _, err in results]


def discard_lbas(d, lbas):
    """Discard @lbas, a run of consecutive ones per call."""
    lbas = sorted(lbas)
    i = 0
    while i < len(lbas):
        j = i
        while j + 1 < len(lbas) and lbas[j + 1] == lbas[j] + 1:
            j += 1
        ddlib.discard(d.path, lbas[i], j - i + 1)
        i = j + 1


@EARLY_ACK
def test_full_device_concurrent_writers(make_dedup, seed, opts):
    """Writers on both CPUs fill the data device to its last block: a CPU's
    reserved run of free blocks (dedup-reserve.c) is given back before any
    write gets ENOSPC, and the reservations are counted as free, never as
    used, in the status and across a clean remove and create."""
    d = make_dedup(meta_mib=8, data_mib=4, logical_mib=32, opts=opts)
    total = d.status()["data_total"]
    assert total == 1024 and d.nblocks == 4 * STRIDE
    writers = 4
    # Each writer tries one more block than there are: all must see ENOSPC.
    exp, errs = fill_concurrently(d, seed, 0, writers, total + 1)
    assert errs == [errno.ENOSPC] * writers, errs
    assert len(exp) == total, \
        "%d of %d data blocks written before ENOSPC" % (len(exp), total)
    if opts:
        assert int(d.stats()["early_acks_undecided"]) >= total - 64, d.stats()
    st = d.status()
    assert (st["data_used"], st["mapped"]) == (total, total), st

    # Free 100 blocks, let the commits make them reusable, fill again at once.
    freed = sorted(exp)[:100]
    discard_lbas(d, freed)
    for lba in freed:
        del exp[lba]
    d.commit()
    d.commit()
    assert d.status()["data_used"] == total - 100
    more, errs = fill_concurrently(d, seed, 10**6, writers, 101, base=1100)
    assert errs == [errno.ENOSPC] * writers, errs
    assert set(more).isdisjoint(exp)
    exp.update(more)
    assert len(more) == 100, "%d of 100 freed blocks written again" % len(more)
    assert d.status()["data_used"] == total

    # Free some again and write a few from one writer, so that runs are
    # reserved when the device is removed: the clean close saves the
    # blocks in use only, and the next activation finds them.
    freed = sorted(exp)[:64]
    discard_lbas(d, freed)
    for lba in freed:
        del exp[lba]
    d.commit()
    d.commit()
    more, errs = fill_concurrently(d, seed, 2 * 10**6, 1, 8, base=1300)
    assert errs == [None], errs
    exp.update(more)
    used = d.status()["data_used"]
    assert used == total - 64 + 8, used
    d.remove()
    d.activate()
    assert d.status()["data_used"] == used
    verify_blocks(d.path, exp, nblocks=d.nblocks)
