"""The OFI transport end to end: ranks as processes with XCCL_RS_TRANSPORT=ofi over libfabric's
tcp provider on loopback, each posing as a host of its own (XCCL_RS_HOST_ID) or two to a host, so
that the steps between hosts cross libfabric. all_reduce, broadcast and all_gather are compared
with torch ops on every rank's inputs, regenerated locally from their seeds. A provider that
does not exist must fail every rank, with an exit status and a message naming it.

Without libfabric.so.1 the tests skip, saying why; as root (the test machines, where
scripts/setup.sh installs it) they fail instead.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import harness
from harness import IS_GLOO, free_port

pytestmark = pytest.mark.skipif(IS_GLOO, reason="xccl_rs transport")


def _libfabric_missing() -> str | None:
    try:
        ctypes.CDLL("libfabric.so.1")
        return None
    except OSError as e:
        if os.geteuid() == 0:
            pytest.fail(f"libfabric.so.1 is missing ({e}); as root scripts/setup.sh installs it")
        return f"libfabric.so.1 is missing ({e}): apt-get install libfabric1"


WORKER = textwrap.dedent(
    """
    import sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    import xccl_rs
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])

    def inputs(r, n, salt):
        g = torch.Generator().manual_seed(1000 * salt + r)
        return torch.randint(-50, 50, (n,), generator=g).to(torch.float32)

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    try:
        dist.init_process_group("xccl_rs", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
        for salt, n in enumerate([1, 1000, 400_000]):
            t = inputs(rank, n, salt)
            dist.all_reduce(t)
            want = torch.stack([inputs(r, n, salt) for r in range(world)]).sum(0)
            assert torch.equal(t, want), f"all_reduce of {n}"
            for root in range(world):
                t = inputs(rank, n, salt + 10 * root)
                dist.broadcast(t, src=root)
                assert torch.equal(t, inputs(root, n, salt + 10 * root)), f"broadcast of {n} from {root}"
            out = torch.empty(world * n)
            dist.all_gather_into_tensor(out, inputs(rank, n, salt))
            assert torch.equal(out, torch.cat([inputs(r, n, salt) for r in range(world)])), f"all_gather of {n}"
        dist.barrier()
        dist.destroy_process_group()
    except Exception as e:
        print("ERROR", type(e).__name__, e, flush=True)
        sys.exit(3)
    print("DONE", flush=True)
    """
)


def _run(tmp_path, hosts, env, rank_env=None, worker=WORKER):
    """Runs `worker` on one process per entry of `hosts` over OFI; `rank_env` adds variables
    for one rank ({rank: {name: value}})."""
    script = tmp_path / "worker.py"
    script.write_text(worker)
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(len(hosts)), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(os.environ, XCCL_RS_TRANSPORT="ofi", XCCL_RS_HOST_ID=hosts[r], **env, **(rank_env or {}).get(r, {})),
        )
        for r in range(len(hosts))
    ]
    return harness.collect_outputs(procs, timeout_s=420)


@pytest.mark.parametrize(
    "hosts,settings,logged",
    [
        (["a", "b"], {}, "tags=64 tag bits"),
        (["a", "b", "c"], {}, "wait_fd=true"),
        (["a", "a", "b", "b"], {}, "tags=64 tag bits"),
        # cxi's tag width, and the 20 bits MPICH gives CXI.
        (["a", "b", "c"], {"XCCL_RS_OFI_TAG_BITS": "48"}, "tags=48 tag bits"),
        (["a", "a", "b", "b"], {"XCCL_RS_OFI_TAG_BITS": "20"}, "tags=20 tag bits"),
        # No wait descriptor, as on efa: the ranks busy-poll.
        (["a", "b", "c"], {"XCCL_RS_OFI_WAIT_FD": "0"}, "wait_fd=false"),
    ],
    ids=["2x1", "3x1", "2x2", "3x1-48-bit-tags", "2x2-20-bit-tags", "3x1-no-wait-fd"],
)
def test_collectives_over_ofi_match_torch(tmp_path, hosts, settings, logged):
    if why := _libfabric_missing():
        pytest.skip(why)
    env = {"FI_PROVIDER": "tcp;ofi_rxm", "XCCL_RS_LOG": "info", **settings}
    for rank, (rc, out) in enumerate(_run(tmp_path, hosts, env)):
        assert rc == 0 and "DONE" in out, f"rank {rank}:\n{out}"
        assert "xccl_rs OFI endpoint ready" in out and "tcp;ofi_rxm" in out, f"rank {rank} did not use OFI:\n{out}"
        assert logged in out, f"rank {rank} did not run with {settings}:\n{out}"


def test_a_provider_that_does_not_exist_fails_every_rank(tmp_path):
    if why := _libfabric_missing():
        pytest.skip(why)
    for rank, (rc, out) in enumerate(_run(tmp_path, ["a", "b"], {"FI_PROVIDER": "no_such_provider"})):
        assert rc == 3, f"rank {rank} exited {rc}:\n{out}"
        assert 'FI_PROVIDER="no_such_provider"' in out, f"rank {rank}:\n{out}"



CUT_DIFFERENTLY = """
import os
rank = int(os.environ["RANK"])
os.environ.update(XCCL_RS_TRANSPORT="ofi", FI_PROVIDER="tcp;ofi_rxm", XCCL_RS_HOST_ID="ab"[rank])
if rank == 1:
    os.environ["FI_OFI_RXM_BUFFER_SIZE"] = "65536"  # larger messages on this rank only
import torch, torch.distributed as dist, xccl_rs
dist.init_process_group("xccl_rs")
dist.all_reduce(torch.ones(1000))  # the exception ends the script
"""


def test_ranks_that_cut_messages_differently_end_every_rank_at_set_up(tmp_path):
    """Over tcp;ofi_rxm a payload goes as messages of the eager limit, which
    FI_OFI_RXM_BUFFER_SIZE raises: ranks that disagree could not match each other's messages.
    Run by torchrun with the exception uncaught, every rank exits 1, saying what differs."""
    if why := _libfabric_missing():
        pytest.skip(why)
    from test_script_exit import assert_clean_exit, torchrun_each_rank

    results, _ = torchrun_each_rank(tmp_path, CUT_DIFFERENTLY, 2, wait_for=[0, 1])
    assert_clean_exit(results, "different cutting rules")
    for rank, (_, out) in results.items():
        assert "cut libfabric messages differently" in out and "FI_OFI_RXM_BUFFER_SIZE" in out, f"rank {rank}:\n{out[-4000:]}"


SEND_AND_LEAVE = textwrap.dedent(
    """
    import sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    import xccl_rs
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    store = dist.TCPStore("127.0.0.1", port, world, rank == 1, timeout=timedelta(seconds=60))
    dist.init_process_group("xccl_rs", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    want = torch.arange(3_000_000, dtype=torch.float32)  # 12 MB: hundreds of messages, not held
    try:
        if rank == 0:
            dist.send(want, dst=1)
            dist.destroy_process_group()
        else:
            got = torch.empty_like(want)
            dist.recv(got, src=0)
            assert torch.equal(got, want), "wrong data"
    except Exception as e:
        print("ERROR", type(e).__name__, e, flush=True)
        sys.exit(3)
    print("DONE", flush=True)
    """
)


def test_a_large_message_sent_just_before_its_sender_exits_is_received(tmp_path):
    """Rank 0 sends 12 MB, more than it holds for a receiver that has not asked, then leaves
    at once: every message of it must still reach rank 1."""
    if why := _libfabric_missing():
        pytest.skip(why)
    for rank, (rc, out) in enumerate(_run(tmp_path, ["a", "b"], {"FI_PROVIDER": "tcp;ofi_rxm"}, worker=SEND_AND_LEAVE)):
        assert rc == 0 and "DONE" in out, f"rank {rank}:\n{out}"


LAST_WORDS = textwrap.dedent(
    """
    import os, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    import xccl_rs
    rank, port, signal_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    # Rank 1 serves the store: rank 0 leaves early.
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 1, timeout=timedelta(seconds=60))
    dist.init_process_group("xccl_rs", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=20))
    dist.barrier()  # libfabric's connection between the two is made
    want = torch.arange(1000, dtype=torch.float32)
    if rank == 0:
        while not os.path.exists(os.path.join(signal_dir, "go")):
            time.sleep(0.01)
        dist.send(want, dst=1)
        dist.destroy_process_group()  # waits until libfabric has the send's bytes
        os._exit(0)  # the control connection closes at once
    got = torch.empty(1000)
    open(os.path.join(signal_dir, "receiving"), "w").close()
    try:
        dist.recv(got, src=0)
    except Exception as e:
        print("ERROR", type(e).__name__, e, flush=True)
        sys.exit(3)
    assert torch.equal(got, want), "wrong data"
    print("DONE", flush=True)
    """
)


def test_a_message_sent_just_before_its_sender_exits_is_received(tmp_path):
    """Rank 1 waits in a receive and is stopped (SIGSTOP) while rank 0 sends and exits, so
    that it wakes to both at once: the sender's control connection closed and its message still
    unread in libfabric's queue. It must take the message, not report the sender gone."""
    if why := _libfabric_missing():
        pytest.skip(why)
    script = tmp_path / "last_words.py"
    script.write_text(LAST_WORDS)
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(port), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(os.environ, XCCL_RS_TRANSPORT="ofi", XCCL_RS_HOST_ID="ab"[r], FI_PROVIDER="tcp;ofi_rxm"),
        )
        for r in range(2)
    ]
    deadline = time.monotonic() + 120
    while not (tmp_path / "receiving").exists() and time.monotonic() < deadline and procs[1].poll() is None:
        time.sleep(0.01)
    time.sleep(0.5)  # rank 1 is past its spin, asleep in poll(2)
    procs[1].send_signal(signal.SIGSTOP)
    try:
        (tmp_path / "go").touch()
        procs[0].wait(timeout=60)
        time.sleep(0.2)  # the message and the close are both there to be seen
    finally:
        procs[1].send_signal(signal.SIGCONT)
    (rc0, out0), (rc1, out1) = harness.collect_outputs(procs, timeout_s=120)
    assert rc0 == 0, f"rank 0:\n{out0}"
    assert rc1 == 0 and "DONE" in out1, f"rank 1:\n{out1}"


LOOKAHEAD = textwrap.dedent(
    """
    import sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    import xccl_rs
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("xccl_rs", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=20))

    def msg(src, tag, n):
        return torch.arange(n, dtype=torch.float32) + 1000 * src + tag

    try:
        # The issue's pattern: rank 0 receives tag 8 from any source (rank 1 sends it), which
        # leaves a look-ahead posted to rank 2; rank 2 then sends two tensors in one batch. (No
        # collective between: its message from rank 2 would take the look-ahead.)
        if rank == 1:
            dist.send(msg(1, 8, 16), dst=0, tag=8)
        elif rank == 0:
            got = torch.empty(16)
            assert dist.recv(got, src=None, tag=8) == 1 and torch.equal(got, msg(1, 8, 16))
        if rank == 2:
            time.sleep(1)  # rank 0's look-ahead is posted by then
            ops = [dist.P2POp(dist.isend, msg(2, t, 5000 * (t - 29)), 0, tag=t) for t in (30, 31)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        elif rank == 0:
            bufs = {t: torch.empty(5000 * (t - 29)) for t in (30, 31)}
            for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, bufs[t], 2, tag=t) for t in (30, 31)]):
                w.wait()
            for t, b in bufs.items():
                assert torch.equal(b, msg(2, t, b.numel())), f"tag {t}"
        # A collective with the look-ahead to rank 1 or 2 still posted, then the group's end.
        if rank == 0:
            got = torch.empty(4)
            src = dist.recv(got, src=None, tag=9)
            assert src == 1 and torch.equal(got, msg(1, 9, 4))
        elif rank == 1:
            dist.send(msg(1, 9, 4), dst=0, tag=9)
        t = torch.full((1000,), float(rank))
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((1000,), float(sum(range(world)))))
        dist.destroy_process_group()
    except Exception as e:
        print("ERROR", type(e).__name__, e, flush=True)
        sys.exit(3)
    print("DONE", flush=True)
    """
)


def test_two_receives_from_a_peer_left_with_a_look_ahead(tmp_path):
    """A receive from any source leaves a header receive (a look-ahead) posted to each peer
    that did not match. A later batch of two receives from such a peer hung every rank until the
    timeout; each must now take its own header, and a collective and the group's end after it
    must still work."""
    if why := _libfabric_missing():
        pytest.skip(why)
    started = time.monotonic()
    for rank, (rc, out) in enumerate(_run(tmp_path, ["a", "b", "c"], {"FI_PROVIDER": "tcp;ofi_rxm"}, worker=LOOKAHEAD)):
        assert rc == 0 and "DONE" in out, f"rank {rank}:\n{out}"
    assert time.monotonic() - started < 60, "the ranks waited for a timeout"


def test_xccl_rs_ofi_domain_opens_the_nic_it_names(tmp_path):
    """XCCL_RS_OFI_DOMAIN names the libfabric domain (NIC) each local rank opens: `lo` is one
    that tcp;ofi_rxm has here, and that it would pass over by itself."""
    if why := _libfabric_missing():
        pytest.skip(why)
    env = {"FI_PROVIDER": "tcp;ofi_rxm", "XCCL_RS_LOG": "info", "XCCL_RS_OFI_DOMAIN": "lo"}
    for rank, (rc, out) in enumerate(_run(tmp_path, ["a", "b"], env)):
        assert rc == 0 and "DONE" in out, f"rank {rank}:\n{out}"
        assert "domain=lo" in out and "XCCL_RS_OFI_DOMAIN entry 0" in out, f"rank {rank}:\n{out}"


NO_SUCH_DOMAIN = """
import os
rank = int(os.environ["RANK"])
os.environ.update(XCCL_RS_TRANSPORT="ofi", FI_PROVIDER="tcp;ofi_rxm", XCCL_RS_HOST_ID="ab"[rank], XCCL_RS_OFI_DOMAIN="no_such_nic")
import torch, torch.distributed as dist, xccl_rs
dist.init_process_group("xccl_rs")
dist.all_reduce(torch.ones(10))  # the exception ends the script
"""


def test_a_domain_the_provider_lacks_ends_every_rank_at_set_up(tmp_path):
    """Run by torchrun with the exception uncaught, every rank exits 1, naming the variable and
    the domains the provider has (loopback among them)."""
    if why := _libfabric_missing():
        pytest.skip(why)
    from test_script_exit import assert_clean_exit, torchrun_each_rank

    results, _ = torchrun_each_rank(tmp_path, NO_SUCH_DOMAIN, 2, wait_for=[0, 1])
    assert_clean_exit(results, "a domain the provider lacks")
    for rank, (_, out) in results.items():
        assert 'XCCL_RS_OFI_DOMAIN names "no_such_nic"' in out and '"lo"' in out, f"rank {rank}:\n{out[-4000:]}"
