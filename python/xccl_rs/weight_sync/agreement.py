"""What the ranks of a sync agree on, without a message per tensor: who sends (the hello, once per
sync) and, with several senders, that they all planned the same buckets (a round record before
every round). Both are all-gathers of a few int64s (format.py), so every rank sees every rank's
answer and every rank raises the same error, naming the ranks that differ.

Every sender computes the plan from the tensors it is given (plan.py), and a :class:`PlanHash` of
what the plan was computed from: each tensor's name, dtype and shape, and for a DTensor its mesh
and placements, after the bucket size and the number of senders. Two senders with the same hash
have the same rounds, buckets, offsets and owners. The hash is compared before every round,
so a sender given other tensors (another order, another shape) stops the sync before the first
bucket that would differ goes out, and a producer that fails on one sender stops every rank at
the same place (the round record says ``ABORTED``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional

import torch

from ._common import WeightSyncError, all_gather
from .format import (
    ABORTED_ROUND, FINAL, NO_PAYLOAD, PAYLOAD_NAMES, RECEIVING, SENDING, STATUS_NAMES, Hello, RoundRecord,
)


def senders_hash(senders: list[int], size: int) -> int:
    """A 63-bit hash of the senders' group ranks (in order) and the group's size."""
    raw = ",".join(map(str, [size, *senders])).encode()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") & ((1 << 63) - 1)


class PlanHash:
    """A running 63-bit hash of what a sender planned (the module docstring says of what)."""

    def __init__(self, bucket_bytes: int, senders: int):
        self._h = hashlib.blake2b(digest_size=8)
        self.add(f"xccl_rs weight sync|{bucket_bytes}|{senders}")

    def add(self, token: str) -> None:
        self._h.update(token.encode("utf-8", "surrogatepass") + b"\0")

    @property
    def value(self) -> int:
        return int.from_bytes(self._h.digest(), "little") & ((1 << 63) - 1)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def hello(
    group, senders: list[int], host: int, device: torch.device, payload: int = NO_PAYLOAD, sync: int = 0
) -> list[Hello]:
    """Step 1 of every sync, on every rank: each rank's :class:`Hello` (``host``: its host hash, or
    -1 when it will not share memory; ``payload``: a sender's payload code, and ``sync`` the
    version its delta sync brings). Raises when the ranks disagree about who sends, when a
    receiver says it sends a payload or a sender none, and when the senders' payloads differ."""
    mine = Hello(senders_hash(senders, group.size()), host, payload, sync)
    records = [
        Hello.decode(v, f"the hello from rank {r}")
        for r, v in enumerate(all_gather(group, torch.tensor(mine.encode(), dtype=torch.int64, device=device)))
    ]
    differ = [r for r, h in enumerate(records) if h.senders != mine.senders]
    if differ:
        same = [r for r, h in enumerate(records) if h.senders == mine.senders]
        raise WeightSyncError(
            f"weight sync: the ranks disagree about who sends: {_ranks(same)} name the senders {senders}, "
            f"{_ranks(differ)} other ones (every rank of the group must pass the same senders, in the same order)"
        )
    for r, h in enumerate(records):
        if (h.payload == NO_PAYLOAD) != (r not in senders):
            raise WeightSyncError(
                f"weight sync: the hello from rank {r} says payload {h.payload}, not "
                f"{'a receiver' if r not in senders else 'a sender'}'s"
            )
    payloads: dict[int, list[int]] = {}
    for s in senders:
        payloads.setdefault(records[s].payload, []).append(s)
    if len(payloads) > 1:
        shown = "; ".join(f"{_ranks(ranks)}: payload={PAYLOAD_NAMES[p]!r}" for p, ranks in sorted(payloads.items()))
        raise WeightSyncError(
            f"weight sync: the senders were made with different payloads ({shown}); every sender of a group must "
            "pass the same WeightSender(payload=...)"
        )
    return records


def window_hosts(records: list[Hello], senders: list[int]) -> list[bool]:
    """For each sender, whether it makes a shared window: it offers one (its host is not -1) and
    every receiver is on its host and can map one."""
    receivers = [r for r in range(len(records)) if r not in senders]
    return [records[s].host >= 0 and all(records[r].host == records[s].host for r in receivers) for s in senders]


@dataclass(frozen=True)
class Outcome:
    """What the round records of every rank say."""

    final: bool = False
    #: The first sender (group rank) whose producer failed: it sends its abort notice next.
    aborted_by: Optional[int] = None


def agree_round(group, senders: list[int], round: int, mine: RoundRecord, device: torch.device) -> Outcome:
    """The round records of every rank (all-gather), checked alike on every rank: every sender
    planned the same (same hash, all final or none), or one aborted. Raises otherwise."""
    where = f"the agreement before round {round}"
    values = all_gather(group, torch.tensor(mine.encode(), dtype=torch.int64, device=device))
    records = [RoundRecord.decode(v, f"{where}: the record of rank {r}", round) for r, v in enumerate(values)]
    for r, rec in enumerate(records):
        want = "a sender's" if r in senders else "a receiver's"
        if (rec.status == RECEIVING) == (r in senders):
            raise WeightSyncError(f"weight sync: {where}: rank {r} is {STATUS_NAMES[rec.status]}, not {want} status")
    aborted = [s for s in senders if records[s].status == ABORTED_ROUND]
    if aborted:
        return Outcome(aborted_by=aborted[0])
    plans: dict[tuple[int, bool], list[int]] = {}
    for s in senders:
        plans.setdefault((records[s].plan, records[s].status == FINAL), []).append(s)
    if len(plans) > 1:
        groups = sorted(plans.items(), key=lambda kv: kv[1])
        shown = "; ".join(
            f"{_ranks(ranks)}: plan {plan:#018x}{', last round' if final else ''}" for (plan, final), ranks in groups
        )
        raise WeightSyncError(
            f"weight sync: {where}: the senders planned different buckets ({shown}). Every sender must be "
            "given the same tensors (names, dtypes, shapes, DTensor placements) in the same order, with the same "
            "bucket_bytes"
        )
    ((_, final),) = plans
    return Outcome(final=final)


__all__ = ["PlanHash", "Outcome", "agree_round", "hello", "window_hosts", "senders_hash",
           "RECEIVING", "SENDING", "FINAL", "ABORTED_ROUND"]
