"""pytest fixtures for the dm-dedup guest suite.

Run INSIDE the guest (scripts/guest-run.sh) as root with Debian's python:
    /bin/python3 -m pytest -p no:cacheprovider tests/guest
Environment:
    DEDUP_KO       module to insmod (default <repo>/dm-dedup/dm-dedup.ko)
    DD_TEST_TIMEOUT per-test time limit in seconds (default 900)
    DD_NO_MODULE=1 do not load dm-dedup (only for harness self-tests)
    DD_FULL_RUN=1  a full run (tests/run-all.sh without PYTEST_ARGS): any
                   skipped, xfailed, xpassed or deselected test fails the run
"""

import os
import signal
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ddlib  # noqa: E402
from ddlib import MIB  # noqa: E402
from lvm import VolumeGroup  # noqa: E402

TEST_TIMEOUT = int(os.environ.get("DD_TEST_TIMEOUT", "900"))


def pytest_configure(config):
    sys.dont_write_bytecode = True


# ---------------------------------------------------------------------------
# session: module and tmpfs
# ---------------------------------------------------------------------------
@pytest.fixture(scope="session", autouse=True)
def dedup_module():
    """Load dm-mod, dm-bufio, libcrc32c, ... and insmod dm-dedup (missing
    module = failure).  At the end: remove every dedup device and rmmod."""
    assert os.geteuid() == 0, "the guest suite must run as root"
    ddlib.mount_tmpfs()
    if os.environ.get("DD_NO_MODULE") == "1":
        for m in ddlib.BASE_MODULES:
            ddlib.run(["modprobe", m], check=False)
        yield None
        ddlib.umount_tmpfs()
        return
    ddlib.load_dedup_module()
    yield ddlib.DEDUP_KO
    k = ddlib.Kmsg()
    errors = ddlib.remove_dm_devices()          # ddt* leftovers, if any
    # then every device that still has a dedup target (any name)
    for n in ddlib.dm_devices_with_target("dedup"):
        p = ddlib.run(["dmsetup", "remove", "--retry", n], check=False)
        if p.returncode:
            errors.append("remove %s: %s" % (n, p.stderr.strip()))
    if ddlib.module_loaded():
        p = ddlib.run(["rmmod", "dm_dedup"], check=False)
        if p.returncode:
            errors.append("rmmod dm_dedup failed: %s" % p.stderr.strip())
    ddlib.umount_tmpfs()
    bad = k.bad_lines()
    k.close()
    if ddlib.METADATA_CHECKS == 0 and not os.environ.get("PYTEST_ARGS_SUBSET"):
        errors.append("the metadata checker never ran: the oracle is not wired up")
    print("\nmetadata devices checked clean by `dedup check`: %d" % ddlib.METADATA_CHECKS)
    if bad:
        errors.append("kernel log during unload:\n" + "\n".join(bad[:80]))
    if errors:
        pytest.fail("session teardown: " + "; ".join(errors), pytrace=False)


# ---------------------------------------------------------------------------
# per test: kernel log watch and time limit
# ---------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def kmsg_check(request):
    """Fail the test if the kernel logged WARNING/BUG/KFENCE/Oops/... during
    it (including its fixtures' teardown: this fixture is set up first)."""
    k = ddlib.Kmsg()
    yield k
    # Every test ends with the module unloading cleanly (no device, work or
    # memory left behind), then loaded again for the next one.
    unload = None
    if ddlib.module_loaded() and os.environ.get("DD_NO_MODULE") != "1":
        if ddlib.dm_devices_with_target("dedup"):
            unload = "dedup devices left behind: %s" % ddlib.dm_devices_with_target("dedup")
        else:
            t0 = time.monotonic()
            p = ddlib.run(["rmmod", "dm_dedup"], check=False)
            if p.returncode:
                unload = "rmmod dm_dedup failed: %s" % p.stderr.strip()
            ddlib.load_dedup_module()
            ddlib.spent("(module reload after a test)", time.monotonic() - t0)
    bad = k.bad_lines()
    k.close()
    if bad:
        pytest.fail("kernel log has problems during %s:\n%s" % (
            request.node.nodeid, "\n".join(bad[:80])), pytrace=False)
    if unload:
        pytest.fail("after %s: %s" % (request.node.nodeid, unload), pytrace=False)


class TestTimeout(Exception):
    pass


@pytest.fixture(autouse=True)
def time_limit():
    def handler(signum, frame):
        raise TestTimeout("test exceeded %d s (DD_TEST_TIMEOUT)" % TEST_TIMEOUT)
    old = signal.signal(signal.SIGALRM, handler)
    signal.alarm(TEST_TIMEOUT)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


# ---------------------------------------------------------------------------
# backing devices and dedup devices
# ---------------------------------------------------------------------------
@pytest.fixture
def backing(kmsg_check):
    """Backing devices (loop over guest tmpfs files, null_blk).  Teardown
    removes all dm devices named ddt*, detaches the loops, deletes files."""
    b = ddlib.Backing()
    yield b
    t0 = time.monotonic()
    errors = b.cleanup()
    ddlib.spent("(backing devices' cleanup after a test)", time.monotonic() - t0)
    if errors:
        pytest.fail("cleanup: " + "; ".join(errors), pytrace=False)


class DedupFactory:
    """Makes dedup devices over fresh loop devices.  Sizes in MiB; logical in
    MiB too (converted to sectors)."""

    def __init__(self, backing):
        self.backing = backing
        self.n = 0

    def name(self):
        self.n += 1
        return "%s%d" % (ddlib.NAME_PREFIX, self.n)

    def __call__(self, meta_mib=16, data_mib=64, logical_mib=256, opts=(), name=None,
                 lvm=False, vg_spare_mib=0):
        """lvm: the metadata and data devices are logical volumes "meta"
        and "data" of a new volume group (dev.vg), as on a datastore, with
        vg_spare_mib left free in the group to grow them."""
        vg = None
        if lvm:
            # LVM rounds sizes up to its 4 MiB extents and keeps 1 MiB.
            vg = VolumeGroup(self.backing, meta_mib + data_mib + 16 + vg_spare_mib)
            meta, data = vg.lv("meta", meta_mib), vg.lv("data", data_mib)
        else:
            meta = self.backing.loop(meta_mib, "meta")
            data = self.backing.loop(data_mib, "data")
        dev = ddlib.DedupDev.create(name or self.name(), meta, data,
                                    logical_mib * MIB // 512, opts)
        dev.vg = vg
        return dev


@pytest.fixture
def make_dedup(backing):
    return DedupFactory(backing)


@pytest.fixture
def dedup(make_dedup):
    """A default dedup device: 16 MiB metadata, 64 MiB data, 256 MiB logical."""
    return make_dedup()


@pytest.fixture
def seed(request):
    """A per-test seed (stable across runs) for ddlib.block_data."""
    import zlib
    return zlib.crc32(request.node.nodeid.encode()) & 0xffffff


# ---------------------------------------------------------------------------
# a full run runs every test: nothing skipped, xfailed or deselected
# ---------------------------------------------------------------------------
FULL_RUN = os.environ.get("DD_FULL_RUN") == "1"
NOT_RUN = []                   # (outcome, node id) of tests a full run did not run


def pytest_deselected(items):
    NOT_RUN.extend(("deselected", i.nodeid) for i in items)


def pytest_collectreport(report):
    if report.skipped:
        NOT_RUN.append(("skipped at collection", report.nodeid))


def pytest_runtest_logreport(report):
    if hasattr(report, "wasxfail"):
        NOT_RUN.append(("xfailed" if report.skipped else "xpassed", report.nodeid))
    elif report.skipped:
        NOT_RUN.append(("skipped", report.nodeid))


def pytest_sessionfinish(session, exitstatus):
    """In a full run, a test that did not run and pass is a failure of the
    run: set the exit status (run-all.sh exits with it)."""
    if FULL_RUN and NOT_RUN and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if FULL_RUN and NOT_RUN:
        terminalreporter.write_line(
            "FULL RUN INCOMPLETE: %d tests did not run and pass (a full run may not "
            "skip, xfail or deselect any):" % len(NOT_RUN), red=True, bold=True)
        for outcome, nodeid in NOT_RUN[:50]:
            terminalreporter.write_line("  %s: %s" % (outcome, nodeid))
    for line in ddlib.REPORT:
        terminalreporter.write_line(line)
    top = sorted(ddlib.SPENT.items(), key=lambda kv: -kv[1][1])[:15]
    terminalreporter.write_line("the suite's own steps, most time first (calls, seconds): " +
                                "; ".join("%s %d %.0f" % (k, c, t) for k, (c, t) in top))
    terminalreporter.write_line(
        "metadata devices checked clean by `dedup check`: %d (%d with --data: every live "
        "data block matched its fingerprint)" % (ddlib.METADATA_CHECKS, ddlib.DATA_CHECKS))
