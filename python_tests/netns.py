"""Several "hosts" on one machine: network namespaces joined by veth pairs to a bridge.

``NamespaceHosts(n)`` makes ``n`` namespaces, each with one veth interface whose other end is a
port of a bridge in a hub namespace of its own, so that traffic between two of them crosses two
real interfaces and a bridge, and nothing leaves the namespaces (their addresses exist only
there; the machine's own interfaces are untouched). ``cut(i)`` takes host ``i``'s bridge port
down mid-run, as a pulled cable would; ``close()`` deletes everything.

A rank enters its host with ``enter(name)`` (setns on the calling thread; the threads it starts
afterwards, xccl_rs's among them, inherit it). Sockets made before that, such as the rank's
connection to the test's TCPStore on the machine's loopback, keep working, so the store stays
reachable from a host whose link is cut: the test's out-of-band channel, not part of the
fabric under test.

Needs root and ``ip`` (iproute2); ``unavailable()`` says why not, for a skip.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

_CLONE_NEWNET = 0x40000000
_SUBNET = "10.77.0"  # only ever configured inside the namespaces made here


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


def unavailable() -> str | None:
    """None where namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"xrprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"`ip netns add` failed: {getattr(e, 'stderr', '') or e}"
    _ip("netns", "del", probe)
    return None


class NamespaceHosts:
    def __init__(self, count: int):
        tag = f"xr{os.getpid() % 100000}"
        self.hub = f"{tag}hub"
        self.names = [f"{tag}n{i}" for i in range(count)]
        self.addresses = [f"{_SUBNET}.{i + 1}" for i in range(count)]
        self._ports = [f"{tag}b{i}" for i in range(count)]  # the bridge's ends
        self._made: list[str] = []
        try:
            self._make(tag)
        except BaseException:
            self.close()
            raise

    def _make(self, tag: str) -> None:
        _ip("netns", "add", self.hub)
        self._made.append(self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for i, (ns, addr, port) in enumerate(zip(self.names, self.addresses, self._ports)):
            _ip("netns", "add", ns)
            self._made.append(ns)
            host_end = f"{tag}h{i}"
            _ip("link", "add", host_end, "type", "veth", "peer", "name", port)
            _ip("link", "set", host_end, "netns", ns)
            _ip("link", "set", port, "netns", self.hub)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", host_end)
            _ip("-n", ns, "link", "set", host_end, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", self.hub, "link", "set", port, "master", "br0")
            _ip("-n", self.hub, "link", "set", port, "up")

    def cut(self, i: int) -> None:
        """Host i's cable is pulled: its bridge port goes down (no RST, no FIN: packets just stop)."""
        _ip("-n", self.hub, "link", "set", self._ports[i], "down")

    def close(self) -> None:
        for ns in reversed(self._made):  # deleting a namespace deletes its interfaces
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        self._made.clear()

    def __enter__(self) -> "NamespaceHosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def enter(name: str) -> None:
    """Moves the calling thread into network namespace `name` (made by NamespaceHosts)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)


def tcp_peers_of_this_process() -> list[tuple[str, str]]:
    """(local, remote) IPv4 addresses of this process's established TCP connections, as the
    current network namespace sees them (/proc/self/net/tcp, matched by socket inode)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    with open("/proc/self/net/tcp") as f:
        next(f)
        for line in f:
            cols = line.split()
            local, remote, state, inode = cols[1], cols[2], cols[3], cols[9]
            if state == "01" and inode in inodes:  # 01 = ESTABLISHED
                out.append((_ipv4(local), _ipv4(remote)))
    return out


def _ipv4(hex_addr_port: str) -> str:
    addr = bytes.fromhex(hex_addr_port.split(":")[0])[::-1]  # little endian on x86
    return ".".join(str(b) for b in addr)


def maps_shared_memory() -> bool:
    """Whether this process maps one of xccl_rs's shared-memory segments (unlinked once every
    rank has it open, so /proc/self/maps is where it shows)."""
    with open("/proc/self/maps") as f:
        return any("/dev/shm/" in line and "xccl" in line for line in f)
