"""Several "hosts" on one machine: network namespaces joined by veth pairs to bridges.

``NamespaceHosts(n, rails=k, rate=None)`` makes ``n`` namespaces ("hosts"), each with ``k``
veth interfaces, one per *rail*: rail ``i`` of host ``h`` has the address ``10.77.<i>.<h+1>``
on a subnet of its own, and the other end of its veth is a port of rail ``i``'s bridge in a hub
namespace. So traffic between two hosts crosses two real interfaces and a bridge, and nothing
leaves the namespaces (their addresses exist only there; the machine's own interfaces are
untouched). As on a cluster with one NIC per local rank, local rank ``i`` of every host
advertises its rail-``i`` address (``address(h, i)``): ranks of the same local index talk over
their own rail. Traffic between different local indices (an all-to-all) leaves through the
destination's rail and its replies come back on another, so reverse-path filtering is off in
every namespace.

``rate`` (a tc rate such as ``"1gbit"``) shapes every veth with a token bucket (``tbf``) on both
ends: a host's upload on its end, its download on the bridge's end, so that every rail carries at
most ``rate`` each way, as a NIC does. (netem is not available on these kernels; tbf is.)

``cut(h)`` takes every bridge port of host ``h`` down mid-run, as pulled cables would
(``cut(h, rail)`` only one); ``close()`` deletes everything, and ``leftovers()`` lists what of it
would remain.

A rank enters its host with ``enter(name)`` (setns on the calling thread; the threads it starts
afterwards, xccl_rs's among them, inherit it). Sockets made before that, such as the rank's
connection to the test's TCPStore on the machine's loopback, keep working, so the store stays
reachable from a host whose link is cut: the test's out-of-band channel, not part of the
fabric under test. ``outside()`` runs a block back in the namespace the process started in
(to connect another client of that store).

Needs root and ``ip`` (iproute2), and ``tc`` for ``rate``; ``unavailable()`` says why not, for a
skip, and ``shaping_unavailable()`` why links cannot be shaped.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess

_CLONE_NEWNET = 0x40000000
_PREFIX = "10.77"  # only ever configured inside the namespaces made here
_TAG = "xr"  # every namespace made here is named xr<pid><...>


def _run(*cmd: str) -> None:
    subprocess.run(list(cmd), check=True, capture_output=True, text=True, timeout=20)


def _ip(*args: str) -> None:
    _run("ip", *args)


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


def shaping_unavailable() -> str | None:
    """None where a veth can be shaped with tbf here, else why not."""
    why = unavailable()
    if why is not None:
        return why
    if shutil.which("tc") is None:
        return "no `tc` command (iproute2)"
    try:
        with NamespaceHosts(1, rate="1gbit"):
            pass
    except subprocess.CalledProcessError as e:
        return f"tc tbf on a veth failed: {e.stderr.strip()}"
    return None


class NamespaceHosts:
    def __init__(self, count: int, rails: int = 1, rate: str | None = None, burst: str = "256kb"):
        tag = f"{_TAG}{os.getpid() % 100000}"
        self.count, self.rails, self.rate = count, rails, rate
        self.hub = f"{tag}hub"
        self.names = [f"{tag}n{h}" for h in range(count)]
        # rail 0's addresses (the one address of a host with one rail)
        self.addresses = [self.address(h, 0) for h in range(count)]
        self._made: list[str] = []
        try:
            self._make(burst)
        except BaseException:
            self.close()
            raise

    def address(self, host: int, rail: int) -> str:
        return f"{_PREFIX}.{rail}.{host + 1}"

    def _port(self, host: int, rail: int) -> str:
        return f"p{host}r{rail}"  # the bridge's end of host's rail (inside the hub namespace)

    def _make(self, burst: str) -> None:
        _ip("netns", "add", self.hub)
        self._made.append(self.hub)
        for rail in range(self.rails):
            _ip("-n", self.hub, "link", "add", f"br{rail}", "type", "bridge")
            _ip("-n", self.hub, "link", "set", f"br{rail}", "up")
        for h, ns in enumerate(self.names):
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            for key in ("all", "default"):  # replies to another rail's traffic come back on this one
                _run("ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv4.conf.{key}.rp_filter=0")
            for rail in range(self.rails):
                port = self._port(h, rail)
                # both ends made inside their namespaces: nothing ever exists outside them
                _ip("link", "add", "name", f"rail{rail}", "netns", ns, "type", "veth", "peer", "name", port, "netns", self.hub)
                _ip("-n", ns, "addr", "add", f"{self.address(h, rail)}/24", "dev", f"rail{rail}")
                _ip("-n", ns, "link", "set", f"rail{rail}", "up")
                _ip("-n", self.hub, "link", "set", port, "master", f"br{rail}")
                _ip("-n", self.hub, "link", "set", port, "up")
                if self.rate is not None:
                    for where, dev in ((ns, f"rail{rail}"), (self.hub, port)):  # upload, download
                        _run("tc", "-n", where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                             "burst", burst, "latency", "50ms")

    def cut(self, host: int, rail: int | None = None) -> None:
        """Host's cables are pulled (one rail's, or all): its bridge ports go down (no RST, no
        FIN: packets just stop)."""
        for r in range(self.rails) if rail is None else [rail]:
            _ip("-n", self.hub, "link", "set", self._port(host, r), "down")

    def close(self) -> None:
        for ns in reversed(self._made):  # deleting a namespace deletes its interfaces
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        self._made.clear()

    def leftovers(self) -> list[str]:
        """The namespaces made here that still exist (none after close())."""
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
        present = {line.split()[0] for line in listed.splitlines() if line.strip()}
        return sorted(present & {self.hub, *self.names})

    def __enter__(self) -> "NamespaceHosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _setns(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


_ORIGINAL: int | None = None  # the namespace this process started in, kept open by enter()


def enter(name: str) -> None:
    """Moves the calling thread into network namespace `name` (made by NamespaceHosts)."""
    global _ORIGINAL
    if _ORIGINAL is None:
        _ORIGINAL = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    _setns(f"/run/netns/{name}")


@contextlib.contextmanager
def outside():
    """Runs the block in the namespace the process started in (where the test's store listens
    on loopback), then returns to the one the thread was in."""
    here = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        if _ORIGINAL is not None:
            _setns(f"/proc/self/fd/{_ORIGINAL}")
        yield
    finally:
        _setns(f"/proc/self/fd/{here}")
        os.close(here)


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
