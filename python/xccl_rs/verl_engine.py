"""A verl checkpoint engine, ``"xccl_rs"``: the trainer ranks send weights to the rollout workers
over a private xccl_rs process group, with :mod:`xccl_rs.weight_sync` -- trainer rank 0 alone
(``senders: rank0``, the default), every trainer rank its share (``senders: all``), or the
trainer ranks on trainer rank 0's node (``senders: node``).

Use it from a verl config::

    actor_rollout_ref.rollout.checkpoint_engine.backend: xccl_rs
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module: xccl_rs.verl_engine
    actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs:
      xccl_rs: {rebuild_group: false, device: cuda, timeout_s: 600, senders: all, payload: full}

verl imports ``custom_backend_module`` in every trainer and rollout worker, which registers
the engine in ``verl.checkpoint_engine.CheckpointEngineRegistry``. Importing this module
without verl installed does nothing (``XcclRsCheckpointEngine`` is then ``None``).

This file keeps what verl's interface requires; the options, the store, the senders, the
groups and the roles are the door layer's (door.py), shared with the vLLM engine.

How an update runs (verl's ``CheckpointEngineManager.update_weights``):

1. ``prepare()`` on every worker. The master (trainer rank 0, ``is_master=True``) starts a
   TCPStore on a free port once and reports its address; every worker reports the group it
   holds (if any), and with ``senders: node`` its node's address.
2. ``build_topology`` (a classmethod, in the manager): the ``S`` senders
   (:func:`xccl_rs.door.pick_senders`) are group ranks ``0 .. S-1`` in trainer-rank order; the
   other trainer ranks get rank -1 (not in the group); rollout worker ``i`` is group rank
   ``S + i``. The group is kept when every member already holds the same one (same master,
   generation, size and rank) and ``rebuild_group`` is off; otherwise a new generation is built
   on its own store prefix (so elastic changes of either side rebuild it).
3. ``init_process_group(rank, world_size, master, generation)`` builds the group with
   ``xccl_rs.new_group``.
4. ``send_weights`` on every trainer rank (rank -1 ranks drain the generator, since producing
   the weights is collective over the trainers) and ``receive_weights`` on the rollout side.
   With several senders every sender is given the same weights: whole tensors (what verl's
   generators yield, ``full_tensor()`` on every rank) are shared out bucket by bucket, and
   DTensors (a trainer's FSDP2 state dict as it is; ``senders: all`` only, the mesh being every
   trainer rank) are sent shard by shard, each rank its own, never gathered (docs/usage.md,
   "Several senders").
5. ``finalize()`` frees the buckets, and the group too when ``rebuild_group``.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Optional

from .door import SyncGroup, SyncOptions, TrainerStore, default_device, destroy_group, make_group, node_address, pick_senders
from .weight_sync import DEFAULT_BUCKET_BYTES

logger = logging.getLogger(__name__)

__all__ = ["XcclRsCheckpointEngine", "make_group", "destroy_group"]

WHO = "xccl_rs verl engine"


async def _drain(weights) -> None:
    async for _ in _aiter(weights):
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
        group_name: store prefix of the groups.
        rebuild_group: build a new group at every update (and destroy it in ``finalize``).
        device: where received tensors are placed (default: the accelerator, else CPU).
        bucket_device: where buckets live (default CPU; "xpu"/"cuda" keeps them on the device,
            which xccl_rs stages through pinned host memory).
        timeout_s: the group's collective timeout, and the rendezvous timeout.
        master_addr / master_port: address the master's TCPStore binds and advertises
            (default: :func:`xccl_rs.door.node_address` -- Ray's node IP in a Ray cluster --
            and a free port).
        progress: show a tqdm bar on long syncs.
        senders: ``"rank0"`` (trainer rank 0 sends everything; the others only drain their
            generator), ``"all"`` (every trainer rank sends its share; each must be given the
            same weights, or DTensors that are shards of them) or ``"node"`` (the trainer ranks
            on trainer rank 0's node send their shares of the same full tensors; the others drain).
        payload: ``"full"`` (the tensors as they are), ``"delta"`` (only what changed since the
            version every rollout holds) or ``"fp8"`` (the selected weights as float8_e4m3fn
            with float32 scales): what the senders put on the wire (the rollouts learn it
            from there). ``fp8_scale`` (``"block"``, ``"channel"``, ``"tensor"``) and
            ``fp8_select`` (a regular expression on the names; default: the 2-D ``...weight``
            tensors but embeddings, the head and norms) go with ``"fp8"``, ``delta_base``
            (``"copy"``, ``"cpu"``: where the senders keep what they sent) with ``"delta"``.
        shared_memory: ``None`` (the shared window when every rank is on one host) or ``False``
            (the buckets are always sent).
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
        payload: str = "full",
        fp8_scale: str = "block",
        fp8_select: Optional[str] = None,
        delta_base: str = "copy",
        shared_memory: Optional[bool] = None,
        **unused: Any,
    ) -> None:
        if unused:
            logger.info("%s: ignoring engine kwargs %s", WHO, sorted(unused))
        self.options = SyncOptions(who=WHO, bucket_bytes=int(bucket_size), senders=senders, payload=payload,
                                   fp8_scale=fp8_scale, fp8_select=fp8_select, delta_base=delta_base,
                                   shared_memory=shared_memory, timeout_s=timeout_s)
        self.bucket_size = int(bucket_size)
        self.is_master = bool(is_master)
        self.group_name = group_name
        self.rebuild_group = bool(rebuild_group)
        self.device = device
        self.bucket_device = bucket_device
        self.timeout = self.options.timeout
        self.master_addr = master_addr
        self.master_port = int(master_port)
        self.progress = bool(progress)
        self.senders = senders
        self.n_senders = 1  # the group's first ranks send (from build_topology)
        self.nonce = uuid.uuid4().hex if self.is_master else None
        self.rank: Optional[int] = None
        self.world_size: Optional[int] = None
        self.sync = SyncGroup(self.options, name="xccl_rs_verl")  # its key: (master nonce, generation, world_size, rank)
        self.generation = 0  # the master's latest generation
        self._store: Optional[TrainerStore] = None  # the master's (served), or a client of it

    @property
    def group(self):
        return self.sync.group

    @property
    def group_key(self):
        return self.sync.key

    # ---- topology -----------------------------------------------------------------------

    def prepare(self) -> dict:
        meta = {"is_master": self.is_master, "group": self.sync.key}
        if self.senders == "node":
            meta["host"] = node_address()
        if self.is_master:
            if self._store is None:
                self._store = TrainerStore.serve(self.master_addr, self.master_port, self.timeout)
            meta.update(addr=self._store.address, port=self._store.port, nonce=self.nonce,
                        generation=self.generation, rebuild_group=self.rebuild_group, senders=self.senders)
        return meta

    @classmethod
    def build_topology(cls, actor_world_size: int, rollout_world_size: int, metadata: list):
        master = metadata[0]
        if not (isinstance(master, dict) and master.get("is_master")):
            raise ValueError(
                f"{WHO}: metadata[0] must come from the master (trainer rank 0 with is_master=True), got {master!r}"
            )
        mode = master.get("senders", "rank0")
        hosts = [metadata[t].get("host") for t in range(actor_world_size)] if mode == "node" else None
        senders = pick_senders(mode, actor_world_size, hosts)
        n_send = len(senders)
        world_size = n_send + rollout_world_size
        actor_ranks = [senders.index(t) if t in senders else -1 for t in range(actor_world_size)]
        rollout_ranks = list(range(n_send, world_size))
        members = [(metadata[t], actor_ranks[t]) for t in senders] + [
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

        def kwargs(ranks: list) -> dict:
            n = len(ranks)
            out = {"rank": ranks, "world_size": [world_size] * n, "master_metadata": [where] * n,
                   "generation": [generation] * n}
            if n_send > 1:
                out["senders"] = [n_send] * n
            return out

        return kwargs(actor_ranks), kwargs(rollout_ranks)

    def init_process_group(self, rank: int, world_size: int, master_metadata: dict, generation: int, senders: int = 1):
        """Joins (or keeps) the group of ``generation``; group ranks ``0 .. senders-1`` send."""
        self.rank, self.world_size, self.n_senders = rank, world_size, int(senders)
        if rank < 0:
            return
        key = (master_metadata["nonce"], generation, world_size, rank)
        if self.sync.holds(key):
            return
        if not self.is_master:
            addr, port = master_metadata["addr"], master_metadata["port"]
            if self._store is None or not self._store.reaches(addr, port):
                self._store = TrainerStore.connect(addr, port, self.timeout)
        self.sync.join(self._store.under(self.group_name), generation, rank, world_size, self.n_senders, key=key,
                       device=self.bucket_device)
        if self.is_master:
            self.generation = generation
        logger.info("%s: rank %d of %d, generation %d", WHO, rank, world_size, generation)

    def _drop_group(self) -> None:
        self.sync.drop()

    def _forget_group_after_failure(self, error: BaseException) -> None:
        """A failed sync may leave the group failed on every member (a dead or stalled peer), and
        a failed group refuses every later op. So this worker gives it up: its next
        ``prepare()`` reports no group, and the next update builds a new generation (with
        whichever workers are alive then) even with ``rebuild_group`` off."""
        logger.warning("%s: the sync failed (%s); the next update builds a new group", WHO, error)
        self.sync.drop()

    def finalize(self):
        self.sync.release()
        if self.rebuild_group:
            self.sync.drop()

    # ---- transfer -----------------------------------------------------------------------

    def _check_member(self, what: str) -> None:
        if self.rank is None:
            raise RuntimeError(f"{WHO}: {what} before init_process_group")

    async def send_weights(self, weights, global_steps: Optional[int] = None):
        """On every trainer rank: the senders send (their shares); the others only drain ``weights``."""
        self._check_member("send_weights")
        if self.rank < 0:
            await _drain(weights)
            return {}
        if self.rank >= self.n_senders:
            raise RuntimeError(f"{WHO}: rank {self.rank} is a rollout rank; it cannot send")
        stream = self.sync.sender(self.bucket_device).stream(progress=self.progress)
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
        logger.info("%s: step %s sent %s", WHO, global_steps, stats)
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
            raise RuntimeError(f"{WHO}: rank {self.rank} does not receive weights")
        receiver = self.sync.receiver(self.device or default_device(), self.bucket_device)
        it = receiver.receive(progress=self.progress)
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
        logger.info("%s: step %s received %s", WHO, global_steps, receiver.last_stats)


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

