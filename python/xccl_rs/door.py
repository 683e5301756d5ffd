"""The door layer: what every way into the weight sync shares.

A *door* is one way a user drives :mod:`xccl_rs.weight_sync`: the plain roles
(:class:`~xccl_rs.weight_sync.WeightSender` and :class:`~xccl_rs.weight_sync.WeightReceiver`
over a group the user makes), verl's checkpoint engine (verl_engine.py) and vLLM's
weight-transfer engine (vllm_engine/). The engines keep only what their framework's calls
require (verl's topology and async generators; vLLM's sessions, rounds and model loading); this
module is the rest, written once:

* the options a user sets, whichever door (:class:`SyncOptions`): who sends (``senders``), what
  travels (``payload``), whether buckets may go through the shared window (``shared_memory``),
  the bucket size, the timeout, the groups' backend -- checked once, each error naming the door;
* who sends (:func:`pick_senders`): trainer rank 0 alone (``"rank0"``), every trainer rank
  (``"all"``), or the trainer ranks on trainer rank 0's node (``"node"``: several senders that
  share one host's memory bandwidth with nothing in between). The senders are always group
  ranks ``0 .. S-1``, in trainer-rank order, and the receivers come after them;
* the address a trainer's store is served at (:func:`node_address`) and the store
  (:class:`TrainerStore`: served by one trainer process, reached by the others and by the
  receivers);
* generations: each process group is built on a store prefix of its own
  (:func:`generation_store`), so a rebuilt group never reads an older one's keys;
* one generation's group as a rank holds it, and its role there (:class:`SyncGroup`): built
  with :func:`xccl_rs.new_group` (or gloo's, for comparisons), the role made with the options
  at first use, and everything given up at once after a failure.
"""

from __future__ import annotations

import logging
import re
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

from .weight_sync import DEFAULT_BUCKET_BYTES, WeightReceiver, WeightSender
from .weight_sync.delta import BASES
from .weight_sync.format import MAX_BUCKET_BYTES, MIN_BUCKET_BYTES
from .weight_sync.fp8 import SCALES

logger = logging.getLogger(__name__)

#: Who sends: trainer rank 0 alone, every trainer rank its share, or the trainer ranks on trainer
#: rank 0's node.
SENDERS = ("rank0", "all", "node")
#: What travels: the tensors as they are, only what changed since the last sync, or fp8
#: (weight_sync/delta.py, weight_sync/fp8.py).
PAYLOADS = ("full", "delta", "fp8")
#: The process groups a door can run on: xccl_rs's (the default), or gloo's, for comparisons
#: (``python -m xccl_rs.bench_vllm``) and as a fallback.
GROUP_BACKENDS = ("xccl_rs", "gloo")


def node_address() -> str:
    """The address other hosts reach this one at, by one rule for every door: Ray's node IP when
    this process is in a Ray cluster (Ray imported and initialised: the address Ray's own nodes
    use, where a host name may resolve to a loopback alias such as Debian's 127.0.1.1), else the
    address this host's name resolves to, else loopback."""
    ray = sys.modules.get("ray")  # never imported here: a process in a Ray cluster has it already
    if ray is not None:
        try:
            if ray.is_initialized():
                return ray.util.get_node_ip_address().strip("[]")
        except Exception as e:  # noqa: BLE001 - a broken Ray must not stop the sync
            logger.debug("xccl_rs: Ray's node address is not available (%s)", e)
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _choice(who: str, name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{who}: {name} {value!r} is not one of {choices}")


@dataclass(frozen=True)
class SyncOptions:
    """What a user sets, the same through every door (verl's ``engine_kwargs``, vLLM's
    ``XcclRsTrainerInitInfo``), checked at construction with ``who`` (the door) in every error.

    The payload's options are :class:`WeightSender`'s: ``fp8_scale`` (``"block"``,
    ``"channel"``, ``"tensor"``) and ``fp8_select`` with ``payload="fp8"`` -- here also a
    regular expression, matched (``re.search``) against each tensor's name, for doors configured
    by text (verl's YAML, vLLM's JSON) -- and ``delta_base`` (``"copy"``, ``"cpu"``) with
    ``payload="delta"``. They and ``shared_memory`` matter on the senders only: a receiver learns
    the payload from the wire and offers the shared window whenever its buckets are on the CPU."""

    who: str = "weight sync"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    senders: str = "rank0"
    payload: str = "full"
    fp8_scale: str = "block"
    fp8_select: Union[None, str, Callable] = None
    delta_base: str = "copy"
    #: None: the shared window where the group is an xccl_rs group on one host; False: never.
    shared_memory: Optional[bool] = None
    timeout_s: float = 600.0
    group_backend: str = "xccl_rs"

    def __post_init__(self) -> None:
        _choice(self.who, "senders", self.senders, SENDERS)
        _choice(self.who, "payload", self.payload, PAYLOADS)
        _choice(self.who, "fp8_scale", self.fp8_scale, SCALES)
        _choice(self.who, "delta_base", self.delta_base, BASES)
        _choice(self.who, "group_backend", self.group_backend, GROUP_BACKENDS)
        if self.shared_memory not in (None, True, False):
            raise ValueError(f"{self.who}: shared_memory {self.shared_memory!r} is not None, True or False")
        if not MIN_BUCKET_BYTES <= int(self.bucket_bytes) <= MAX_BUCKET_BYTES:
            raise ValueError(f"{self.who}: bucket_bytes {self.bucket_bytes} is not in [{MIN_BUCKET_BYTES}, "
                             f"{MAX_BUCKET_BYTES}]")
        if not float(self.timeout_s) > 0:
            raise ValueError(f"{self.who}: timeout_s {self.timeout_s!r} is not a positive number of seconds")
        if isinstance(self.fp8_select, str):
            try:
                re.compile(self.fp8_select)
            except re.error as e:
                raise ValueError(f"{self.who}: fp8_select {self.fp8_select!r} is not a regular expression: {e}") from e
        elif self.fp8_select is not None and not callable(self.fp8_select):
            raise ValueError(f"{self.who}: fp8_select must be a regular expression or a callable(name, tensor), "
                             f"got {type(self.fp8_select).__name__}")

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=float(self.timeout_s))

    def sender_kwargs(self) -> dict:
        """The keyword arguments of :class:`WeightSender` that these options set."""
        out = {"bucket_bytes": int(self.bucket_bytes), "shared_memory": self.shared_memory, "payload": self.payload}
        if self.payload == "fp8":
            select = self.fp8_select
            if isinstance(select, str):
                pattern = re.compile(select)
                select = lambda name, tensor: pattern.search(name) is not None  # noqa: E731
            out.update(fp8_scale=self.fp8_scale, fp8_select=select)
        elif self.payload == "delta":
            out["delta_base"] = self.delta_base
        return out


def pick_senders(mode: str, trainers: int, hosts: Optional[list] = None) -> list[int]:
    """The trainer ranks that send, in order (they are group ranks ``0 .. S-1``): ``[0]``
    (``"rank0"``), every one (``"all"``), or those whose host (``hosts[r]``, e.g.
    :func:`node_address` of each) is trainer rank 0's (``"node"``)."""
    _choice("weight sync", "senders", mode, SENDERS)
    if trainers < 1:
        raise ValueError(f"weight sync: {trainers} trainer ranks leave no sender")
    if mode == "rank0":
        return [0]
    if mode == "all":
        return list(range(trainers))
    if hosts is None or len(hosts) != trainers:
        raise ValueError(f"weight sync: senders 'node' needs the host of each of the {trainers} trainer ranks")
    return [r for r in range(trainers) if hosts[r] == hosts[0]]


class TrainerStore:
    """The TCPStore of a trainer: served by one trainer process (:meth:`serve`), reached by the
    others and by the receivers (:meth:`connect`). Every group of the door is built on it,
    under a prefix of its own."""

    def __init__(self, store: dist.TCPStore, address: str, served: bool):
        self.store = store
        self.address = address
        self.port = int(store.port)
        self.served = served

    @classmethod
    def serve(cls, address: Optional[str], port: int, timeout: timedelta) -> "TrainerStore":
        """Serves a store at ``address`` (default: :func:`node_address`) and ``port`` (0: a free one)."""
        address = address or node_address()
        store = dist.TCPStore(address, int(port), None, True, timeout=timeout, wait_for_workers=False)
        return cls(store, address, True)

    @classmethod
    def connect(cls, address: str, port: int, timeout: timedelta) -> "TrainerStore":
        return cls(dist.TCPStore(address, int(port), None, False, timeout=timeout), address, False)

    def reaches(self, address: str, port: int) -> bool:
        """Whether this is the store at ``address:port`` (a client kept between updates)."""
        return (self.address, self.port) == (address, int(port))

    def under(self, prefix: str) -> dist.PrefixStore:
        return dist.PrefixStore(prefix.rstrip("/") + "/", self.store)


def generation_store(root: dist.Store, generation: int) -> dist.PrefixStore:
    """The store of generation ``generation``'s group, under ``root`` (a door's own prefix)."""
    return dist.PrefixStore(f"gen/{int(generation)}/", root)


def make_group(store, rank: int, world_size: int, timeout: timedelta, device=None, name: str = "xccl_rs_weight_sync",
               backend: str = "xccl_rs"):
    """A private process group on ``store`` (nothing registered in the default world): xccl_rs's
    (:func:`xccl_rs.new_group`, its buckets' ``device`` bound), or gloo's."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    from . import new_group

    return new_group(store, rank, world_size, timeout=timeout, device=device, name=name)


def destroy_group(group) -> None:
    """Destroys a group of :func:`make_group`; never raises (a dead peer must not stop the next
    generation)."""
    from . import destroy_group as destroy

    if not isinstance(group, dist.ProcessGroup):
        return  # a gloo backend object: it goes with its last reference
    try:
        destroy(group)
    except Exception as e:  # noqa: BLE001
        logger.warning("xccl_rs: destroying a weight-sync group failed: %s", e)


class SyncGroup:
    """One generation's process group as this rank holds it, and this rank's role there: a
    :class:`WeightSender` (group ranks ``0 .. S-1``) or a :class:`WeightReceiver`, made with the
    options at first use and kept, with its buffers and shared window, while the group is.

    ``key`` says which group it is (a door's own record: a generation number, or the master,
    generation, size and rank); :meth:`holds` compares it."""

    def __init__(self, options: SyncOptions, name: str = "xccl_rs_weight_sync"):
        self.options = options
        self.name = name
        self.group = None
        self.key = None
        self.n_senders = 1
        self.role = None  # WeightSender or WeightReceiver

    def holds(self, key) -> bool:
        return self.group is not None and self.key == key

    def join(self, root: dist.Store, generation: int, rank: int, world_size: int, n_senders: int, key=None,
             device=None) -> None:
        """Gives up any group held and joins generation ``generation``'s (on
        :func:`generation_store` of ``root``) as group rank ``rank``; returns when every rank
        has joined. ``device``: where the group's buffers live (xccl_rs binds it)."""
        self.drop()
        if not 1 <= n_senders < world_size:
            raise ValueError(f"{self.options.who}: {n_senders} senders in a group of {world_size} ranks leave "
                             "no receiver")
        self.group = make_group(generation_store(root, generation), rank, world_size, self.options.timeout, device,
                                self.name, self.options.group_backend)
        self.key = generation if key is None else key
        self.n_senders = int(n_senders)

    @property
    def senders(self) -> list[int]:
        return list(range(self.n_senders))

    def sender(self, device=None) -> WeightSender:
        """This rank's sender (made at first use, with the options), buckets on ``device``."""
        if self.role is None:
            self.role = WeightSender(self.group, senders=self.senders, device=device, **self.options.sender_kwargs())
        return self.role

    def receiver(self, device=None, bucket_device=None) -> WeightReceiver:
        """This rank's receiver (made at first use): tensors on ``device``, buckets on ``bucket_device``."""
        if self.role is None:
            self.role = WeightReceiver(self.group, senders=self.senders, bucket_bytes=int(self.options.bucket_bytes),
                                       device=device, bucket_device=bucket_device)
        return self.role

    def release(self) -> None:
        """Frees the role's buffers and shared window; the group and the role stay."""
        if self.role is not None:
            try:
                self.role.release()
            except Exception as e:  # noqa: BLE001 - a failed transfer may still hold them
                logger.warning("%s: releasing the buckets failed: %s", self.options.who, e)

    def drop(self) -> None:
        """Gives the group up with its role (after a failure, or for the next generation)."""
        self.release()
        self.role = None
        if self.group is not None:
            destroy_group(self.group)
        self.group = None
        self.key = None


def default_device() -> str:
    """Where received tensors go when a door is not told: the accelerator, else the CPU."""
    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    return "cpu"
