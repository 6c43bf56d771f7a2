"""Flush/FUA and commits (transaction id), messages, suspend/resume."""

import os
import re
import threading
import time

import ddlib
from ddlib import BlockDev, block_data, verify_blocks, write_ids


def test_fsync_appends_to_the_journal(make_dedup, seed):
    """commit_interval 3600: a flush appends the changes to the journal
    (Documentation/dm-dedup.rst, "Transactions and commits") and commits
    no tree; the commit message then checkpoints and empties the journal."""
    d = make_dedup(opts=["commit_interval", "3600"])
    with BlockDev(d.path) as bd:
        bd.write(0, block_data(seed, 1))
        st0 = d.status()
        # a quarter of what the trees need, 64 to 2048 blocks
        assert 64 <= st0["journal_total"] <= 2048, st0["raw"]
        bd.fsync()
        st1 = d.status()
        assert st1["transaction_id"] == st0["transaction_id"], st1["raw"]
        assert st1["journal_used"] > st0["journal_used"], \
            "fsync appended nothing:\n%s\n%s" % (st0["raw"], st1["raw"])
        bd.write(1, block_data(seed, 2))
        bd.fsync()
        st2 = d.status()
        assert st2["journal_used"] > st1["journal_used"], st2["raw"]
        assert int(d.stats()["journal_appends"]) == 2
    d.commit()
    st3 = d.status()
    assert st3["transaction_id"] > st2["transaction_id"] and st3["journal_used"] == 0, \
        st3["raw"]


def test_fua_write_is_appended(make_dedup, seed):
    """O_DSYNC|O_DIRECT: a FUA write (or write + flush) must be durable, which
    needs an append of its mapping to the journal."""
    d = make_dedup(opts=["commit_interval", "3600"])
    write_ids(d.path, seed, [5])
    p0 = ddlib.durable_point(d.status())
    with BlockDev(d.path, os.O_DSYNC) as bd:
        bd.write(1, block_data(seed, 6))
    assert ddlib.durable_point(d.status()) > p0


def test_periodic_commit(make_dedup, seed):
    d = make_dedup(opts=["commit_interval", "1"])
    # Read before the write: on a slow guest the periodic commit may come
    # before a status read after it, and then nothing is left to commit.
    t0 = d.status()["transaction_id"]
    write_ids(d.path, seed, [1])
    deadline = time.time() + 15
    while d.status()["transaction_id"] == t0 and time.time() < deadline:
        time.sleep(0.5)
    assert d.status()["transaction_id"] > t0, "no periodic commit within 15 s"


def test_commit_message(make_dedup, seed):
    d = make_dedup(opts=["commit_interval", "3600"])
    write_ids(d.path, seed, [1, 2])
    t0 = d.status()["transaction_id"]
    before = d.stats()
    assert int(before["commit_hold_us"]) == int(before["commit_hold_max_us"]) == 0
    d.message("commit")
    assert d.status()["transaction_id"] > t0
    # The commit held writers out for a while, and the stats say how long.
    after = d.stats()
    assert int(after["checkpoints"]) == int(before["checkpoints"]) + 1
    assert 0 < int(after["commit_hold_max_us"]) <= int(after["commit_hold_us"]), after


def test_stats_message(dedup, seed):
    """`stats` prints one `key value` line per figure, consistent with the
    status line and with what was written."""
    write_ids(dedup.path, seed, [1, 2, 1, None])
    out = dedup.message("stats")
    lines = [l.strip() for l in out.splitlines() if l.strip()]
    assert lines, "stats message printed nothing"
    kv = {}
    for l in lines:
        assert re.fullmatch(r"[a-z0-9_]+ \S+", l), "not a `key value` line: %r" % l
        k, v = l.split()
        assert k not in kv, "key %s printed twice" % k
        kv[k] = v
    st = dedup.status()
    assert kv["mode"] == st["mode"] == "rw"
    assert int(kv["unique_writes"]) == st["unique_writes"] == 2
    assert int(kv["duplicate_writes"]) == st["duplicate_writes"] == 1
    assert int(kv["zero_writes"]) == st["zero_writes"] == 1
    assert int(kv["mapped_blocks"]) == st["mapped"] == 3
    assert int(kv["data_blocks_live"]) == 2
    assert int(kv["data_blocks_total"]) == st["data_total"]
    assert int(kv["index_entries"]) == 2
    assert int(kv["dedup_ratio_x100"]) == 150      # 3 mapped over 2 stored
    assert kv["hash"] == st["hash"] == "sha256"


def test_unknown_message_rejected(dedup):
    p = dedup.message("frobnicate", check=False)
    assert p.returncode != 0
    p = dedup.message(check=False)
    assert p.returncode != 0


def test_flush_on_empty_device(dedup):
    """A flush with nothing written must succeed."""
    with BlockDev(dedup.path) as bd:
        bd.fsync()
    assert dedup.status()["mode"] == "rw"


def test_suspend_resume_with_io(dedup, seed):
    """Suspend/resume repeatedly while a thread writes; everything lands."""
    exp = {}
    stop = threading.Event()
    errors = []

    def writer():
        try:
            with BlockDev(dedup.path) as bd:
                i = 0
                while not stop.is_set() and i < 2000:
                    data = block_data(seed, i % 300)
                    bd.write(i, data)
                    exp[i] = data
                    i += 1
        except Exception as e:  # noqa
            errors.append(e)

    t = threading.Thread(target=writer)
    t.start()
    try:
        for _ in range(5):
            time.sleep(0.3)
            dedup.suspend()
            st = dedup.status()          # status works while suspended
            assert st["mode"] == "rw"
            time.sleep(0.2)
            dedup.resume()
    finally:
        stop.set()
        t.join(300)
    assert not errors, errors
    assert not t.is_alive()
    st = dedup.status()
    assert st["mapped"] == len(exp), st
    assert st["data_used"] == len({exp[l] for l in exp}), st
    verify_blocks(dedup.path, exp, nblocks=len(exp) + 16)


def test_reload_same_table(dedup, seed):
    """dmsetup reload + resume with the identical table (a table swap)."""
    exp = write_ids(dedup.path, seed, [1, 2, 3, 1])
    st = dedup.status()
    ddlib.run(["dmsetup", "reload", dedup.name, "--table", dedup.table()])
    dedup.resume()
    assert ddlib.counters(dedup.status()) == ddlib.counters(st)
    verify_blocks(dedup.path, exp, nblocks=16)
    exp.update(write_ids(dedup.path, seed, [4], start=4))
    verify_blocks(dedup.path, exp, nblocks=16)
