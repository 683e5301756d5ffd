"""The trainer's session as both sides see it (no vLLM): its store keys and the members'
descriptions. The store, the groups of the generations and the options are the door layer's
(door.py)."""

from __future__ import annotations

from ..door import GROUP_BACKENDS, SENDERS  # noqa: F401 (this package's names)

#: The name of the xccl_rs process group of each generation.
GROUP_NAME = "xccl_rs_vllm"


def _publish(store, key: str, value: str) -> None:
    """``store.set``, visible to every other client when this returns. A TCPStore ``set`` gets no
    answer: a peer that reads right after (told through another channel, an RPC) can find the
    key missing (measured: 1273 misses in 20000 set-then-check pairs). A ``check`` on the same
    connection is answered after the ``set`` is applied."""
    store.set(key, value)
    store.check([key])


class _Keys:
    """The store keys of one trainer session (every one under ``<session>/``; each generation's
    group has ``gen/<g>/``, door.generation_store)."""

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


def _describe(info: dict) -> str:
    """``replica dp=1, rank 0 (pid 4242 on host-a)`` for a member's registration."""
    return f"replica dp={info.get('dp')}, rank {info.get('rank')} (pid {info.get('pid')} on {info.get('host')})"
