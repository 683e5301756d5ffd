"""A vLLM weight-transfer engine, ``"xccl_rs"``: a trainer broadcasts weights to vLLM's workers
over a private xccl_rs process group, with :mod:`xccl_rs.weight_sync`.

vLLM (0.28 and later) syncs an RL trainer's weights into its workers through engines picked by
name from ``vllm.distributed.weight_transfer``'s two factories: a worker side
(``WeightTransferEngine``, made in every vLLM worker from ``--weight-transfer-config``) and a
trainer side (``TrainerWeightTransferEngine``, made from an init info whose class names the
backend). This module is both for ``"xccl_rs"``, and registers them through vLLM's plugin entry
point (``vllm.general_plugins``, which vLLM calls in every process), so nothing needs importing::

    vllm serve ... --weight-transfer-config '{"backend": "xccl_rs"}'
    # or LLM(..., weight_transfer_config=WeightTransferConfig(backend="xccl_rs"))

    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
    from xccl_rs.vllm_engine import XcclRsTrainerInitInfo

    info = XcclRsTrainerInitInfo(master_address=my_ip, master_port=0, world_size=1 + n_workers,
                                 rank=trainer_rank, bucket_bytes=512 << 20)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(model))
    engine.send_weights()            # every step, on every trainer rank; rank 0 sends

How it runs. Terms: a *worker* is one vLLM worker process (a replica with tensor parallelism
``tp`` has ``tp`` of them, and every one receives the full tensors: each model's
``load_weights`` keeps its shard); a *member* is a worker known to the trainer's store; a
*round* is one ``send_weights``; a *generation* is one process group (trainer rank 0 plus
the round's members, in a fixed order).

1. ``trainer_init`` (trainer rank 0): serves a TCPStore (``master_port`` 0 picks a free port)
   and calls ``client.init_weight_transfer_engine`` with the worker init info: the store's
   address and port, ``rank_offset`` and ``world_size`` as vLLM's NCCL engine has them, the
   store prefix of this trainer's session, the timeout. No secret travels in it: every group's
   secret goes through the store, as for every xccl_rs group. Each worker connects to the store
   and registers as a member (who it is: data-parallel index, rank, host, pid). The trainer then
   checks that ``world_size - 1`` workers registered.
2. ``send_weights``: the trainer announces round ``k`` in the store and calls
   ``client.start_weight_update``, in which every worker checks in for round ``k`` (and starts
   vLLM's layerwise reload, as vLLM's NCCL engine does). The members that checked in are the
   round's members, ordered as vLLM's NCCL engine orders its ranks (``rank_offset + dp index *
   workers per replica + rank``), then by registration. When they differ from the last round's,
   or the last round failed, a new generation is built (``xccl_rs.new_group`` over the store
   prefix ``gen/<g>/``); otherwise the group, its buckets and its shared window are reused.
3. ``client.update_weights({"round", "generation", "members"})`` runs in a thread while the
   trainer sends: every worker receives the tensors (:class:`~xccl_rs.weight_sync.WeightReceiver`,
   each tensor in its own memory, on the worker's device) and loads each with the model's
   ``load_weights([(name, tensor)])`` as it arrives. Then every rank of the group votes on the
   outcome: a worker that refused a tensor has put its reason in the store, and every rank
   raises it. ``client.finish_weight_update`` finishes vLLM's layerwise reload.

Mismatches. The trainer checks that its source yields exactly what its metadata declares
(name, dtype, shape, in order), as vLLM's NCCL engine does; a difference aborts the round on every
rank, naming the tensor. A worker refuses a tensor its model's ``load_weights`` raises on (a
name the model does not have, a shape its loader rejects) or that the model would store in
another dtype than the one sent (the loader copies it into a tensor of another dtype: checked
while it loads); it stops loading, drains the rest of the round, and every rank then raises
naming the tensor and the worker.

Failures. A worker that dies or stalls fails the round on the trainer within the timeout, with an
error naming its group rank and who that is (replica, rank, host, pid); the other workers fail
too. Every rank of a failed round gives its group up, and a worker's layers go back to what they
held (layers received whole keep the new weights, the others the old ones: never a layer half
loaded). The next ``send_weights`` builds a new generation over the workers that check in: the
replicas left, once the client no longer calls the dead one, and any replica added since (its
workers get ``engine.worker_init_info`` through ``engine.init_workers(client)`` or the
client's ``init_weight_transfer_engine``; they get the full weights from their first round).

Memory: trainer rank 0 holds two buckets (``bucket_bytes`` each, kept between rounds); other
trainer ranks allocate nothing (they only run ``source.iter_full()`` for its collectives). A
worker holds two receive buckets and the tensor being loaded (vLLM's layerwise reload keeps a
layer's tensors until the layer is complete, as with vLLM's own engines). On one host the
buckets are a shared-memory window that the workers read in place.

Also here: :class:`TRLWeightTransfer`, TRL's ``WeightTransferProtocol`` on this engine (for TRL's
experimental async trainers), and ``group_backend="gloo"`` in the init info, the same rounds over
a gloo group (``python -m xccl_rs.bench_vllm`` compares the two). docs/usage.md ("vLLM, TRL,
SGLang") is the user's guide.

Importing this module does not import vLLM; its engine classes are made on first access.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, ClassVar, Optional

import torch
import torch.distributed as dist

from .weight_sync import DEFAULT_BUCKET_BYTES, WeightReceiver, WeightSender

logger = logging.getLogger(__name__)

BACKEND = "xccl_rs"
GROUP_NAME = "xccl_rs_vllm"
#: What ``register`` registers, and the classes this module makes on first access.
WORKER_ENGINE = "XcclRsWeightTransferEngine"
TRAINER_ENGINE = "XcclRsTrainerWeightTransferEngine"
_CLASSES = (
    WORKER_ENGINE,
    TRAINER_ENGINE,
    "XcclRsWeightTransferInitInfo",
    "XcclRsWeightTransferUpdateInfo",
    "XcclRsTrainerInitInfo",
)

__all__ = ["BACKEND", "TRLWeightTransfer", "WeightTransferError", "register", *_CLASSES]


class WeightTransferError(RuntimeError):
    """A round of the xccl_rs weight transfer failed; the message names the tensor or the worker."""


# --------------------------------------------------------------------------------------
# the plugin
# --------------------------------------------------------------------------------------


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point (pyproject.toml): registers ``"xccl_rs"`` with
    ``WeightTransferEngineFactory`` and ``WeightTransferTrainerFactory`` by module path, so the
    engine classes (and what they import) load only when one is made. vLLM calls it in every
    process, maybe more than once; it does nothing without vLLM and never raises."""
    try:
        from vllm.distributed.weight_transfer.factory import (
            WeightTransferEngineFactory,
            WeightTransferTrainerFactory,
        )
    except ImportError as e:
        logger.debug("xccl_rs: vLLM's weight-transfer factories are not importable (%s)", e)
        return
    for factory, cls in ((WeightTransferEngineFactory, WORKER_ENGINE), (WeightTransferTrainerFactory, TRAINER_ENGINE)):
        try:
            if BACKEND not in getattr(factory, "_registry", {}):
                factory.register_engine(BACKEND, __name__, cls)
        except Exception as e:  # noqa: BLE001 - a plugin that raises stops vLLM's start-up
            logger.warning("xccl_rs: registering the %r engine with %s failed: %s", BACKEND, factory.__name__, e)


def __getattr__(name: str):
    if name in _CLASSES:
        _make_classes()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------------------
# helpers shared by both sides (no vLLM)
# --------------------------------------------------------------------------------------


def _node_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _allreduce_min(group, ok: bool) -> bool:
    """Whether every rank of ``group`` says ``ok`` (a MIN all-reduce of a 0/1 flag)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    group.allreduce([flag], opts).wait()
    return bool(flag.item())


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
    def generation(generation: int) -> str:
        return f"gen/{generation}/"


def _describe(info: dict) -> str:
    """``replica dp=1, rank 0 (pid 4242 on host-a)`` for a member's registration."""
    return f"replica dp={info.get('dp')}, rank {info.get('rank')} (pid {info.get('pid')} on {info.get('host')})"


#: The process groups a session can run on: xccl_rs's (the default), or gloo's, for comparisons
#: (``python -m xccl_rs.bench_vllm``) and as a fallback.
GROUP_BACKENDS = ("xccl_rs", "gloo")


def _make_group(store, rank: int, world_size: int, timeout: timedelta, device, backend: str = "xccl_rs"):
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    from . import new_group

    return new_group(store, rank, world_size, timeout=timeout, device=device, name=GROUP_NAME)


def _destroy_group(group) -> None:
    from . import destroy_group

    if not isinstance(group, dist.ProcessGroup):
        return  # a gloo backend object: it goes with its last reference
    try:
        destroy_group(group)
    except Exception as e:  # noqa: BLE001 - a dead peer must not stop the next generation
        logger.warning("xccl_rs vLLM engine: destroying the transfer group failed: %s", e)


# --------------------------------------------------------------------------------------
# the worker side's model loading (no vLLM types)
# --------------------------------------------------------------------------------------


def _storage_ptr(t: torch.Tensor) -> Optional[int]:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def _dtype_guard():
    """A dispatch mode that refuses, while one tensor loads, any copy of its bytes into a tensor
    of another dtype (a model that would convert what the trainer sent)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten

    class DtypeGuard(TorchDispatchMode):
        def __init__(self, tensor: torch.Tensor):
            super().__init__()
            self.ptr = _storage_ptr(tensor)
            self.device = tensor.device

        def _ours(self, t) -> bool:
            return (
                isinstance(t, torch.Tensor) and t.device == self.device and self.ptr and _storage_ptr(t) == self.ptr
            )

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is aten.copy_.default and len(args) >= 2 and self._ours(args[1]):
                if args[0].dtype != args[1].dtype:
                    raise TypeError(f"the model stores it as {args[0].dtype}, the trainer sent {args[1].dtype}")
            elif func is aten._to_copy.default and args and self._ours(args[0]):
                dtype = kwargs.get("dtype")
                if dtype is not None and dtype != args[0].dtype:
                    raise TypeError(f"the model converts it to {dtype}, the trainer sent {args[0].dtype}")
            return func(*args, **kwargs)

    return DtypeGuard


def _load_one(model: torch.nn.Module, guard, name: str, tensor: torch.Tensor) -> None:
    """``model.load_weights([(name, tensor)])`` under the dtype guard."""
    with torch.no_grad(), guard(tensor):
        model.load_weights([(name, tensor)])


def _layerwise():
    """vLLM's layerwise reload (``vllm.model_executor.model_loader.reload``)."""
    try:
        from vllm.model_executor.model_loader import reload
        from vllm.model_executor.model_loader.reload import layerwise
    except ImportError as e:
        raise ImportError(f"xccl_rs.vllm_engine: vLLM's layerwise reload does not import: {e}") from e
    return reload, layerwise


def _cancel_layerwise_reload(model: torch.nn.Module) -> None:
    """Ends vLLM's layerwise reload after a failed round without processing half-loaded layers:
    each layer whose reload is still open gets its kernel tensors (the weights it held) back.
    Layers already complete keep the new weights. (vLLM's ``finalize_layerwise_reload`` would
    process a half-loaded layer with uninitialised memory for what did not arrive.)"""
    _, layerwise = _layerwise()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    for layer in model.modules():
        info = layerwise.LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load():
            continue
        if info.kernel_tensors is not None:
            layerwise._place_kernel_tensors(layer, info)
        info.reset()
    layerwise.LOADING_LAYERS.clear()


# --------------------------------------------------------------------------------------
# TRL
# --------------------------------------------------------------------------------------


class TRLWeightTransfer:
    """TRL's ``WeightTransferProtocol`` on this engine: pass it as ``weight_transfer=`` to TRL's
    experimental ``AsyncGRPOTrainer`` or ``AsyncDistillationTrainer`` (TRL 1.16), whose own
    default is vLLM's NCCL engine.

    ``vllm_client`` is TRL's ``trl.experimental.async_grpo.vllm_client.VLLMClient`` (its
    ``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights`` and
    ``finish_weight_update`` are vLLM's weight-sync calls over HTTP), for a server started with
    ``VLLM_SERVER_DEV_MODE=1 vllm serve ... --weight-transfer-config '{"backend": "xccl_rs"}'``.
    TRL calls it on its main process only; the other ranks run the weights' iterator themselves.
    The keyword arguments are :class:`XcclRsTrainerInitInfo`'s."""

    def __init__(self, vllm_client, *, master_address: str = "", master_port: int = 0,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 1800.0, device: str = "cpu",
                 worker_bucket_device: str = "cpu", group_backend: str = "xccl_rs") -> None:
        self.vllm = vllm_client
        self.options = dict(master_address=master_address, master_port=master_port, bucket_bytes=bucket_bytes,
                            timeout_s=timeout_s, device=device, worker_bucket_device=worker_bucket_device,
                            group_backend=group_backend)
        self.engine = None

    def init_weight_transfer(self) -> None:
        wait = getattr(self.vllm, "wait_for_server_ready", None)
        if wait is not None:
            wait()
        _make_classes()
        info = globals()["XcclRsTrainerInitInfo"](world_size=1 + int(self.vllm.get_world_size()), rank=0,
                                                  **self.options)
        self.engine = globals()[TRAINER_ENGINE].trainer_init(info, client=self.vllm, source=None)

    def pause(self) -> None:
        self.vllm.pause()

    def send_weights(self, iterator) -> None:
        if self.engine is None:
            raise RuntimeError("TRLWeightTransfer: send_weights before init_weight_transfer")
        self.engine.send_weights(iterator)

    def resume(self) -> None:
        self.vllm.resume()

    def destroy(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


# --------------------------------------------------------------------------------------
# the classes that subclass vLLM's (made on first access: importing vLLM is not cheap)
# --------------------------------------------------------------------------------------


def _make_classes() -> None:
    if all(n in globals() for n in _CLASSES):
        return
    try:
        from vllm.distributed.weight_transfer.base import (
            ParamMeta,
            TrainerInitInfo,
            TrainerWeightTransferEngine,
            WeightSource,
            WeightTransferEngine,
            WeightTransferInitInfo,
            WeightTransferUpdateInfo,
        )
    except ImportError as e:
        raise ImportError(f"xccl_rs.vllm_engine: the engine classes subclass vLLM's, and vLLM does not import: {e}") from e

    @dataclass(kw_only=True)
    class XcclRsWeightTransferInitInfo(WeightTransferInitInfo):
        """What every vLLM worker gets from the trainer at ``init_weight_transfer_engine`` (a
        plain dict on the wire: JSON and pickle both carry it). Like vLLM's NCCL init info:
        the trainer's store (``master_address``/``master_port``), ``rank_offset`` (1: the
        trainer is rank 0) and ``world_size`` (the trainer plus every worker at init); plus the
        store prefix of the trainer's session, the timeout, where receive buckets live, and the
        process groups' backend."""

        master_address: str
        master_port: int
        rank_offset: int = 1
        world_size: int
        session: str
        timeout_s: float = 600.0
        bucket_device: str = "cpu"
        group_backend: str = "xccl_rs"

        def __post_init__(self) -> None:
            if self.group_backend not in GROUP_BACKENDS:
                raise ValueError(f"XcclRsWeightTransferInitInfo: group_backend {self.group_backend!r} is not one of "
                                 f"{GROUP_BACKENDS}")
            if not 0 < int(self.master_port) < 65536:
                raise ValueError(f"XcclRsWeightTransferInitInfo: master_port {self.master_port} is not a port")
            if self.rank_offset < 1 or self.world_size <= self.rank_offset:
                raise ValueError(
                    f"XcclRsWeightTransferInitInfo: rank_offset {self.rank_offset} and world_size "
                    f"{self.world_size} leave no rank to the workers"
                )
            if not isinstance(self.session, str) or not self.session.strip("/"):
                raise ValueError(f"XcclRsWeightTransferInitInfo: session {self.session!r} is not a store prefix")

    @dataclass
    class XcclRsWeightTransferUpdateInfo(WeightTransferUpdateInfo):
        """One round, as the trainer tells every worker: the round number (which check-in it
        answers), the generation of the group and its members in group-rank order (rank 1
        first)."""

        round: int = 0
        generation: int = 0
        members: list = field(default_factory=list)

    @dataclass(kw_only=True)
    class XcclRsTrainerInitInfo(TrainerInitInfo):
        """The trainer side's init info (``rank`` is this trainer process's rank; rank 0 sends).

        ``master_address``: the address workers reach the trainer's store at (default: this
        host's); ``master_port``: the store's port, 0 for a free one; ``world_size``: 1 plus
        the number of vLLM workers (every worker of every replica). ``bucket_bytes``: the
        size of each of the trainer's two buckets (a tensor larger than one is split);
        ``timeout_s``: the group's and the store's timeout; ``device``: where the trainer's
        buckets live; ``worker_bucket_device``: where the workers' receive buckets live;
        ``group_backend``: ``"xccl_rs"``, or ``"gloo"`` (the same rounds over a gloo group, for
        comparisons: no shared window)."""

        backend: ClassVar[str] = BACKEND

        master_address: str = ""
        master_port: int = 0
        world_size: int
        bucket_bytes: int = DEFAULT_BUCKET_BYTES
        timeout_s: float = 600.0
        device: str = "cpu"
        worker_bucket_device: str = "cpu"
        group_backend: str = "xccl_rs"

    class XcclRsWeightTransferEngine(
        WeightTransferEngine[XcclRsWeightTransferInitInfo, XcclRsWeightTransferUpdateInfo]
    ):
        """The worker side (the module docstring says how a round runs)."""

        init_info_cls = XcclRsWeightTransferInitInfo
        update_info_cls = XcclRsWeightTransferUpdateInfo

        def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
            super().__init__(config, vllm_config, device, model)
            self._info: Optional[XcclRsWeightTransferInitInfo] = None
            self._store = None  # (client TCPStore, session PrefixStore)
            self._member: Optional[int] = None
            self._round: Optional[int] = None  # the round this worker checked in for
            self._group = None
            self._generation = 0
            self._receiver: Optional[WeightReceiver] = None
            self._reloading = False
            self._guard = _dtype_guard()
            self.last_stats = None

        # ---- set-up ------------------------------------------------------------------

        def _static_rank(self, info: XcclRsWeightTransferInitInfo) -> int:
            """This worker's rank in vLLM's NCCL engine (nccl_common._worker_group_rank)."""
            pc = self.parallel_config
            dp = int(getattr(pc, "data_parallel_index", 0) or 0)
            return info.rank_offset + dp * int(pc.world_size) + int(pc.rank)

        def init_transfer_engine(self, init_info: XcclRsWeightTransferInitInfo) -> None:
            """Connects to the trainer's store and registers this worker as a member."""
            self.shutdown()
            timeout = timedelta(seconds=float(init_info.timeout_s))
            client = dist.TCPStore(init_info.master_address, int(init_info.master_port), None, False, timeout=timeout)
            root = dist.PrefixStore(init_info.session.rstrip("/") + "/", client)
            pc = self.parallel_config
            me = {
                "dp": int(getattr(pc, "data_parallel_index", 0) or 0),
                "rank": int(pc.rank),
                "static_rank": self._static_rank(init_info),
                "host": socket.gethostname(),
                "pid": os.getpid(),
            }
            member = int(root.add(_Keys.MEMBERS, 1))
            _publish(root, _Keys.member(member), json.dumps(me))
            self._info, self._store, self._member = init_info, (client, root), member
            logger.info("xccl_rs vLLM engine: member %d of session %s (%s)", member, init_info.session, _describe(me))

        def _root(self):
            if self._store is None:
                raise RuntimeError("xccl_rs weight transfer is not initialised: call init_transfer_engine() first")
            return self._store[1]

        # ---- a round -----------------------------------------------------------------

        def start_weight_update(self) -> None:
            """Checks in for the round the trainer announced, then starts vLLM's layerwise
            reload (as vLLM's NCCL engine does)."""
            root = self._root()
            if not root.check([_Keys.ROUND]):
                raise RuntimeError(
                    "xccl_rs weight transfer: no round announced; start_weight_update must come from the "
                    "xccl_rs trainer engine's send_weights()"
                )
            round_ = int(root.get(_Keys.ROUND))
            slot = int(root.add(_Keys.checkins(round_), 1))
            _publish(root, _Keys.checkin(round_, slot), str(self._member))
            self._round = round_
            _layerwise()[0].initialize_layerwise_reload(self.model)
            self._reloading = True

        def update_weights(self, update_info: dict[str, Any]) -> None:
            typed = self.parse_update_info(update_info)
            self.receive_weights(typed)
            if torch.accelerator.is_available():  # the base class's sync, where there is a device
                torch.accelerator.synchronize()

        def _join(self, generation: int, members: list) -> None:
            """The group of ``generation`` (kept while the trainer keeps it)."""
            if self._group is not None and self._generation == generation:
                return
            self._drop_group()
            if self._member not in members:
                raise WeightTransferError(
                    f"xccl_rs weight transfer: this worker (member {self._member}) is not among generation "
                    f"{generation}'s members {members}: it did not check in at start_weight_update"
                )
            info = self._info
            rank = 1 + members.index(self._member)
            store = dist.PrefixStore(_Keys.generation(generation), self._root())
            timeout = timedelta(seconds=float(info.timeout_s))
            self._group = _make_group(store, rank, 1 + len(members), timeout, info.bucket_device, info.group_backend)
            self._generation = generation
            self._receiver = WeightReceiver(self._group, src=0, device=self.device, bucket_device=info.bucket_device)

        def _drop_group(self) -> None:
            if self._receiver is not None:
                self._receiver.release()
            self._receiver = None
            if self._group is not None:
                _destroy_group(self._group)
            self._group = None

        def _cancel_reload(self) -> None:
            """After a failed round: vLLM's layerwise reload ends, each layer holding whole weights."""
            if self._reloading:
                self._reloading = False
                try:
                    _cancel_layerwise_reload(self.model)
                except Exception as e:  # noqa: BLE001
                    logger.warning("xccl_rs vLLM engine: cancelling the layerwise reload failed: %s", e)

        def _failed(self) -> None:
            """After a round that failed in transit: the group is given up too."""
            self._drop_group()
            self._cancel_reload()

        def receive_weights(self, update_info: XcclRsWeightTransferUpdateInfo) -> None:
            root = self._root()
            k = int(update_info.round)
            if self._round != k:
                raise RuntimeError(
                    f"xccl_rs weight transfer: update_weights for round {k}, but this worker checked in for "
                    f"round {self._round} (start_weight_update comes first)"
                )
            try:
                self._join(int(update_info.generation), [int(m) for m in update_info.members])
            except BaseException as e:
                self._failed()
                if isinstance(e, WeightTransferError):
                    raise
                raise WeightTransferError(f"xccl_rs weight transfer: round {k}: joining the group failed: {e}") from e
            rank = self._group.rank()
            refused: Optional[str] = None
            try:
                for name, tensor in self._receiver.receive(copy=True):
                    if refused is not None:
                        continue  # drained: the sender waits for every receiver
                    try:
                        _load_one(self.model, self._guard, name, tensor)
                    except Exception as e:  # noqa: BLE001 - the model's refusal, whatever it raised
                        refused = f"{name!r}: {type(e).__name__}: {e}"
                    del tensor
                if refused is not None:
                    _publish(root, _Keys.refusal(k, rank), refused)
                all_ok = _allreduce_min(self._group, refused is None)
            except Exception as e:
                self._failed()
                raise WeightTransferError(
                    f"xccl_rs weight transfer: round {k} failed on group rank {rank}: {e}; the next round "
                    "builds a new group"
                ) from e
            self.last_stats = self._receiver.last_stats
            if refused is not None:
                self._cancel_reload()  # the group ran the round to its end: kept
                raise WeightTransferError(f"xccl_rs weight transfer: round {k}: this worker (group rank {rank}) "
                                          f"refused {refused}")
            if not all_ok:
                self._cancel_reload()  # the group ran the round to its end: kept
                raise WeightTransferError(
                    f"xccl_rs weight transfer: round {k}: another worker refused a tensor (the trainer's error "
                    "names it); the round is void on every worker"
                )

        def finish_weight_update(self) -> None:
            """Finishes vLLM's layerwise reload (as vLLM's NCCL engine does)."""
            self._reloading = False
            _layerwise()[0].finalize_layerwise_reload(self.model, self.model_config)

        def shutdown(self) -> None:
            self._drop_group()
            self._store = None
            self._info = None
            self._member = None
            self._round = None

    class XcclRsTrainerWeightTransferEngine(TrainerWeightTransferEngine[XcclRsTrainerInitInfo]):
        """The trainer side (the module docstring says how a round runs). Every trainer rank
        calls ``trainer_init`` and ``send_weights``; rank 0 sends, the others only run the
        source's iteration (for its collectives) and allocate nothing."""

        init_info_cls = XcclRsTrainerInitInfo

        def __init__(self, *, client, source, is_sender: bool = True, rank: int = 0,
                     info: Optional[XcclRsTrainerInitInfo] = None) -> None:
            super().__init__(client=client, source=source, is_sender=is_sender, rank=rank)
            self.info = info
            self.timeout = timedelta(seconds=float(info.timeout_s if info is not None else 600.0))
            self._server = None  # the TCPStore (rank 0)
            self._root = None  # its session prefix
            self.session = ""
            self.address = ""
            self.port = 0
            self._round = 0
            self._generation = 0
            self._group = None
            self._members: list[int] = []
            self._sender: Optional[WeightSender] = None
            self._who: dict[int, dict] = {}  # member id -> its registration
            self.last_stats = None

        @classmethod
        def trainer_init(cls, init_info: XcclRsTrainerInitInfo, *, client, source: Optional[WeightSource] = None):
            # Without a source, every send_weights() gets its tensors as an argument.
            if source is not None and not source.implements_iter_full():
                raise TypeError(
                    f"xccl_rs broadcast sends full tensors, but {type(source).__name__} does not implement iter_full()"
                )
            for m in source.metadata if source is not None else ():  # the same on every rank: all raise alike
                if m.owners is not None and m.owners[0] != 0:
                    raise ValueError(
                        f"parameter {m.name!r} is sent by its first owner, rank {m.owners[0]}, but the xccl_rs "
                        "engine has a single sender, rank 0: every parameter's owners must start at rank 0"
                    )
            if init_info.group_backend not in GROUP_BACKENDS:
                raise ValueError(f"XcclRsTrainerInitInfo: group_backend {init_info.group_backend!r} is not one of "
                                 f"{GROUP_BACKENDS}")
            if int(init_info.world_size) < 2:
                raise ValueError(f"XcclRsTrainerInitInfo: world_size {init_info.world_size} leaves no vLLM worker")
            engine = cls(client=client, source=source, is_sender=init_info.is_sender, rank=init_info.rank,
                         info=init_info)
            if not engine.is_sender:
                return engine
            engine._serve()
            try:
                engine.init_workers(client)
                registered = int(engine._root.add(_Keys.MEMBERS, 0))
                if registered != init_info.world_size - 1:
                    raise ValueError(
                        f"xccl_rs weight transfer: world_size {init_info.world_size} means "
                        f"{init_info.world_size - 1} vLLM workers, but {registered} registered"
                    )
            except BaseException:
                engine.shutdown()
                raise
            return engine

        # ---- set-up ------------------------------------------------------------------

        def _serve(self) -> None:
            info = self.info
            self.address = info.master_address or _node_address()
            self._server = dist.TCPStore(
                self.address, int(info.master_port), None, True, timeout=self.timeout, wait_for_workers=False
            )
            self.port = int(self._server.port)
            self.session = f"xccl_rs_vllm/{uuid.uuid4().hex}"
            self._root = dist.PrefixStore(self.session + "/", self._server)

        @property
        def worker_init_info(self) -> dict:
            """The init info every worker gets (``init_weight_transfer_engine``'s payload)."""
            if self._root is None:
                raise RuntimeError("xccl_rs trainer engine: only trainer rank 0 has the worker init info")
            info = XcclRsWeightTransferInitInfo(
                master_address=self.address,
                master_port=self.port,
                rank_offset=1,
                world_size=int(self.info.world_size),
                session=self.session,
                timeout_s=float(self.info.timeout_s),
                bucket_device=str(self.info.worker_bucket_device),
                group_backend=str(self.info.group_backend),
            )
            return asdict(info)

        def init_workers(self, client) -> None:
            """Initialises the engines of the workers behind ``client`` (at ``trainer_init``, and
            for a replica started later: it gets the full weights from the next round on)."""
            client.init_weight_transfer_engine(self.worker_init_info)

        # ---- a round -----------------------------------------------------------------

        def _checked_in(self, k: int) -> list[int]:
            """The members that checked in for round ``k``, in group-rank order."""
            root = self._root
            n = int(root.add(_Keys.checkins(k), 0))
            if n == 0:
                return []
            ids = [int(v) for v in root.multi_get([_Keys.checkin(k, i) for i in range(1, n + 1)])]
            for m in ids:
                if m not in self._who:
                    self._who[m] = json.loads(root.get(_Keys.member(m)))
            return sorted(set(ids), key=lambda m: (int(self._who[m].get("static_rank", 0)), m))

        def _who_is(self, rank: int) -> str:
            if 1 <= rank <= len(self._members):
                return _describe(self._who.get(self._members[rank - 1], {}))
            return ""

        def _named(self, text: str) -> str:
            """Who the workers are whose group ranks ``text`` names (the trainer is rank 0)."""
            ranks = sorted({int(r) for r in re.findall(r"\branks? \[?(\d+)", text)})
            who = [f"rank {r} = {self._who_is(r)}" for r in ranks if self._who_is(r)]
            return (". Group ranks named above: " + "; ".join(who)) if who else ""

        def _cancel(self) -> None:
            """Best effort after a round failed before any worker received: vLLM's workers end the
            update they started (their layers keep the weights they hold)."""
            try:
                self.client.finish_weight_update()
            except Exception as e:  # noqa: BLE001
                logger.warning("xccl_rs trainer engine: ending the failed round on the workers failed: %s", e)

        def _drop_group(self) -> None:
            if self._sender is not None:
                try:
                    self._sender.release()
                except Exception as e:  # noqa: BLE001
                    logger.warning("xccl_rs trainer engine: releasing the buckets failed: %s", e)
            self._sender = None
            if self._group is not None:
                _destroy_group(self._group)
            self._group = None

        def send_weights(self, weights=None) -> None:
            """One round: the source's tensors, checked against its metadata; or, when
            ``weights`` (an iterable of ``(name, tensor)``, consumed once) is given, those (the
            vLLM API's form for engines made without a source)."""
            source = self.source
            if weights is None and source is None:
                raise ValueError("xccl_rs trainer engine: made without a WeightSource, send_weights needs the weights")
            if weights is not None:
                pairs = iter(weights)
            else:
                pairs = self._checked_iter(source, source.metadata)
            if not self.is_sender:
                for _ in pairs:  # the producer's collectives (e.g. FSDP's all-gathers)
                    pass
                return
            if self._root is None:
                raise RuntimeError("xccl_rs trainer engine: send_weights after shutdown")
            k = self._round = self._round + 1
            _publish(self._root, _Keys.ROUND, str(k))  # before the workers are told to check in
            try:
                self.client.start_weight_update()
            except Exception as e:
                self._cancel()
                raise WeightTransferError(f"xccl_rs weight transfer: round {k}: start_weight_update failed: {e}") from e
            members = self._checked_in(k)
            if not members:
                self._cancel()
                raise WeightTransferError(f"xccl_rs weight transfer: round {k}: no vLLM worker checked in")
            if self._group is None or members != self._members:
                self._drop_group()
                self._generation += 1
                self._members = members
            update_info = asdict(XcclRsWeightTransferUpdateInfo(round=k, generation=self._generation,
                                                                 members=list(members)))
            exe = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xccl_rs-vllm-update")
            future = exe.submit(self.client.update_weights, update_info)
            try:
                try:
                    if self._group is None:
                        store = dist.PrefixStore(_Keys.generation(self._generation), self._root)
                        self._group = _make_group(store, 0, 1 + len(members), self.timeout, self.info.device,
                                                  self.info.group_backend)
                        self._sender = WeightSender(self._group, src=0, bucket_bytes=int(self.info.bucket_bytes),
                                                    device=self.info.device)
                    stats = self._sender.send(pairs)
                    all_ok = _allreduce_min(self._group, True)
                except BaseException as e:
                    self._drop_group()
                    text = str(e)
                    if future.done() and future.exception() is not None:
                        text += f" (the workers' update_weights: {future.exception()})"
                    raise WeightTransferError(
                        f"xccl_rs weight transfer: round {k} (generation {self._generation}, {len(members)} "
                        f"workers) failed: {text}{self._named(text)}. The next send_weights() builds a new "
                        "group over the workers that check in"
                    ) from e
                # The protocol ran to its end (the vote): the workers' update_weights return now.
                worker_error = None
                try:
                    future.result(timeout=self.timeout.total_seconds())
                except FutureTimeout:
                    raise WeightTransferError(
                        f"xccl_rs weight transfer: round {k}: the workers' update_weights did not return within "
                        f"{self.timeout.total_seconds():g} s after the transfer"
                    ) from None
                except Exception as e:  # noqa: BLE001 - raised below, after the refusals
                    worker_error = e
                if not all_ok:
                    raise WeightTransferError(
                        f"xccl_rs weight transfer: round {k}: refused by the workers: " + self._refusals(k)
                    ) from worker_error
                if worker_error is not None:
                    raise WeightTransferError(
                        f"xccl_rs weight transfer: round {k}: the workers' update_weights failed: {worker_error}"
                    ) from worker_error
            finally:
                # Never wait for the RPC thread on an error: a worker still blocked in the
                # transfer returns only at the timeout (vLLM's NCCL engine does the same).
                exe.shutdown(wait=False)
            self.client.finish_weight_update()
            self.last_stats = stats
            logger.info("xccl_rs trainer engine: round %d to %d workers: %s", k, len(members), stats)

        def _refusals(self, k: int) -> str:
            out = []
            for rank in range(1, len(self._members) + 1):
                key = _Keys.refusal(k, rank)
                if self._root.check([key]):
                    out.append(f"group rank {rank}, {self._who_is(rank)}, refused {self._root.get(key).decode()}")
            return "; ".join(out) or "(no reason recorded)"

        @staticmethod
        def _checked_iter(source: WeightSource, meta: list[ParamMeta]):
            """The sender's pairs, each checked against the metadata (vLLM's NCCL engine's check:
            a difference aborts the round on every rank, naming the tensor)."""
            sent = 0
            for name, tensor in source.iter_full():
                if sent >= len(meta):
                    raise ValueError(
                        f"WeightSource yielded more parameters than its metadata declares ({len(meta)}); "
                        f"the first extra is {name!r}"
                    )
                m = meta[sent]
                if name != m.name or tensor.dtype != m.dtype or tuple(tensor.shape) != tuple(m.shape):
                    raise ValueError(
                        f"WeightSource metadata disagrees with its iteration at index {sent}: declared "
                        f"{m.name!r} {m.dtype} {tuple(m.shape)}, got {name!r} {tensor.dtype} {tuple(tensor.shape)}"
                    )
                sent += 1
                yield name, tensor
            if sent != len(meta):
                raise ValueError(f"WeightSource yielded {sent} parameters but its metadata declares {len(meta)}")

        def shutdown(self) -> None:
            self._drop_group()
            self._root = None
            self._server = None

    for cls in (
        XcclRsWeightTransferInitInfo,
        XcclRsWeightTransferUpdateInfo,
        XcclRsTrainerInitInfo,
        XcclRsWeightTransferEngine,
        XcclRsTrainerWeightTransferEngine,
    ):
        cls.__qualname__ = cls.__name__  # picklable by module and name (module __getattr__)
        globals()[cls.__name__] = cls
    # A trainer that imports the init info class can use the factory at once, plugin loaded or not.
    register()
