"""Two network namespaces in the guest joined by a veth pair: the
datastore's server on one side, its client (hypervisor) on the other, so
that NFS and iSCSI traffic really crosses a network stack.

Processes enter a namespace with `nsenter --net` only: they keep the
guest's mount namespace, so a file system the client mounts is visible to
the test, and a mount the server makes (nfsd's control file system) stays
for the daemons started later. The addresses exist only inside the two
namespaces.
"""

import os

from ddlib import run

SERVER_IP = "10.213.0.1"
CLIENT_IP = "10.213.0.2"


class NetPair:
    """@client_in_init: the client side is the guest's initial network
    namespace instead of a second one. The iSCSI initiator needs that:
    the kernel's iSCSI transport (scsi_transport_iscsi) opens its netlink
    socket, through which iscsid creates sessions, in the initial
    namespace only."""

    def __init__(self, client_in_init=False):
        tag = "%d" % os.getpid()
        self.server = "ddsrv" + tag
        self.client = None if client_in_init else "ddcli" + tag
        self.alive = []
        for ns in (self.server, self.client):
            if ns:
                run(["ip", "netns", "add", ns])
                self.alive.append(ns)
        veth_s, veth_c = "ddv" + tag + "s", "ddv" + tag + "c"
        run(["ip", "link", "add", veth_s, "netns", self.server, "type", "veth", "peer",
             "name", veth_c] + (["netns", self.client] if self.client else []))
        for ns, dev, ip in ((self.server, veth_s, SERVER_IP), (self.client, veth_c, CLIENT_IP)):
            self.sh(ns, ["ip", "link", "set", "lo", "up"])
            self.sh(ns, ["ip", "addr", "add", ip + "/24", "dev", dev])
            self.sh(ns, ["ip", "link", "set", dev, "up"])

    @staticmethod
    def argv(ns, cmd):
        """@cmd run in namespace @ns (None: the initial one)."""
        return (["nsenter", "--net=/run/netns/" + ns] if ns else []) + list(cmd)

    def sh(self, ns, cmd, check=True, timeout=300):
        return run(self.argv(ns, cmd), check=check, timeout=timeout)

    def srv(self, cmd, **kw):
        return self.sh(self.server, cmd, **kw)

    def cli(self, cmd, **kw):
        return self.sh(self.client, cmd, **kw)

    def close(self):
        """Delete the namespaces (the veth pair goes with them)."""
        errors = []
        for ns in self.alive:
            p = run(["ip", "netns", "del", ns], check=False)
            if p.returncode:
                errors.append("ip netns del %s: %s" % (ns, p.stderr.strip()))
        self.alive = []
        return errors
