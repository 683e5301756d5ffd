"""The init and update infos of both sides (subclasses of vLLM's, made once vLLM is imported)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from ..door import GROUP_BACKENDS
from ..weight_sync import DEFAULT_BUCKET_BYTES
from . import BACKEND


def make_infos(base) -> tuple[type, type, type]:
    """The init infos of both sides and the workers' update info, subclasses of those of
    ``base`` (vLLM's ``vllm.distributed.weight_transfer.base``)."""
    TrainerInitInfo, WeightTransferInitInfo = base.TrainerInitInfo, base.WeightTransferInitInfo
    WeightTransferUpdateInfo = base.WeightTransferUpdateInfo

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
        only iterate the source), ``"all"`` (every trainer rank sends its share) or ``"node"``
        (the trainer ranks on trainer rank 0's node send their shares; the others only iterate
        the source). With ``"all"`` or ``"node"``: ``num_trainer_ranks`` is the number of
        trainer ranks, and the trainers must be the ranks of ``trainer_group`` (default: the
        initialised default process group), each ``rank`` its rank there; with ``"all"``,
        ``sharded=True`` sends each rank's pieces from the source's ``iter_local()`` as they are
        (FSDP shards: nothing gathered), otherwise the full tensors of ``iter_full()`` are
        shared out.

        ``payload``: what the senders put on the wire: ``"full"`` (the tensors as they are),
        ``"delta"`` (only what changed since the version every worker holds) or ``"fp8"`` (the
        selected weights as float8_e4m3fn with float32 scales, in vLLM's fp8 layout); the
        workers learn it from the wire. With ``"fp8"``: ``fp8_scale`` (``"block"``,
        ``"channel"``, ``"tensor"``) and ``fp8_select`` (a regular expression on the names, or
        a callable ``(name, tensor) -> bool``; default: the 2-D ``...weight`` tensors but
        embeddings, the head and norms); with ``"delta"``: ``delta_base`` (``"copy"``,
        ``"cpu"``). ``shared_memory``: ``None`` (the shared window where trainer and workers
        share a host) or ``False`` (the buckets are always sent)."""

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
        payload: str = "full"
        fp8_scale: str = "block"
        fp8_select: Any = field(default=None, compare=False)
        delta_base: str = "copy"
        shared_memory: Optional[bool] = None
        trainer_group: Any = field(default=None, repr=False, compare=False)

    return XcclRsWeightTransferInitInfo, XcclRsWeightTransferUpdateInfo, XcclRsTrainerInitInfo
