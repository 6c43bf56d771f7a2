"""A real NFSv4 server (the kernel's nfsd with nfs-utils' rpc.nfsd,
rpc.mountd and exportfs) in the server namespace of a netns.NetPair, and
mounts by the kernel's NFS client from the client namespace.

The guest runs no services: this starts the daemons and stops them. Their
state directory /var/lib/nfs is a tmpfs for the server's lifetime (the
guest sees the host's root file system). The grace and lease times are
the kernel's minimum, 10 s, so that the first open after the start waits
10 s instead of 90.
"""

import os
import time

import ddlib
from ddlib import run
from netns import CLIENT_IP, SERVER_IP

STATE_DIR = "/var/lib/nfs"
NFSD_FS = "/proc/fs/nfsd"


class NfsServer:
    def __init__(self, net):
        self.net = net
        self.exports = []
        self.mounts = []
        self.steps = []             # what stop() must undo, in order
        ddlib.modprobe("nfsd", "nfsv4")
        run(["mount", "-t", "tmpfs", "-o", "size=16m", "ddnfsstate", STATE_DIR])
        self.steps.append(("umount", STATE_DIR))
        for d in ("v4recovery", "rpc_pipefs"):
            os.makedirs(os.path.join(STATE_DIR, d), exist_ok=True)
        for f in ("etab", "rmtab"):
            open(os.path.join(STATE_DIR, f), "w").close()
        # Mounted from the server namespace: nfsd's control files then
        # belong to that namespace's nfsd instance.
        net.srv(["mount", "-t", "nfsd", "nfsd", NFSD_FS])
        self.steps.append(("umount", NFSD_FS))
        os.makedirs("/run/rpcbind", exist_ok=True)
        net.srv(["rpcbind"])
        self.steps.append(("kill", "rpcbind"))
        net.srv(["rpc.mountd", "-N", "3"])
        self.steps.append(("kill", "rpc.mountd"))
        net.srv(["rpc.nfsd", "-N", "3", "-G", "10", "-L", "10", "-H", SERVER_IP, "4"])
        self.steps.append(("nfsd", None))
        self.started = time.monotonic()

    def export(self, path):
        """Export @path read-write to the client, root not squashed (the
        hypervisor writes as root), as the NFSv4 root (fsid=0): the
        directories above it may be on file systems nfsd cannot export
        (the guest's tmpfs), so clients mount "/", not @path."""
        assert not self.exports, "one export per server"
        self.net.srv(["exportfs", "-o", "rw,sync,no_root_squash,no_subtree_check,fsid=0",
                      "%s:%s" % (CLIENT_IP, path)])
        self.exports.append(path)

    def mount(self, mnt, opts="vers=4.2,proto=tcp,hard,timeo=600"):
        """Mount the export at @mnt from the client namespace; the mount
        is visible here (one mount namespace)."""
        os.makedirs(mnt, exist_ok=True)
        self.net.cli(["mount", "-t", "nfs4", "-o", opts, "%s:/" % SERVER_IP, mnt])
        self.mounts.append(mnt)

    def umount(self, mnt):
        self.net.cli(["umount", mnt])
        self.mounts.remove(mnt)

    def stop(self):
        """Unmount the clients, unexport, stop nfsd and the daemons.
        Returns the errors met (cleanup goes on after each)."""
        errors = []

        def tryrun(argv):
            p = run(argv, check=False)
            if p.returncode:
                errors.append("%s: %s" % (" ".join(argv), p.stderr.strip()))

        for mnt in reversed(self.mounts):
            tryrun(self.net.argv(self.net.client, ["umount", "-f", mnt]))
        self.mounts = []
        for path in self.exports:
            tryrun(self.net.argv(self.net.server,
                                 ["exportfs", "-u", "%s:%s" % (CLIENT_IP, path)]))
        self.exports = []
        for what, arg in reversed(self.steps):
            if what == "nfsd":
                tryrun(self.net.argv(self.net.server, ["rpc.nfsd", "0"]))
            elif what == "kill":
                run(["pkill", "-x", arg], check=False)
            else:
                tryrun(["umount", arg])
        self.steps = []
        return errors
