"""Ranks on "hosts" made of network namespaces (netns.py), for the tests between hosts.

A layout is the number of ranks on each host, e.g. ``(2, 2)``; ranks are numbered host by host.
Local rank ``i`` of host ``h`` lives in ``h``'s namespace, advertises its rail-``i`` address
(``XCCL_RS_SOCKET_HOST``) and names its host (``XCCL_RS_HOST_ID``), as a rank of a cluster with
one NIC per local rank would. The test's TCPStore stays on the machine's loopback, outside the
fabric under test.

Inter-host transports: ``tcp`` (the default, ``XCCL_RS_TRANSPORT`` unset) and ``ofi`` (libfabric's
tcp provider, ``XCCL_RS_TRANSPORT=ofi``), skipped with the reason where this build or machine
has no OFI transport.
"""

from __future__ import annotations

import functools
import os
import re
from datetime import timedelta

import netns
from harness import ctx

OFI_PROVIDER = "tcp;ofi_rxm"  # libfabric's tcp provider: runs on any Linux (NOTES: checked on veth)
TRANSPORT_ENV = {
    "tcp": {},
    "ofi": {"XCCL_RS_TRANSPORT": "ofi", "FI_PROVIDER": OFI_PROVIDER},
}


def placement(layout) -> list[tuple[int, int]]:
    """(host, local index) of every rank, ranks numbered host by host."""
    return [(h, i) for h, n in enumerate(layout) for i in range(n)]


def rank_env(hosts: netns.NamespaceHosts, layout, transport: str = "tcp", **extra):
    """The harness's per-rank environment for `layout` on `hosts`."""
    where = placement(layout)

    def env(rank):
        h, i = where[rank]
        return {
            "XCCL_RS_TEST_NETNS": hosts.names[h],
            "XCCL_RS_SOCKET_HOST": hosts.address(h, i),
            "XCCL_RS_HOST_ID": f"netns-{h}",
            **TRANSPORT_ENV[transport],
            **extra,
        }

    return env


def init_in_namespace(rank, world_size, **kw):
    """Connects to the test's store (on the machine's loopback), then enters this rank's host
    and creates the default group there; returns the store."""
    import torch.distributed as dist
    import xccl_rs  # noqa: F401

    store = ctx().connect_store()
    netns.enter(os.environ["XCCL_RS_TEST_NETNS"])
    _store_from_outside()
    dist.init_process_group("xccl_rs", rank=rank, world_size=world_size, store=store, **kw)
    return store


def _store_from_outside() -> None:
    """Later ``ctx().connect_store()`` calls (the collectives sweep's barrier checks) connect from
    the namespace the rank started in, where the store listens."""
    context = ctx()
    plain = context.connect_store

    def connect_store():
        with netns.outside():
            return plain()

    context.connect_store = connect_store


@functools.lru_cache(maxsize=None)
def ofi_unavailable() -> str | None:
    """None where this build of xccl_rs accepts XCCL_RS_TRANSPORT=ofi, else why not (a group of
    one rank, in this process: whether libfabric then works between hosts is the tests' to say)."""
    import ctypes.util

    import torch
    import torch.distributed as dist
    import xccl_rs

    if ctypes.util.find_library("fabric") is None:
        return "libfabric is not installed (Debian: apt install libfabric1)"
    saved = {k: os.environ.get(k) for k in TRANSPORT_ENV["ofi"]}
    os.environ.update(TRANSPORT_ENV["ofi"])
    try:
        group = xccl_rs.new_group(dist.HashStore(), 0, 1, timeout=timedelta(seconds=30))
        group.allreduce([torch.ones(4)]).wait()
        xccl_rs.destroy_group(group)
    except Exception as e:  # noqa: BLE001 - the reason for the skip
        return f"XCCL_RS_TRANSPORT=ofi does not work here: {str(e).strip().splitlines()[0][:300]}"
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return None


def shm_files_of(pids) -> list[str]:
    """The files in /dev/shm that processes `pids` created (xccl_rs names them <prefix><pid>-<token>)."""
    made = re.compile(rf"\D({'|'.join(str(p) for p in pids)})-[0-9a-f]{{32}}$")
    return sorted(name for name in os.listdir("/dev/shm") if made.search(name))
