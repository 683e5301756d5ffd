"""A hostile client on the ranks' TCP listeners while groups of 2 and 4 ranks set up.

The attacker (threads of this test process, sharing nothing with xccl_rs) finds the ranks'
listening ports on its own: the socket inodes in /proc/<pid>/fd of each rank, matched against
the LISTEN entries of /proc/net/tcp and tcp6. It keeps scanning during set-up (ranks listen
only while the group is created; the last ranks start late, so the listeners stay open a
while) and on every port it opens: silent connections held until the group is up; connect and
close; garbage bytes; truncated hellos; a valid-looking HELLO then a PROOF with a wrong MAC
(what a replayed handshake looks like to the acceptor, whose nonce is new); a HELLO then
frame headers with the frame magic.

Checked: group creation succeeds on every rank; every all_reduce is exact (against sums
computed here from the ranks' inputs); no rank crashes or hangs (harness deadlines); the
ranks' logs name the attacker's connections as refused; after its wrong PROOF (or frames) the
attacker got nothing but the CHALLENGE and the rank closed the connection. Timings of a batch
of all_reduces are printed next to a run without the attacker (not asserted).

XCCL_RS_TEST_BACKEND=gloo runs the same attack on gloo's ports as a reference: only the
group's success and the results are checked there (the handshake checks are xccl_rs's).
"""

from __future__ import annotations

import os
import random
import socket
import struct
import threading
import time

import pytest

from harness import IS_GLOO, ctx, run_ranks

N_OPS = 20
NUMEL = 1000
PG_TIMEOUT_S = 20.0  # a group that the attack blocks fails in this, not the default 60 s
CHALLENGE_LEN = 72  # "XCCH" flags 0 nonce[32] mac[32] (src/transport/tcp/handshake.rs)


def _inputs(rank: int, i: int):
    import torch

    g = torch.Generator().manual_seed(1000 * rank + i)
    return torch.randint(-(1 << 40), 1 << 40, (NUMEL,), dtype=torch.int64, generator=g)


def _rank(rank, world_size, late_s, tmpdir):
    """Writes its pid (for the attacker), its stderr to a file (for the refusals), starts late if
    told, then creates the group and runs N_OPS all_reduces."""
    import torch
    import torch.distributed as dist

    log = open(os.path.join(tmpdir, f"stderr.{rank}"), "w")
    os.dup2(log.fileno(), 2)  # the Rust side logs to fd 2
    with open(os.path.join(tmpdir, f"pid.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(late_s.get(rank, 0.0))  # a late rank keeps the others' listeners open
    t0 = time.perf_counter()
    dist.init_process_group(ctx().backend, store=ctx().connect_store(), rank=rank, world_size=world_size,
                            timeout=ctx().timeout())
    init_s = time.perf_counter() - t0
    out = []
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(N_OPS):
        t = _inputs(rank, i)
        dist.all_reduce(t)
        out.append(t)
    return {"init_s": init_s, "ops_s": time.perf_counter() - t0, "results": out}


# --------------------------------------------------------------------------------------
# the attacker
# --------------------------------------------------------------------------------------


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(int(link[8:-1]))
    except OSError:
        pass  # the process is gone
    return inodes


def _listening() -> dict[int, int]:
    """inode -> port of every listening TCP socket of this host (namespace)."""
    out = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(path).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A":  # TCP_LISTEN
                out[int(f[9])] = int(f[1].rsplit(":", 1)[1], 16)
    return out


# The longest a HELLO may wait for its CHALLENGE: the latest rank's delay, and then some.
CHALLENGE_WAIT_S = 6.0
HANDSHAKE_VERSION = 3  # src/transport/tcp/handshake.rs VERSION: a hello of another is refused before any CHALLENGE


def _hello(from_rank: int, to_rank: int) -> bytes:
    return b"XCH2" + struct.pack("<HHII", HANDSHAKE_VERSION, 0, from_rank, to_rank) + os.urandom(32)


def _frame() -> bytes:
    """A frame header with the magic and plausible fields (frame.rs), and a random tag."""
    fields = b"XCRS" + struct.pack("<BBBBQQqQ", 1, 1, 7, 0, 0, NUMEL, 0, 8 * NUMEL)
    return fields + os.urandom(16)


class Attacker:
    def __init__(self, tmpdir: str, world_size: int):
        self.tmpdir, self.world_size = tmpdir, world_size
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.ports: dict[int, int] = {}  # port -> rank
        self.held: list[socket.socket] = []  # the silent connections
        self.local_ports: set[int] = set()  # the attacker's own ends, to find in the logs
        self.connections = 0
        self.bad_proofs = []  # (got challenge, bytes after it, closed by the rank)
        self.leaks = []  # what a garbage/frame connection received (should be nothing useful)
        self.threads: list[threading.Thread] = []
        self.own = {p for i, p in _listening().items() if i in _socket_inodes(os.getpid())}

    def start(self):
        t = threading.Thread(target=self._scan, daemon=True)
        t.start()
        self.threads.append(t)

    def _scan(self):
        while not self.stop.is_set():
            listening = _listening()
            for rank in range(self.world_size):
                try:
                    pid = int(open(os.path.join(self.tmpdir, f"pid.{rank}")).read())
                except (OSError, ValueError):
                    continue
                for inode in _socket_inodes(pid) & listening.keys():
                    port = listening[inode]
                    if port in self.own or port in self.ports:
                        continue
                    self.ports[port] = rank
                    t = threading.Thread(target=self._attack, args=(port, rank), daemon=True)
                    t.start()
                    self.threads.append(t)
            self.stop.wait(0.05)

    def _connect(self, port: int) -> socket.socket | None:
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=2)
        except OSError:
            return None  # the listener closed: the group is up
        with self.lock:
            self.connections += 1
            self.local_ports.add(s.getsockname()[1])
        return s

    @staticmethod
    def _read(s: socket.socket, n: int, timeout: float) -> tuple[bytes, bool]:
        """Up to n bytes within timeout; and whether the peer closed (EOF or reset)."""
        s.settimeout(timeout)
        got = b""
        try:
            while len(got) < n:
                b = s.recv(n - len(got))
                if not b:
                    return got, True
                got += b
        except (ConnectionResetError, BrokenPipeError):
            return got, True
        except OSError:  # timeout
            pass
        return got, False

    def _attack(self, port: int, rank: int):
        peer = (rank + 1) % self.world_size  # claim to be a rank that connects to this one
        for _ in range(6):  # silent, held open until the group is up
            s = self._connect(port)
            if s is not None:
                self.held.append(s)
        # One thread per kind, so that the slow ones (waiting for a CHALLENGE) do not starve the rest.
        kinds = ("close", "garbage", "truncated", "bad_proof", "frames", "silent")
        threads = [threading.Thread(target=self._attack_kind, args=(port, rank, peer, k, random.Random(f"{port}{k}")),
                                    daemon=True) for k in kinds]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _attack_kind(self, port: int, rank: int, peer: int, kind: str, rnd: random.Random):
        for _ in range(15):
            if self.stop.is_set():
                return
            s = self._connect(port)
            if s is None:
                continue
            try:
                if kind == "silent":
                    self.held.append(s)
                    continue
                if kind == "garbage":
                    s.sendall(os.urandom(rnd.randint(1, 200)))
                elif kind == "truncated":
                    s.sendall(_hello(peer, rank)[: rnd.randint(1, 47)])
                elif kind in ("bad_proof", "frames"):
                    s.sendall(_hello(peer, rank))
                    # A rank answers once the group has agreed on its settings: after the late ranks come.
                    challenge, closed = self._read(s, CHALLENGE_LEN, CHALLENGE_WAIT_S)
                    if kind == "bad_proof":
                        if len(challenge) == CHALLENGE_LEN:
                            s.sendall(b"XCPR" + os.urandom(32))  # a MAC without the secret
                        after, closed = self._read(s, 1 << 16, 2.0)
                        self.bad_proofs.append((len(challenge) == CHALLENGE_LEN, after, closed))
                    else:
                        try:
                            for _ in range(4):
                                s.sendall(_frame() + os.urandom(64))
                        except OSError:
                            pass
                        after, closed = self._read(s, 1 << 16, 2.0)
                        if after:
                            self.leaks.append(("frames", after[:80]))
                    continue
                if kind != "close":
                    after, _ = self._read(s, 1 << 16, 0.5)
                    if after:
                        self.leaks.append((kind, after[:80]))
            except OSError:
                pass
            finally:
                if kind != "silent":
                    s.close()

    def finish(self):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=10)
        for s in self.held:
            s.close()


# --------------------------------------------------------------------------------------
# the test
# --------------------------------------------------------------------------------------


def _run(world_size: int, tmp_path, attack: bool):
    d = tmp_path / ("attacked" if attack else "quiet")
    d.mkdir()
    # The highest ranks connect to the lower ones: late, they keep the lower ranks listening.
    late = {world_size - 1: 3.0} if world_size == 2 else {2: 2.0, 3: 3.0}
    attacker = Attacker(str(d), world_size) if attack else None
    if attacker:
        attacker.start()
    try:
        res = run_ranks(world_size, _rank, late, str(d), init="none", timeout_s=60, pg_timeout_s=PG_TIMEOUT_S,
                        env={"XCCL_RS_TRANSPORT": "tcp", "XCCL_RS_LOG": "warn"}, check=False)
    finally:
        if attacker:
            attacker.finish()
    logs = {r: (d / f"stderr.{r}").read_text(errors="replace") if (d / f"stderr.{r}").exists() else ""
            for r in range(world_size)}
    problems = res.report()
    assert problems is None, problems + "\n" + "\n".join(f"rank {r} stderr:\n{t[-3000:]}" for r, t in logs.items())
    values = [res.value(r) for r in range(world_size)]
    import torch

    for i in range(N_OPS):  # the reference: the ranks' inputs, summed here
        expected = torch.stack([_inputs(r, i) for r in range(world_size)]).sum(0)
        for r in range(world_size):
            assert torch.equal(values[r]["results"][i], expected), f"rank {r}, all_reduce {i}"
    return values, attacker, logs


@pytest.mark.parametrize("world_size", [2, 4])
def test_hostile_client_during_setup(world_size, tmp_path):
    quiet, _, _ = _run(world_size, tmp_path, attack=False)
    values, attacker, logs = _run(world_size, tmp_path, attack=True)
    print(f"\nworld {world_size}: {attacker.connections} attacker connections on ports {attacker.ports} "
          f"(port: rank), {len(attacker.held)} held silent, {sum(c for c, _, _ in attacker.bad_proofs)} CHALLENGEs "
          f"answered with a wrong PROOF")
    for name, vals in (("quiet", quiet), ("attacked", values)):
        print(f"  {name:8}: init_s {[round(v['init_s'], 2) for v in vals]}, "
              f"{N_OPS} all_reduces {[round(v['ops_s'], 3) for v in vals]} s")
    # The attack happened: ports found on their own, and a good number of connections made.
    assert attacker.ports, "the attacker found no listening port of the ranks"
    assert attacker.connections >= 50, attacker.connections
    if IS_GLOO:
        return  # gloo's own handshake: the checks below are of xccl_rs's
    refused = " ".join(logs.values())
    ours = [p for p in attacker.local_ports if f"refused a connection from 127.0.0.1:{p}" in refused]
    assert ours, "no rank logged refusing one of the attacker's connections:\n" + refused[-3000:]
    # After a wrong PROOF: nothing but the CHALLENGE, and the rank closed the connection.
    # Our HELLO claims a real pair of ranks, so the rank answers it and the wrong MAC is tested.
    assert any(c for c, _, _ in attacker.bad_proofs), f"no HELLO got a CHALLENGE: {attacker.bad_proofs[:5]}"
    for got_challenge, after, closed in attacker.bad_proofs:
        assert after == b"" and closed, (got_challenge, after[:80], closed)
    assert not attacker.leaks, attacker.leaks[:5]
