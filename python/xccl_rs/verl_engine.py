"""A verl checkpoint engine, ``"xccl_rs"``: the trainer ranks send weights to the rollout workers
over a private xccl_rs process group, with :mod:`xccl_rs.weight_sync` -- trainer rank 0 alone
(``senders: rank0``, the default), or every trainer rank its share (``senders: all``).

Use it from a verl config::

    actor_rollout_ref.rollout.checkpoint_engine.backend: xccl_rs
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module: xccl_rs.verl_engine
    actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs:
      xccl_rs: {rebuild_group: false, device: cuda, timeout_s: 600, senders: all}

verl imports ``custom_backend_module`` in every trainer and rollout worker, which registers
the engine in ``verl.checkpoint_engine.CheckpointEngineRegistry``. Importing this module
without verl installed does nothing (``XcclRsCheckpointEngine`` is then ``None``).

How an update runs (verl's ``CheckpointEngineManager.update_weights``):

1. ``prepare()`` on every worker. The master (trainer rank 0, ``is_master=True``) starts a
   TCPStore on a free port once and reports its address; every worker reports the group it
   holds (if any).
2. ``build_topology`` (a classmethod, in the manager): the ``S`` senders are group ranks
   ``0 .. S-1`` -- trainer rank 0 alone (``senders: rank0``; the other trainer ranks get rank
   -1, not in the group), or every trainer rank (``senders: all``); rollout worker ``i`` is
   group rank ``S + i``. The group is kept when every member already holds the same one
   (same master, generation, size and rank) and ``rebuild_group`` is off; otherwise a new
   generation is built on the store prefix ``<group_name>/gen<generation>/`` (so elastic
   changes of either side rebuild it).
3. ``init_process_group(rank, world_size, master, generation)`` builds the group with
   ``xccl_rs.new_group``.
4. ``send_weights`` on every trainer rank (rank -1 ranks drain the generator, since producing
   the weights is collective over the trainers) and ``receive_weights`` on the rollout side.
   With ``senders: all`` every trainer rank is given the same weights: whole tensors (what
   verl's generators yield, ``full_tensor()`` on every rank) are shared out bucket by bucket,
   and DTensors (a trainer's FSDP2 state dict as it is) are sent shard by shard, each rank its
   own, never gathered (docs/usage.md, "Several senders").
5. ``finalize()`` frees the buckets, and the group too when ``rebuild_group``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from .weight_sync import DEFAULT_BUCKET_BYTES, WeightReceiver, WeightSender, WeightSyncError

logger = logging.getLogger(__name__)

__all__ = ["XcclRsCheckpointEngine", "make_group", "destroy_group"]


def make_group(store, rank: int, world_size: int, timeout: timedelta, device=None, name: str = "xccl_rs_verl"):
    """A private xccl_rs ProcessGroup on ``store`` (nothing registered in the default world)."""
    import xccl_rs

    return xccl_rs.new_group(store, rank, world_size, timeout=timeout, device=device, name=name)


def destroy_group(pg) -> None:
    import xccl_rs

    try:
        xccl_rs.destroy_group(pg)
    except Exception as e:  # noqa: BLE001 - a dead peer must not stop the next rebuild
        logger.warning("xccl_rs verl engine: destroying the weight-sync group failed: %s", e)


def _node_address() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address().strip("[]")
    except Exception:  # noqa: BLE001
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _default_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    return "cpu"


async def _drain(weights) -> None:
    if hasattr(weights, "__aiter__"):
        async for _ in weights:
            pass
    else:
        for _ in weights:
            pass


async def _aiter(weights):
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


_END = object()


class _EngineImpl:
    """The engine; combined with verl's ``CheckpointEngine`` base below when verl imports.

    Args (``engine_kwargs``):
        bucket_size: bucket bytes (verl passes ``update_weights_bucket_megabytes << 20``).
        is_master: trainer rank 0 (verl passes it on the trainer side).
        group_name: store prefix of the group.
        rebuild_group: build a new group at every update (and destroy it in ``finalize``).
        device: where received tensors are placed (default: the accelerator, else CPU).
        bucket_device: where buckets live (default CPU; "xpu"/"cuda" keeps them on the device,
            which xccl_rs stages through pinned host memory).
        timeout_s: the group's collective timeout, and the rendezvous timeout.
        master_addr / master_port: address the master's TCPStore binds and advertises
            (default: Ray's node IP / the host's address, and a free port).
        progress: show a tqdm bar on long syncs.
        senders: ``"rank0"`` (trainer rank 0 sends everything; the others only drain their
            generator) or ``"all"`` (every trainer rank sends its share; each must be given
            the same weights, or DTensors that are shards of them).
    """

    def __init__(
        self,
        bucket_size: int = DEFAULT_BUCKET_BYTES,
        is_master: bool = False,
        group_name: str = "xccl_rs_weight_sync",
        rebuild_group: bool = False,
        device: Optional[str] = None,
        bucket_device: str = "cpu",
        timeout_s: float = 600.0,
        master_addr: Optional[str] = None,
        master_port: int = 0,
        progress: bool = False,
        senders: str = "rank0",
        **unused: Any,
    ) -> None:
        if unused:
            logger.info("xccl_rs verl engine: ignoring engine kwargs %s", sorted(unused))
        self.bucket_size = int(bucket_size)
        self.is_master = bool(is_master)
        self.group_name = group_name
        self.rebuild_group = bool(rebuild_group)
        self.device = device
        self.bucket_device = bucket_device
        self.timeout = timedelta(seconds=float(timeout_s))
        self.master_addr = master_addr
        self.master_port = int(master_port)
        self.progress = bool(progress)
        if senders not in ("rank0", "all"):
            raise ValueError(f"xccl_rs verl engine: senders must be 'rank0' or 'all', got {senders!r}")
        self.senders = senders
        self.n_senders = 1  # the group's first ranks send (from build_topology)
        self.nonce = uuid.uuid4().hex if self.is_master else None
        self.rank: Optional[int] = None
        self.world_size: Optional[int] = None
        self.group = None
        self.group_key = None  # (master nonce, generation, world_size, rank)
        self.generation = 0  # the master's latest generation
        self._server = None  # the master's TCPStore
        self._client = None  # (addr, port, store) of a non-master worker
        self._sender: Optional[WeightSender] = None
        self._receiver: Optional[WeightReceiver] = None

    # ---- topology -----------------------------------------------------------------------

    def prepare(self) -> dict:
        meta = {"is_master": self.is_master, "group": self.group_key}
        if self.is_master:
            if self._server is None:
                addr = self.master_addr or _node_address()
                self._server = dist.TCPStore(
                    addr, self.master_port, None, True, timeout=self.timeout, wait_for_workers=False
                )
                self._addr = addr
            meta.update(addr=self._addr, port=self._server.port, nonce=self.nonce,
                        generation=self.generation, rebuild_group=self.rebuild_group, senders=self.senders)
        return meta

    @classmethod
    def build_topology(cls, actor_world_size: int, rollout_world_size: int, metadata: list):
        master = metadata[0]
        if not (isinstance(master, dict) and master.get("is_master")):
            raise ValueError(
                "xccl_rs verl engine: metadata[0] must come from the master (trainer rank 0 with "
                f"is_master=True), got {master!r}"
            )
        n_send = actor_world_size if master.get("senders", "rank0") == "all" else 1
        world_size = n_send + rollout_world_size
        actor_ranks = list(range(n_send)) + [-1] * (actor_world_size - n_send)
        rollout_ranks = list(range(n_send, world_size))
        members = [(metadata[i], i) for i in range(n_send)] + [
            (metadata[actor_world_size + i], rollout_ranks[i]) for i in range(rollout_world_size)
        ]
        gen = master["generation"]
        keep = (
            gen > 0
            and not master["rebuild_group"]
            and all(
                m.get("group") is not None and tuple(m["group"]) == (master["nonce"], gen, world_size, r)
                for m, r in members
            )
        )
        generation = gen if keep else gen + 1
        where = {"addr": master["addr"], "port": master["port"], "nonce": master["nonce"]}
        actor_kwargs = {
            "rank": actor_ranks,
            "world_size": [world_size] * actor_world_size,
            "master_metadata": [where] * actor_world_size,
            "generation": [generation] * actor_world_size,
        }
        rollout_kwargs = {
            "rank": rollout_ranks,
            "world_size": [world_size] * rollout_world_size,
            "master_metadata": [where] * rollout_world_size,
            "generation": [generation] * rollout_world_size,
        }
        if n_send > 1:
            actor_kwargs["senders"] = [n_send] * actor_world_size
            rollout_kwargs["senders"] = [n_send] * rollout_world_size
        return actor_kwargs, rollout_kwargs

    def init_process_group(self, rank: int, world_size: int, master_metadata: dict, generation: int, senders: int = 1):
        """Joins (or keeps) the group of ``generation``; group ranks ``0 .. senders-1`` send."""
        self.rank, self.world_size, self.n_senders = rank, world_size, int(senders)
        if rank < 0:
            return
        key = (master_metadata["nonce"], generation, world_size, rank)
        if self.group is not None and self.group_key == key:
            return
        self._drop_group()
        if self.is_master:
            store = self._server
        else:
            addr, port = master_metadata["addr"], master_metadata["port"]
            if self._client is None or self._client[:2] != (addr, port):
                self._client = (addr, port, dist.TCPStore(addr, port, None, False, timeout=self.timeout))
            store = self._client[2]
        prefix = dist.PrefixStore(f"{self.group_name}/gen{generation}/", store)
        self.group = make_group(prefix, rank, world_size, self.timeout, device=self.bucket_device)
        self.group_key = key
        if self.is_master:
            self.generation = generation
        logger.info("xccl_rs verl engine: rank %d of %d, generation %d", rank, world_size, generation)

    def _drop_group(self) -> None:
        if self._sender is not None:
            self._sender.release()
        self._sender = self._receiver = None
        if self.group is not None:
            destroy_group(self.group)
        self.group = None
        self.group_key = None

    def _forget_group_after_failure(self, error: BaseException) -> None:
        """A failed sync may leave the group failed on every member (a dead or stalled peer), and
        a failed group refuses every later op. So this worker gives it up: its next
        ``prepare()`` reports no group, and the next update builds a new generation (with
        whichever workers are alive then) even with ``rebuild_group`` off."""
        logger.warning("xccl_rs verl engine: the sync failed (%s); the next update builds a new group", error)
        if self._receiver is not None:
            self._receiver.release()
        self._drop_group()

    def finalize(self):
        if self._sender is not None:
            self._sender.release()
        if self._receiver is not None:
            self._receiver.release()
        if self.rebuild_group:
            self._drop_group()

    # ---- transfer -----------------------------------------------------------------------

    def _check_member(self, what: str) -> None:
        if self.rank is None:
            raise RuntimeError(f"xccl_rs verl engine: {what} before init_process_group")

    async def send_weights(self, weights, global_steps: Optional[int] = None):
        """On every trainer rank: the senders send (their shares); the others only drain ``weights``."""
        self._check_member("send_weights")
        if self.rank < 0:
            await _drain(weights)
            return {}
        if self.rank >= self.n_senders:
            raise RuntimeError(f"xccl_rs verl engine: rank {self.rank} is a rollout rank; it cannot send")
        if self._sender is None:
            self._sender = WeightSender(self.group, bucket_bytes=self.bucket_size, device=self.bucket_device,
                                        senders=list(range(self.n_senders)))
        stream = self._sender.stream(progress=self.progress)
        name = "<first tensor>"
        try:
            async for name, tensor in _aiter(weights):
                stream.add(name, tensor)
                await asyncio.sleep(0)
            stats = await asyncio.to_thread(stream.finish)
        except BaseException as e:
            stream.abort(f"{type(e).__name__} after {name!r}: {e}")
            self._forget_group_after_failure(e)
            raise
        logger.info("xccl_rs verl engine: step %s sent %s", global_steps, stats)
        return {
            "xccl_rs/sync_seconds": stats.seconds,
            "xccl_rs/sync_bytes": stats.bytes,
            "xccl_rs/sync_gbps": stats.gbps,
        }

    async def receive_weights(self, global_steps: Optional[int] = None):
        """On every rollout rank: an async generator of ``(name, tensor)``. The blocking waits
        run in a worker thread, so the event loop stays free."""
        self._check_member("receive_weights")
        if self.rank < self.n_senders:
            raise RuntimeError(f"xccl_rs verl engine: rank {self.rank} does not receive weights")
        if self._receiver is None:
            self._receiver = WeightReceiver(
                self.group, bucket_bytes=self.bucket_size, device=self.device or _default_device(),
                bucket_device=self.bucket_device, senders=list(range(self.n_senders)),
            )
        it = self._receiver.receive(progress=self.progress)
        try:
            while True:
                try:
                    item = await asyncio.to_thread(next, it, _END)
                except BaseException as e:
                    self._forget_group_after_failure(e)
                    raise
                if item is _END:
                    break
                yield item
        finally:
            try:
                it.close()
            except ValueError:  # still running in the worker thread (the consumer was cancelled)
                pass
        logger.info("xccl_rs verl engine: step %s received %s", global_steps, self._receiver.last_stats)


try:
    from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
except ImportError:  # verl is optional
    CheckpointEngine = CheckpointEngineRegistry = None
    XcclRsCheckpointEngine = None
else:

    @CheckpointEngineRegistry.register("xccl_rs")
    class XcclRsCheckpointEngine(_EngineImpl, CheckpointEngine):
        __doc__ = _EngineImpl.__doc__

        def __init__(self, bucket_size: int, is_master: bool = False, **engine_kwargs: Any) -> None:
            _EngineImpl.__init__(self, bucket_size=bucket_size, is_master=is_master, **engine_kwargs)

