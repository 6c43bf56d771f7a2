"""A real iSCSI path: the kernel's LIO target (configured through
python3-rtslib-fb, as targetcli does) exporting a block device as a LUN
from the server namespace of a netns.NetPair, and open-iscsi's initiator
(iscsid, iscsiadm, the kernel's iscsi_tcp) logging in from the client
side, which must be the guest's initial namespace (NetPair with
client_in_init). The LUN shows up in the guest as a SCSI disk.

The portal is created from the server namespace, so the target listens
only there. iscsid keeps its node database under /etc/iscsi: a tmpfs with
a copy of the configuration and a fresh initiator name for the session.
"""

import glob
import os
import sys
import textwrap
import time

import ddlib
from ddlib import run
from netns import SERVER_IP

PORT = 3260
ISCSI_ETC = "/etc/iscsi"


class LioLun:
    """@dev exported as LUN 0 of target @iqn, with UNMAP (thin
    provisioning emulation) on, no authentication, any initiator."""

    def __init__(self, net, dev, iqn, name):
        self.net = net
        self.dev = dev
        self.iqn = iqn
        self.name = name
        ddlib.modprobe("target_core_mod", "target_core_iblock", "iscsi_target_mod")
        ddlib.ensure_configfs()
        self._rtslib("""
            so = BlockStorageObject(NAME, dev=DEV)
            so.set_attribute("emulate_tpu", "1")
            so.set_attribute("emulate_tpws", "1")
            tpg = TPG(Target(FabricModule("iscsi"), IQN), 1)
            for attr, val in (("authentication", "0"), ("generate_node_acls", "1"),
                              ("demo_mode_write_protect", "0"), ("cache_dynamic_acls", "1")):
                tpg.set_attribute(attr, val)
            LUN(tpg, 0, so)
            NetworkPortal(tpg, SERVER_IP, PORT)
            tpg.enable = True
            """)
        self.alive = True

    def _rtslib(self, body):
        """Run @body with rtslib_fb in the server namespace (the portal's
        socket is created in the namespace of the process that asks)."""
        script = "from rtslib_fb import *\nNAME, DEV, IQN, SERVER_IP, PORT = %r, %r, %r, %r, %d\n" % (
            self.name, self.dev, self.iqn, SERVER_IP, PORT) + textwrap.dedent(body)
        self.net.srv([sys.executable, "-c", script])

    def delete(self):
        """Delete the target and the backstore (the device is closed)."""
        if not self.alive:
            return
        self._rtslib("""
            Target(FabricModule("iscsi"), IQN, mode="lookup").delete()
            BlockStorageObject(NAME).delete()
            """)
        self.alive = False


class Initiator:
    """iscsid in the client namespace; log in to a target and get its disk."""

    def __init__(self, net):
        self.net = net
        self.sessions = []
        ddlib.modprobe("iscsi_tcp")
        with open(os.path.join(ISCSI_ETC, "iscsid.conf")) as f:
            conf = f.read()
        run(["mount", "-t", "tmpfs", "-o", "size=8m", "ddiscsietc", ISCSI_ETC])
        with open(os.path.join(ISCSI_ETC, "iscsid.conf"), "w") as f:
            # short timeouts: a lost target shows in seconds, not minutes
            f.write(conf + "\nnode.session.timeo.replacement_timeout = 60\n")
        with open(os.path.join(ISCSI_ETC, "initiatorname.iscsi"), "w") as f:
            f.write("InitiatorName=iqn.2026-11.org.dm-dedup:initiator%d\n" % os.getpid())
        os.makedirs("/run/lock/iscsi", exist_ok=True)
        net.cli(["iscsid"])
        self.started = True

    def login(self, iqn):
        """Discover and log in; returns the LUN's /dev/sdX."""
        self.net.cli(["iscsiadm", "-m", "discovery", "-t", "sendtargets", "-p",
                      "%s:%d" % (SERVER_IP, PORT)])
        self.net.cli(["iscsiadm", "-m", "node", "-T", iqn, "-p", "%s:%d" % (SERVER_IP, PORT),
                      "--login"])
        self.sessions.append(iqn)
        for _ in range(300):
            ddlib.udev_settle()
            disk = self.disk(iqn)
            if disk:
                return disk
            time.sleep(0.1)
        raise AssertionError("no SCSI disk for %s after login:\n%s" % (
            iqn, self.net.cli(["iscsiadm", "-m", "session", "-P", "3"], check=False).stdout))

    def disk(self, iqn):
        """The SCSI disk of @iqn's LUN 0, from sysfs, or None."""
        for sess in glob.glob("/sys/class/iscsi_session/session*"):
            with open(os.path.join(sess, "targetname")) as f:
                if f.read().strip() != iqn:
                    continue
            for blk in glob.glob(os.path.join(sess, "device", "target*", "*:0:0:0", "block", "*")):
                dev = "/dev/" + os.path.basename(blk)
                if os.path.exists(dev):
                    return dev
        return None

    def logout(self, iqn):
        self.net.cli(["iscsiadm", "-m", "node", "-T", iqn, "--logout"])
        self.sessions.remove(iqn)
        ddlib.udev_settle()

    def stop(self):
        errors = []
        for iqn in list(self.sessions):
            p = run(self.net.argv(self.net.client, ["iscsiadm", "-m", "node", "-T", iqn,
                                                    "--logout"]), check=False)
            if p.returncode:
                errors.append("logout %s: %s" % (iqn, p.stderr.strip()))
        self.sessions = []
        if self.started:
            run(["pkill", "-x", "iscsid"], check=False)
            for _ in range(50):
                if run(["pgrep", "-x", "iscsid"], check=False).returncode:
                    break
                time.sleep(0.1)
            p = run(["umount", ISCSI_ETC], check=False)
            if p.returncode:
                errors.append("umount %s: %s" % (ISCSI_ETC, p.stderr.strip()))
            self.started = False
        return errors
