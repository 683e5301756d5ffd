"""A vLLM weight-transfer engine, ``"xccl_rs"``: the trainer sends weights to vLLM's workers over a
private xccl_rs process group, with :mod:`xccl_rs.weight_sync` -- trainer rank 0 alone
(``senders="rank0"``, the default), or every trainer rank its share (``senders="all"``).

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

    # every trainer rank sends its share (the trainers in an initialised default process group):
    info = XcclRsTrainerInitInfo(..., senders="all", num_trainer_ranks=n_trainers,
                                 world_size=n_trainers + n_workers, sharded=True)

How it runs. Terms: a *worker* is one vLLM worker process (a replica with tensor parallelism
``tp`` has ``tp`` of them, and every one receives the full tensors: each model's
``load_weights`` keeps its shard); a *member* is a worker known to the trainer's store; a
*sender* is a trainer rank that sends (rank 0, or every trainer rank with ``senders="all"``); a
*round* is one ``send_weights``; a *generation* is one process group (the senders, as group
ranks ``0 .. S-1``, then the round's members, in a fixed order).

1. ``trainer_init`` (every trainer rank; rank 0 does the work): serves a TCPStore
   (``master_port`` 0 picks a free port) and calls ``client.init_weight_transfer_engine`` with
   the worker init info: the store's address and port, ``rank_offset`` (the number of senders)
   and ``world_size`` as vLLM's NCCL engines have them, the store prefix of this trainer's
   session, the timeout. No secret travels in it: every group's secret goes through the store,
   as for every xccl_rs group. Each worker connects to the store and registers as a member (who
   it is: data-parallel index, rank, host, pid). Rank 0 then checks that ``world_size -
   num_trainer_ranks`` workers registered. With ``senders="all"`` the trainer ranks first agree,
   through their own process group (one all-gather), that every one can send (else every one
   raises, naming the rank and the reason), and rank 0 then gives them the store's address and
   the session prefix through it (a broadcast).
2. ``send_weights``: rank 0 announces round ``k`` in the store and calls
   ``client.start_weight_update``, in which every worker checks in for round ``k`` (and starts
   vLLM's layerwise reload, as vLLM's NCCL engine does). The members that checked in are the
   round's members, ordered as vLLM's NCCL engine orders its ranks (``rank_offset + dp index *
   workers per replica + rank``), then by registration. When they differ from the last round's,
   or the last round failed, a new generation is built (``xccl_rs.new_group`` over the store
   prefix ``gen/<g>/``); otherwise the group, its buckets and its shared window are reused. With
   ``senders="all"`` rank 0 tells the other trainer ranks the round, its members and its
   generation through their process group (one all-gather, which also tells it whether each
   still holds the last generation's group).
3. ``client.update_weights({"round", "generation", "members", "senders"})`` runs in a thread
   while the senders send: every worker joins the group as rank ``senders`` + its place among
   the members, receives the tensors (:class:`~xccl_rs.weight_sync.WeightReceiver`, each
   tensor in its own memory, on the worker's device) and loads each with the model's
   ``load_weights([(name, tensor)])`` as it arrives. Then every rank of the group votes on the
   outcome: a worker that refused a tensor has put its reason in the store, and every rank
   raises it. ``client.finish_weight_update`` finishes vLLM's layerwise reload; with
   ``senders="all"`` rank 0 then puts how the round ended in the store, and the other trainer
   ranks raise its error, if any.

What the senders send (``senders="all"``, with :mod:`xccl_rs.weight_sync`'s several senders):
the full tensors of the source's ``iter_full()`` are shared out (each tensor is sent by one
trainer rank, each rank about ``1/S`` of the bytes); with ``sharded=True``, each rank's pieces
from ``iter_local()`` are sent as they are, placed by the metadata's owners, mesh shape and
placements (each ``Shard`` piece by its owner, a ``Replicate`` one by the mesh's coordinate 0;
nothing is gathered); ``send_weights(weights)`` sends what each rank is given, full tensors
shared out and DTensors shard by shard. Every parameter must be owned by every trainer rank.

Mismatches. The trainer checks that its source yields exactly what its metadata declares
(name, dtype, shape, in order), as vLLM's NCCL engine does; a difference aborts the round on every
rank, naming the tensor. A worker refuses a tensor its model's ``load_weights`` raises on (a
name the model does not have, a shape its loader rejects) or that the model would store in
another dtype than the one sent (the loader copies it into a tensor of another dtype: checked
while it loads); it stops loading, drains the rest of the round, and every rank then raises
naming the tensor and the worker.

Failures. A worker that dies or stalls fails the round on the trainer within the timeout, with an
error naming its group rank and who that is (replica, rank, host, pid); the other workers fail
too. With ``senders="all"`` so does every trainer rank, and a trainer rank that dies fails the
round on the others and on the workers, naming it (``trainer rank 1``). Every rank of a failed round gives its group up, and a worker's layers go back to what they
held (layers received whole keep the new weights, the others the old ones: never a layer half
loaded). The next ``send_weights`` builds a new generation over the workers that check in: the
replicas left, once the client no longer calls the dead one, and any replica added since (its
workers get ``engine.worker_init_info`` through ``engine.init_workers(client)`` or the
client's ``init_weight_transfer_engine``; they get the full weights from their first round).

Memory: a sender holds two buckets (``bucket_bytes`` each, kept between rounds), allocated once
it has bytes to pack; the other trainer ranks, and senders with no share, allocate nothing (the
former only run ``source.iter_full()`` for its collectives). A worker holds two receive buckets
and the tensor being loaded (vLLM's layerwise reload keeps a layer's tensors until the layer is
complete, as with vLLM's own engines), and with several senders the tensors being assembled
from their pieces. On one host the buckets are a shared-memory window (one per sender) that the
workers read in place.

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
from .weight_sync._common import vote

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
        the trainer's store (``master_address``/``master_port``), ``rank_offset`` (the sending
        trainer ranks, which come first: 1, or every trainer rank with ``senders="all"``) and
        ``world_size`` (those plus every worker at init); plus the
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
        answers), the generation of the group, its members in group-rank order, and how many
        trainer ranks send (group ranks ``0 .. senders-1``; the members are the ranks after
        them)."""

        round: int = 0
        generation: int = 0
        members: list = field(default_factory=list)
        senders: int = 1

    @dataclass(kw_only=True)
    class XcclRsTrainerInitInfo(TrainerInitInfo):
        """The trainer side's init info (``rank`` is this trainer process's rank; rank 0 drives
        the rounds).

        ``master_address``: the address workers reach the trainer's store at (default: this
        host's); ``master_port``: the store's port, 0 for a free one; ``world_size``: the
        trainer ranks (``num_trainer_ranks``) plus the vLLM workers (every worker of every
        replica), as vLLM's ``nccl_m2n`` engine counts it. ``bucket_bytes``: the size of each of
        a sending trainer's two buckets (a tensor larger than one is split); ``timeout_s``: the
        group's and the store's timeout; ``device``: where the trainer's buckets live;
        ``worker_bucket_device``: where the workers' receive buckets live; ``group_backend``:
        ``"xccl_rs"``, or ``"gloo"`` (the same rounds over a gloo group, for comparisons: no
        shared window).

        ``senders``: ``"rank0"`` (the default: trainer rank 0 sends everything, the other ranks
        only iterate the source) or ``"all"`` (every trainer rank sends its share). With
        ``"all"``: ``num_trainer_ranks`` is the number of trainer ranks, and the trainers must
        be the ranks of ``trainer_group`` (default: the initialised default process group),
        each ``rank`` its rank there; ``sharded=True`` sends each rank's pieces from the
        source's ``iter_local()`` as they are (FSDP shards: nothing gathered), otherwise the full
        tensors of ``iter_full()`` are shared out."""

        backend: ClassVar[str] = BACKEND

        master_address: str = ""
        master_port: int = 0
        world_size: int
        bucket_bytes: int = DEFAULT_BUCKET_BYTES
        timeout_s: float = 600.0
        device: str = "cpu"
        worker_bucket_device: str = "cpu"
        group_backend: str = "xccl_rs"
        senders: str = "rank0"
        num_trainer_ranks: int = 1
        sharded: bool = False
        trainer_group: Any = field(default=None, repr=False, compare=False)

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

        def _join(self, generation: int, members: list, senders: int) -> None:
            """The group of ``generation`` (kept while the trainer keeps it): trainer ranks
            ``0 .. senders-1`` send, this worker is rank ``senders`` + its place in ``members``."""
            if self._group is not None and self._generation == generation:
                return
            self._drop_group()
            if self._member not in members:
                raise WeightTransferError(
                    f"xccl_rs weight transfer: this worker (member {self._member}) is not among generation "
                    f"{generation}'s members {members}: it did not check in at start_weight_update"
                )
            if senders < 1:
                raise WeightTransferError(f"xccl_rs weight transfer: the update info names {senders} senders")
            info = self._info
            rank = senders + members.index(self._member)
            store = dist.PrefixStore(_Keys.generation(generation), self._root())
            timeout = timedelta(seconds=float(info.timeout_s))
            self._group = _make_group(store, rank, senders + len(members), timeout, info.bucket_device,
                                      info.group_backend)
            self._generation = generation
            self._receiver = WeightReceiver(self._group, senders=list(range(senders)), device=self.device,
                                            bucket_device=info.bucket_device)

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
                self._join(int(update_info.generation), [int(m) for m in update_info.members],
                           int(update_info.senders))
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
                all_ok = vote(self._group, refused is None)
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
        calls ``trainer_init`` and ``send_weights``. Rank 0 drives the rounds (the store, the
        client's calls); with ``senders="rank0"`` it alone sends and the others only run the
        source's iteration (for its collectives) and allocate nothing; with ``senders="all"``
        every rank sends its share."""

        init_info_cls = XcclRsTrainerInitInfo

        def __init__(self, *, client, source, is_sender: bool = True, rank: int = 0,
                     info: Optional[XcclRsTrainerInitInfo] = None) -> None:
            super().__init__(client=client, source=source, is_sender=is_sender, rank=rank)
            self.info = info
            self.timeout = timedelta(seconds=float(info.timeout_s if info is not None else 600.0))
            self._server = None  # the TCPStore (rank 0)
            self._client_store = None  # a client of it (the other ranks, senders="all")
            self._root = None  # the session prefix over either
            self.session = ""
            self.address = ""
            self.port = 0
            self._trainers = None  # the trainers' process group (senders="all")
            self.n_senders = 1  # group ranks 0 .. n_senders-1 send
            self._round = 0
            self._generation = 0
            self._group = None
            self._members: list[int] = []
            self._sender: Optional[WeightSender] = None
            self._who: dict[int, dict] = {}  # member id -> its registration
            self._meshes: dict = {}  # (device type, owners, mesh shape) -> DeviceMesh (sharded sources)
            self.last_stats = None

        # ---- set-up ------------------------------------------------------------------

        @classmethod
        def trainer_init(cls, init_info: XcclRsTrainerInitInfo, *, client, source: Optional[WeightSource] = None):
            # Without a source, every send_weights() gets its tensors as an argument.
            if init_info.senders not in SENDERS:
                raise ValueError(f"XcclRsTrainerInitInfo: senders {init_info.senders!r} is not one of {SENDERS}")
            if init_info.group_backend not in GROUP_BACKENDS:
                raise ValueError(f"XcclRsTrainerInitInfo: group_backend {init_info.group_backend!r} is not one of "
                                 f"{GROUP_BACKENDS}")
            if init_info.senders == "all":
                return cls._init_all(init_info, client, source)
            if init_info.sharded:
                raise ValueError(
                    "XcclRsTrainerInitInfo: sharded=True sends every trainer rank's own pieces, so every rank "
                    "must send: it needs senders='all'"
                )
            if source is not None and not source.implements_iter_full():
                raise TypeError(
                    f"xccl_rs broadcast sends full tensors, but {type(source).__name__} does not implement iter_full()"
                )
            for m in source.metadata if source is not None else ():  # the same on every rank: all raise alike
                if m.owners is not None and m.owners[0] != 0:
                    raise ValueError(
                        f"parameter {m.name!r} is sent by its first owner, rank {m.owners[0]}, but the xccl_rs "
                        "engine with senders='rank0' has a single sender, rank 0: every parameter's owners must "
                        "start at rank 0"
                    )
            cls._check_counts(init_info)
            engine = cls(client=client, source=source, is_sender=init_info.is_sender, rank=init_info.rank,
                         info=init_info)
            if not engine.is_sender:
                return engine
            engine._serve()
            try:
                engine._start_session()
            except BaseException:
                engine.shutdown()
                raise
            return engine

        @staticmethod
        def _check_counts(info: XcclRsTrainerInitInfo) -> None:
            if int(info.num_trainer_ranks) < 1:
                raise ValueError(f"XcclRsTrainerInitInfo: num_trainer_ranks {info.num_trainer_ranks} is not a count "
                                 "of trainer ranks")
            if int(info.world_size) - int(info.num_trainer_ranks) < 1:
                raise ValueError(
                    f"XcclRsTrainerInitInfo: world_size {info.world_size} leaves no vLLM worker beside "
                    f"{info.num_trainer_ranks} trainer rank(s) (world_size counts the trainer ranks and the workers)"
                )

        @classmethod
        def _init_all(cls, info: XcclRsTrainerInitInfo, client, source: Optional[WeightSource]):
            """``senders="all"``: every trainer rank checks what it can, the ranks agree (one
            all-gather over the trainers' group: all raise, or none), then rank 0 opens the
            session and shares its store's address and prefix with the others."""
            n = int(info.num_trainer_ranks)
            group = info.trainer_group
            if group is None and dist.is_available() and dist.is_initialized():
                group = dist.group.WORLD
            if group is None:
                raise ValueError(
                    "xccl_rs trainer engine: senders='all' makes every trainer rank a sender, and the trainer ranks "
                    "share the session through a torch.distributed process group, but there is none: call "
                    "torch.distributed.init_process_group on every trainer rank (or pass trainer_group), or use "
                    "senders='rank0'"
                )
            if group.size() != n:
                raise ValueError(
                    f"xccl_rs trainer engine: senders='all' with num_trainer_ranks {n}, but the trainer process group "
                    f"has {group.size()} ranks: every trainer rank is a sender, so they must be the same (set "
                    "num_trainer_ranks to the trainers' group size, or pass the trainers' group as trainer_group)"
                )
            mine = None
            try:
                cls._check_counts(info)
                if info.rank != group.rank():
                    raise ValueError(f"its rank is {info.rank}, but it is rank {group.rank()} of the trainer group")
                cls._check_source_all(source, n, bool(info.sharded))
            except Exception as e:  # noqa: BLE001 - every rank raises, below
                mine = f"{type(e).__name__}: {e}"
            everyone = [None] * n
            dist.all_gather_object(everyone, mine, group=group)
            bad = [f"trainer rank {r}: {e}" for r, e in enumerate(everyone) if e is not None]
            if bad:
                raise ValueError("xccl_rs trainer engine (senders='all') refused: " + "; ".join(bad))
            engine = cls(client=client, source=source, is_sender=info.is_sender, rank=info.rank, info=info)
            engine._trainers, engine.n_senders = group, n
            where, error = [None], None
            if engine.is_sender:
                try:
                    engine._serve()
                    engine._start_session()
                    where[0] = {"address": engine.address, "port": engine.port, "session": engine.session}
                except BaseException as e:
                    error = e
                    where[0] = {"error": f"{type(e).__name__}: {e}"}
                    engine.shutdown()
            dist.broadcast_object_list(where, group_src=0, group=group)
            if error is not None:
                raise error
            if "error" in where[0]:
                raise WeightTransferError(f"xccl_rs weight transfer: trainer rank 0 failed to open the session: "
                                          f"{where[0]['error']}")
            if not engine.is_sender:
                engine._connect(where[0])
            return engine

        @staticmethod
        def _check_source_all(source: Optional[WeightSource], n: int, sharded: bool) -> None:
            if source is None:
                return
            if sharded and not source.implements_iter_local():
                raise TypeError(f"sharded=True sends each rank's pieces from iter_local(), which "
                                f"{type(source).__name__} does not implement")
            if not sharded and not source.implements_iter_full():
                raise TypeError(f"{type(source).__name__} does not implement iter_full() (with sharded=True its "
                                "iter_local() pieces are sent)")
            for m in source.metadata:
                owners = getattr(m, "owners", None)
                if owners is not None and sorted(owners) != list(range(n)):
                    raise ValueError(
                        f"parameter {m.name!r} is owned by trainer ranks {tuple(owners)}, but with senders='all' "
                        f"every one of the {n} trainer ranks sends (a share of) every parameter; a source split "
                        "among the ranks (pipeline stages) cannot be sent this way"
                    )

        def _serve(self) -> None:
            info = self.info
            self.address = info.master_address or _node_address()
            self._server = dist.TCPStore(
                self.address, int(info.master_port), None, True, timeout=self.timeout, wait_for_workers=False
            )
            self.port = int(self._server.port)
            self.session = f"xccl_rs_vllm/{uuid.uuid4().hex}"
            self._root = dist.PrefixStore(self.session + "/", self._server)

        def _start_session(self) -> None:
            """Rank 0: the workers' engines connect to the store and register."""
            self.init_workers(self.client)
            expected = int(self.info.world_size) - int(self.info.num_trainer_ranks)
            registered = int(self._root.add(_Keys.MEMBERS, 0))
            if registered != expected:
                raise ValueError(
                    f"xccl_rs weight transfer: world_size {self.info.world_size} with "
                    f"{self.info.num_trainer_ranks} trainer rank(s) means {expected} vLLM workers, but "
                    f"{registered} registered"
                )

        def _connect(self, where: dict) -> None:
            """The other trainer ranks (``senders="all"``): a client of rank 0's store."""
            self.address, self.port, self.session = where["address"], int(where["port"]), where["session"]
            self._client_store = dist.TCPStore(self.address, self.port, None, False, timeout=self.timeout)
            self._root = dist.PrefixStore(self.session + "/", self._client_store)

        @property
        def worker_init_info(self) -> dict:
            """The init info every worker gets (``init_weight_transfer_engine``'s payload)."""
            if self._server is None:
                raise RuntimeError("xccl_rs trainer engine: only trainer rank 0 has the worker init info")
            workers = int(self.info.world_size) - int(self.info.num_trainer_ranks)
            info = XcclRsWeightTransferInitInfo(
                master_address=self.address,
                master_port=self.port,
                rank_offset=self.n_senders,
                world_size=self.n_senders + workers,
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

        # ---- who is who ----------------------------------------------------------------

        def _load_who(self, members: list[int]) -> None:
            for m in members:
                if m not in self._who:
                    self._who[m] = json.loads(self._root.get(_Keys.member(m)))

        def _checked_in(self, k: int) -> list[int]:
            """The members that checked in for round ``k``, in group-rank order."""
            root = self._root
            n = int(root.add(_Keys.checkins(k), 0))
            if n == 0:
                return []
            ids = [int(v) for v in root.multi_get([_Keys.checkin(k, i) for i in range(1, n + 1)])]
            self._load_who(ids)
            return sorted(set(ids), key=lambda m: (int(self._who[m].get("static_rank", 0)), m))

        def _who_is(self, rank: int) -> str:
            if 0 <= rank < self.n_senders:
                return f"trainer rank {rank}" if self.n_senders > 1 else ""
            if self.n_senders <= rank < self.n_senders + len(self._members):
                return _describe(self._who.get(self._members[rank - self.n_senders], {}))
            return ""

        def _named(self, text: str) -> str:
            """Who the ranks are that ``text`` names (group ranks: the senders first, then the workers)."""
            ranks = sorted({int(r) for r in re.findall(r"\branks? \[?(\d+)", text)})
            who = [f"rank {r} = {self._who_is(r)}" for r in ranks if self._who_is(r)]
            return (". Group ranks named above: " + "; ".join(who)) if who else ""

        # ---- a round -----------------------------------------------------------------

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
            vLLM API's form for engines made without a source). With ``senders="all"`` each
            rank's tensors: full tensors (shared out) or DTensors (each rank sends its shards)."""
            source = self.source
            if weights is None and source is None:
                raise ValueError("xccl_rs trainer engine: made without a WeightSource, send_weights needs the weights")
            if weights is not None:
                pairs = iter(weights)
            elif self.info is not None and self.info.sharded:
                pairs = self._checked_iter(source.iter_local(), source.metadata, self._as_shard)
            else:
                pairs = self._checked_iter(source.iter_full(), source.metadata)
            if self._trainers is None and not self.is_sender:
                for _ in pairs:  # the producer's collectives (e.g. FSDP's all-gathers)
                    pass
                return
            if self._root is None:
                raise RuntimeError("xccl_rs trainer engine: send_weights after shutdown")
            self._begin_round()
            self._transfer(pairs)

        def _open_round(self) -> list[int]:
            """Rank 0: announces the next round, starts it on the workers; its members."""
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
            return members

        def _begin_round(self) -> None:
            """The round's number, members and generation, decided by rank 0 (with
            ``senders="all"``, told to the other trainer ranks through their group, which also
            tells rank 0 whether each still holds the last generation's group)."""
            held = self._generation if self._group is not None else 0
            plan, error = None, None
            if self.is_sender:
                try:
                    members = self._open_round()
                    plan = {"round": self._round, "members": members, "generation": self._generation,
                            "keep": self._group is not None and members == self._members}
                except BaseException as e:
                    error, plan = e, {"error": str(e)}
            helds = [held]
            if self._trainers is not None:
                everyone = [None] * self.n_senders
                dist.all_gather_object(everyone, {"held": held, "plan": plan}, group=self._trainers)
                plan, helds = everyone[0]["plan"], [x["held"] for x in everyone]
            if error is not None:
                raise error
            if "error" in plan:
                raise WeightTransferError(f"{plan['error']} (on trainer rank 0)")
            generation = int(plan["generation"])
            if not (plan["keep"] and all(h == generation for h in helds)):
                self._drop_group()
                generation += 1
            self._round, self._generation, self._members = int(plan["round"]), generation, list(plan["members"])
            self._load_who(self._members)

        def _transfer(self, pairs) -> None:
            k, generation, members, n = self._round, self._generation, self._members, self.n_senders
            exe = future = None
            if self.is_sender:
                update_info = asdict(XcclRsWeightTransferUpdateInfo(round=k, generation=generation,
                                                                     members=list(members), senders=n))
                exe = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xccl_rs-vllm-update")
                future = exe.submit(self.client.update_weights, update_info)
            try:
                try:
                    if self._group is None:
                        store = dist.PrefixStore(_Keys.generation(generation), self._root)
                        rank = self.rank if self._trainers is not None else 0
                        self._group = _make_group(store, rank, n + len(members), self.timeout, self.info.device,
                                                  self.info.group_backend)
                        self._sender = WeightSender(self._group, senders=list(range(n)),
                                                    bucket_bytes=int(self.info.bucket_bytes), device=self.info.device)
                    stats = self._sender.send(pairs)
                    all_ok = vote(self._group, True)
                except BaseException as e:
                    self._drop_group()
                    text = str(e)
                    if future is not None and future.done() and future.exception() is not None:
                        text += f" (the workers' update_weights: {future.exception()})"
                    where = f" on trainer rank {self.rank}" if n > 1 else ""
                    senders = f", {n} sending trainer ranks" if n > 1 else ""
                    raise WeightTransferError(
                        f"xccl_rs weight transfer: round {k} (generation {generation}, {len(members)} "
                        f"workers{senders}) failed{where}: {text}{self._named(text)}. The next send_weights() "
                        "builds a new group over the workers that check in"
                    ) from e
                # The protocol ran to its end (the vote): rank 0 sees the workers' calls return and
                # tells the other trainer ranks how the round ended.
                if self.is_sender:
                    try:
                        self._conclude(k, future, all_ok)
                    except BaseException as e:
                        self._report(k, str(e))
                        raise
                    self._report(k, None)
                else:
                    self._await_report(k)
            finally:
                # Never wait for the RPC thread on an error: a worker still blocked in the
                # transfer returns only at the timeout (vLLM's NCCL engine does the same).
                if exe is not None:
                    exe.shutdown(wait=False)
            self.last_stats = stats
            logger.info("xccl_rs trainer engine: round %d to %d workers (trainer rank %d): %s", k, len(members),
                        self.rank, stats)

        def _conclude(self, k: int, future, all_ok: bool) -> None:
            """Rank 0, after the vote: the workers' update_weights, their refusals, then
            vLLM's finish_weight_update."""
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
            self.client.finish_weight_update()

        def _report(self, k: int, error: Optional[str]) -> None:
            """Rank 0 (``senders="all"``): how round ``k`` ended, for the other trainer ranks."""
            if self._trainers is None or self.n_senders < 2:
                return
            try:
                _publish(self._root, _Keys.outcome(k), json.dumps({"error": error}))
            except Exception as e:  # noqa: BLE001 - they then fail at their wait, saying so
                logger.warning("xccl_rs trainer engine: telling the trainer ranks how round %d ended failed: %s", k, e)

        def _await_report(self, k: int) -> None:
            """The other trainer ranks: rank 0's word on round ``k`` (it waits for the workers'
            update_weights, up to the timeout, then for finish_weight_update)."""
            wait = 2 * self.timeout
            try:
                self._root.wait([_Keys.outcome(k)], wait)
                error = json.loads(self._root.get(_Keys.outcome(k)))["error"]
            except Exception as e:  # noqa: BLE001
                raise WeightTransferError(
                    f"xccl_rs weight transfer: round {k}: trainer rank 0 did not say how the round ended within "
                    f"{wait.total_seconds():g} s: {e}"
                ) from e
            if error is not None:
                raise WeightTransferError(f"{error} (reported by trainer rank 0)")

        def _refusals(self, k: int) -> str:
            out = []
            for rank in range(self.n_senders, self.n_senders + len(self._members)):
                key = _Keys.refusal(k, rank)
                if self._root.check([key]):
                    out.append(f"group rank {rank}, {self._who_is(rank)}, refused {self._root.get(key).decode()}")
            return "; ".join(out) or "(no reason recorded)"

        # ---- the source ----------------------------------------------------------------

        def _as_shard(self, name: str, local: torch.Tensor, m: ParamMeta) -> torch.Tensor:
            """This rank's piece of ``m`` from ``iter_local()``, as the DTensor it is a shard of
            (a view of it, on a mesh of the parameter's owners: no collective, no copy), so that
            the weight sync sends it as it is; a replicated parameter is its full tensor."""
            placements = getattr(m, "placements", None)
            if getattr(m, "owners", None) is None or placements is None:
                if tuple(local.shape) != tuple(m.shape):
                    raise ValueError(f"WeightSource's iter_local() yielded {name!r} with shape {tuple(local.shape)}; "
                                     f"its metadata declares it replicated, of shape {tuple(m.shape)}")
                return local
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.tensor import DTensor, Replicate, Shard

            key = (local.device.type, tuple(m.owners), tuple(m.mesh_shape))
            mesh = self._meshes.get(key)
            if mesh is None:
                ranks = torch.tensor(m.owners, dtype=torch.int).view(m.mesh_shape)
                try:  # no process group of its own: the mesh only says where this rank's piece goes
                    mesh = DeviceMesh(local.device.type, ranks, _init_backend=False, _rank=self.rank)
                except TypeError:  # a torch without _rank: the default group's rank (the trainer rank)
                    mesh = DeviceMesh(local.device.type, ranks, _init_backend=False)
                self._meshes[key] = mesh
            shape = torch.Size(m.shape)
            stride, acc = [], 1
            for d in reversed(shape):
                stride.insert(0, acc)
                acc *= max(int(d), 1)
            torch_placements = [Shard(p.dim) if getattr(p, "dim", None) is not None else Replicate()
                                for p in placements]
            with torch.no_grad():
                return DTensor.from_local(local, mesh, torch_placements, run_check=False, shape=shape,
                                          stride=tuple(stride))

        def _checked_iter(self, pairs, meta: list[ParamMeta], piece=None):
            """The source's pairs, each checked against the metadata (vLLM's NCCL engine's check:
            a difference aborts the round on every rank, naming the tensor); ``piece`` makes
            each of ``iter_local()``'s pieces the shard it is."""
            sent = 0
            for name, tensor in pairs:
                if sent >= len(meta):
                    raise ValueError(
                        f"WeightSource yielded more parameters than its metadata declares ({len(meta)}); "
                        f"the first extra is {name!r}"
                    )
                m = meta[sent]
                if piece is not None and name == m.name and tensor.dtype == m.dtype:
                    tensor = piece(name, tensor, m)
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
            self._client_store = None

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
