"""The trainer's session as both sides see it (no vLLM): its store keys, the members'
descriptions, and the process group of each generation."""

from __future__ import annotations

import logging
import socket
from datetime import timedelta

import torch.distributed as dist

logger = logging.getLogger("xccl_rs.vllm_engine")


GROUP_NAME = "xccl_rs_vllm"


def _node_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _publish(store, key: str, value: str) -> None:
    """``store.set``, visible to every other client when this returns. A TCPStore ``set`` gets no
    answer: a peer that reads right after (told through another channel, an RPC) can find the
    key missing (measured: 1273 misses in 20000 set-then-check pairs). A ``check`` on the same
    connection is answered after the ``set`` is applied."""
    store.set(key, value)
    store.check([key])


class _Keys:
    """The store keys of one trainer session (every one under ``<session>/``)."""

    MEMBERS = "members"  # counter: member ids are 1, 2, ...
    ROUND = "round"  # the round the trainer announced last

    @staticmethod
    def member(member: int) -> str:
        return f"member/{member}"

    @staticmethod
    def checkins(round_: int) -> str:
        return f"round/{round_}/n"

    @staticmethod
    def checkin(round_: int, slot: int) -> str:
        return f"round/{round_}/{slot}"

    @staticmethod
    def refusal(round_: int, rank: int) -> str:
        return f"round/{round_}/refused/{rank}"

    @staticmethod
    def outcome(round_: int) -> str:
        return f"round/{round_}/outcome"

    @staticmethod
    def generation(generation: int) -> str:
        return f"gen/{generation}/"


def _describe(info: dict) -> str:
    """``replica dp=1, rank 0 (pid 4242 on host-a)`` for a member's registration."""
    return f"replica dp={info.get('dp')}, rank {info.get('rank')} (pid {info.get('pid')} on {info.get('host')})"


#: The process groups a session can run on: xccl_rs's (the default), or gloo's, for comparisons
#: (``python -m xccl_rs.bench_vllm``) and as a fallback.
GROUP_BACKENDS = ("xccl_rs", "gloo")
#: Who sends (``XcclRsTrainerInitInfo.senders``): trainer rank 0 alone, or every trainer rank its share.
SENDERS = ("rank0", "all")


def _make_group(store, rank: int, world_size: int, timeout: timedelta, device, backend: str = "xccl_rs"):
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    from .. import new_group

    return new_group(store, rank, world_size, timeout=timeout, device=device, name=GROUP_NAME)


def _destroy_group(group) -> None:
    from .. import destroy_group

    if not isinstance(group, dist.ProcessGroup):
        return  # a gloo backend object: it goes with its last reference
    try:
        destroy_group(group)
    except Exception as e:  # noqa: BLE001 - a dead peer must not stop the next generation
        logger.warning("xccl_rs vLLM engine: destroying the transfer group failed: %s", e)
