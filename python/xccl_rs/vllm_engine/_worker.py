"""The worker side: the engine each vLLM worker makes."""

from __future__ import annotations

import json
import logging
import os
import socket
from typing import Any, Optional

import torch

from ..door import SyncGroup, SyncOptions, TrainerStore
from ..weight_sync._common import vote
from . import WeightTransferError, _loading
from ._loading import _cancel_layerwise_reload, _dtype_guard, _load_one
from ._session import GROUP_NAME, _Keys, _describe, _publish

logger = logging.getLogger("xccl_rs.vllm_engine")


def make_worker_engine(base, XcclRsWeightTransferInitInfo: type, XcclRsWeightTransferUpdateInfo: type) -> type:
    """The engine each vLLM worker makes, a subclass of ``base.WeightTransferEngine`` (``base``:
    vLLM's ``vllm.distributed.weight_transfer.base``)."""
    WeightTransferEngine = base.WeightTransferEngine

    class XcclRsWeightTransferEngine(
        WeightTransferEngine[XcclRsWeightTransferInitInfo, XcclRsWeightTransferUpdateInfo]
    ):
        """The worker side (the module docstring says how a round runs)."""

        init_info_cls = XcclRsWeightTransferInitInfo
        update_info_cls = XcclRsWeightTransferUpdateInfo

        def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
            super().__init__(config, vllm_config, device, model)
            self._info: Optional[XcclRsWeightTransferInitInfo] = None
            self._store = None  # (the trainer's TrainerStore, the session's PrefixStore)
            self._member: Optional[int] = None
            self._round: Optional[int] = None  # the round this worker checked in for
            self._sync: Optional[SyncGroup] = None  # the group of a generation (its key)
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
            options = SyncOptions(who="xccl_rs vLLM worker", timeout_s=float(init_info.timeout_s),
                                  group_backend=init_info.group_backend)
            client = TrainerStore.connect(init_info.master_address, int(init_info.master_port), options.timeout)
            root = client.under(init_info.session)
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
            self._sync = SyncGroup(options, name=GROUP_NAME)
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
            _loading._layerwise()[0].initialize_layerwise_reload(self.model)
            self._reloading = True

        def update_weights(self, update_info: dict[str, Any]) -> None:
            typed = self.parse_update_info(update_info)
            self.receive_weights(typed)
            if torch.accelerator.is_available():  # the base class's sync, where there is a device
                torch.accelerator.synchronize()

        def _join(self, generation: int, members: list, senders: int) -> None:
            """The group of ``generation`` (kept while the trainer keeps it): trainer ranks
            ``0 .. senders-1`` send, this worker is rank ``senders`` + its place in ``members``."""
            if self._sync.holds(generation):
                return
            self._drop_group()
            if self._member not in members:
                raise WeightTransferError(
                    f"xccl_rs weight transfer: this worker (member {self._member}) is not among generation "
                    f"{generation}'s members {members}: it did not check in at start_weight_update"
                )
            if senders < 1:
                raise WeightTransferError(f"xccl_rs weight transfer: the update info names {senders} senders")
            rank = senders + members.index(self._member)
            self._sync.join(self._root(), generation, rank, senders + len(members), senders,
                            device=self._info.bucket_device)

        def _drop_group(self) -> None:
            if self._sync is not None:
                self._sync.drop()

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
            rank = self._sync.group.rank()
            receiver = self._sync.receiver(self.device, self._info.bucket_device)
            refused: Optional[str] = None
            try:
                for name, tensor in receiver.receive(copy=True):
                    if refused is not None:
                        continue  # drained: the sender waits for every receiver
                    try:
                        _load_one(self.model, self._guard, name, tensor)
                    except Exception as e:  # noqa: BLE001 - the model's refusal, whatever it raised
                        refused = f"{name!r}: {type(e).__name__}: {e}"
                    del tensor
                if refused is not None:
                    _publish(root, _Keys.refusal(k, rank), refused)
                all_ok = vote(self._sync.group, refused is None)
            except Exception as e:
                self._failed()
                raise WeightTransferError(
                    f"xccl_rs weight transfer: round {k} failed on group rank {rank}: {e}; the next round "
                    "builds a new group"
                ) from e
            self.last_stats = receiver.last_stats
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
            _loading._layerwise()[0].finalize_layerwise_reload(self.model, self.model_config)

        def shutdown(self) -> None:
            self._drop_group()
            self._sync = None
            self._store = None
            self._info = None
            self._member = None
            self._round = None

    return XcclRsWeightTransferEngine
