"""The trainer side: the engine every trainer rank makes."""

from __future__ import annotations

import json
import logging
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict
from typing import Optional

import torch
import torch.distributed as dist

from ..door import SyncGroup, SyncOptions, TrainerStore, node_address, pick_senders
from ..weight_sync._common import vote
from . import WeightTransferError
from ._session import GROUP_NAME, _Keys, _describe, _publish

logger = logging.getLogger("xccl_rs.vllm_engine")


def make_trainer_engine(base, XcclRsWeightTransferInitInfo: type, XcclRsWeightTransferUpdateInfo: type,
                        XcclRsTrainerInitInfo: type) -> type:
    """The engine every trainer rank makes, a subclass of ``base.TrainerWeightTransferEngine``
    (``base``: vLLM's ``vllm.distributed.weight_transfer.base``)."""
    ParamMeta, WeightSource = base.ParamMeta, base.WeightSource
    TrainerWeightTransferEngine = base.TrainerWeightTransferEngine

    class XcclRsTrainerWeightTransferEngine(TrainerWeightTransferEngine[XcclRsTrainerInitInfo]):
        """The trainer side (the module docstring says how a round runs). Every trainer rank
        calls ``trainer_init`` and ``send_weights``. Rank 0 drives the rounds (the store, the
        client's calls); with ``senders="rank0"`` it alone sends and the others only run the
        source's iteration (for its collectives) and allocate nothing; with ``senders="all"``
        every rank sends its share, with ``senders="node"`` every rank on rank 0's node."""

        init_info_cls = XcclRsTrainerInitInfo

        def __init__(self, *, client, source, is_sender: bool = True, rank: int = 0,
                     info: Optional[XcclRsTrainerInitInfo] = None) -> None:
            super().__init__(client=client, source=source, is_sender=is_sender, rank=rank)
            self.info = info
            self.options = self.options_of(info) if info is not None else SyncOptions(who="XcclRsTrainerInitInfo")
            self.timeout = self.options.timeout
            self._store: Optional[TrainerStore] = None  # served (rank 0), or a client of it (senders="all"/"node")
            self._root = None  # the session prefix over it
            self.session = ""
            self._trainers = None  # the trainers' process group (senders="all"/"node")
            self._sending = [0]  # the trainer ranks that send: group ranks 0 .. n_senders-1
            self._round = 0
            self._generation = 0
            self._sync = SyncGroup(self.options, name=GROUP_NAME)
            self._members: list[int] = []
            self._who: dict[int, dict] = {}  # member id -> its registration
            self._meshes: dict = {}  # (device type, owners, mesh shape) -> DeviceMesh (sharded sources)
            self.last_stats = None

        @property
        def n_senders(self) -> int:
            return len(self._sending)

        @property
        def address(self) -> str:
            return self._store.address if self._store is not None else ""

        @property
        def port(self) -> int:
            return self._store.port if self._store is not None else 0

        # ---- set-up ------------------------------------------------------------------

        @staticmethod
        def options_of(info: XcclRsTrainerInitInfo) -> SyncOptions:
            """The door's options of ``info`` (checked: a bad one raises, naming the field)."""
            return SyncOptions(who="XcclRsTrainerInitInfo", bucket_bytes=int(info.bucket_bytes), senders=info.senders,
                               payload=info.payload, fp8_scale=info.fp8_scale, fp8_select=info.fp8_select,
                               delta_base=info.delta_base, shared_memory=info.shared_memory,
                               timeout_s=float(info.timeout_s), group_backend=info.group_backend)

        @classmethod
        def trainer_init(cls, init_info: XcclRsTrainerInitInfo, *, client, source: Optional[WeightSource] = None):
            # Without a source, every send_weights() gets its tensors as an argument.
            cls.options_of(init_info)
            if init_info.senders != "rank0":
                return cls._init_several(init_info, client, source)
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
        def _init_several(cls, info: XcclRsTrainerInitInfo, client, source: Optional[WeightSource]):
            """``senders="all"`` or ``"node"``: every trainer rank checks what it can, the ranks
            agree (one all-gather over the trainers' group, which also tells where each runs:
            all raise, or none), then rank 0 opens the session and shares its store's address
            and prefix with the others."""
            n = int(info.num_trainer_ranks)
            mode = info.senders
            group = info.trainer_group
            if group is None and dist.is_available() and dist.is_initialized():
                group = dist.group.WORLD
            if group is None:
                raise ValueError(
                    f"xccl_rs trainer engine: senders={mode!r} makes several trainer ranks senders, and the trainer "
                    "ranks share the session through a torch.distributed process group, but there is none: call "
                    "torch.distributed.init_process_group on every trainer rank (or pass trainer_group), or use "
                    "senders='rank0'"
                )
            if group.size() != n:
                raise ValueError(
                    f"xccl_rs trainer engine: senders={mode!r} with num_trainer_ranks {n}, but the trainer process "
                    f"group has {group.size()} ranks: they must be the same (set num_trainer_ranks to the trainers' "
                    "group size, or pass the trainers' group as trainer_group)"
                )
            mine = None
            try:
                cls._check_counts(info)
                if info.rank != group.rank():
                    raise ValueError(f"its rank is {info.rank}, but it is rank {group.rank()} of the trainer group")
                if info.sharded and mode != "all":
                    raise ValueError(f"sharded=True sends every trainer rank's own pieces, so every rank must send: "
                                     f"it needs senders='all', not {mode!r}")
                cls._check_source_all(source, n, bool(info.sharded))
            except Exception as e:  # noqa: BLE001 - every rank raises, below
                mine = f"{type(e).__name__}: {e}"
            everyone = [None] * n
            dist.all_gather_object(everyone, (mine, node_address() if mode == "node" else None), group=group)
            bad = [f"trainer rank {r}: {e}" for r, (e, _) in enumerate(everyone) if e is not None]
            if bad:
                raise ValueError(f"xccl_rs trainer engine (senders={mode!r}) refused: " + "; ".join(bad))
            engine = cls(client=client, source=source, is_sender=info.is_sender, rank=info.rank, info=info)
            engine._trainers = group
            engine._sending = pick_senders(mode, n, [host for _, host in everyone])
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
            self._store = TrainerStore.serve(self.info.master_address, int(self.info.master_port), self.timeout)
            self.session = f"xccl_rs_vllm/{uuid.uuid4().hex}"
            self._root = self._store.under(self.session)

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
            """The other trainer ranks (``senders="all"``/``"node"``): a client of rank 0's store."""
            self._store = TrainerStore.connect(where["address"], int(where["port"]), self.timeout)
            self.session = where["session"]
            self._root = self._store.under(self.session)

        @property
        def worker_init_info(self) -> dict:
            """The init info every worker gets (``init_weight_transfer_engine``'s payload)."""
            if self._store is None or not self._store.served:
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
                return f"trainer rank {self._sending[rank]}" if self.n_senders > 1 else ""
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
            self._sync.drop()

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
            held = self._generation if self._sync.group is not None else 0
            plan, error = None, None
            if self.is_sender:
                try:
                    members = self._open_round()
                    plan = {"round": self._round, "members": members, "generation": self._generation,
                            "keep": self._sync.group is not None and members == self._members}
                except BaseException as e:
                    error, plan = e, {"error": str(e)}
            helds = [held]
            if self._trainers is not None:
                everyone = [None] * self._trainers.size()
                dist.all_gather_object(everyone, {"held": held, "plan": plan}, group=self._trainers)
                plan, helds = everyone[0]["plan"], [everyone[r]["held"] for r in self._sending]
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
            if self.rank not in self._sending:  # senders="node": a rank off rank 0's node
                for _ in pairs:  # the producer's collectives
                    pass
                self._await_report(k)
                return
            exe = future = None
            if self.is_sender:
                update_info = asdict(XcclRsWeightTransferUpdateInfo(round=k, generation=generation,
                                                                     members=list(members), senders=n))
                exe = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xccl_rs-vllm-update")
                future = exe.submit(self.client.update_weights, update_info)
            try:
                try:
                    if self._sync.group is None:
                        self._sync.join(self._root, generation, self._sending.index(self.rank), n + len(members), n,
                                        device=self.info.device)
                    stats = self._sync.sender(self.info.device).send(pairs)
                    all_ok = vote(self._sync.group, True)
                except BaseException as e:
                    self._drop_group()
                    text = str(e)
                    if future is not None and future.done() and future.exception() is not None:
                        text += f" (the workers' update_weights: {future.exception()})"
                    where = f" on trainer rank {self.rank}" if n > 1 else ""
                    senders = f", {n} sending trainer ranks" if n > 1 else ""
                    error = WeightTransferError(
                        f"xccl_rs weight transfer: round {k} (generation {generation}, {len(members)} "
                        f"workers{senders}) failed{where}: {text}{self._named(text)}. The next send_weights() "
                        "builds a new group over the workers that check in"
                    )
                    if self.is_sender:  # the trainer ranks that do not send wait for its word
                        self._report(k, str(error))
                    raise error from e
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
            """Rank 0 (``senders="all"``/``"node"``): how round ``k`` ended, for the other trainer ranks."""
            if self._trainers is None or self._trainers.size() < 2:
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
                # Without a process group of its own the mesh only says where this rank's piece
                # goes; the fp8 payload gathers each weight it quantizes (full_tensor()), so it
                # gets the default group's (every trainer rank makes the meshes in the same order).
                gathers = self.options.payload == "fp8"
                try:
                    mesh = DeviceMesh(local.device.type, ranks, _init_backend=gathers, _rank=self.rank)
                except TypeError:  # a torch without _rank: the default group's rank (the trainer rank)
                    mesh = DeviceMesh(local.device.type, ranks, _init_backend=gathers)
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
            self._store = None

    return XcclRsTrainerWeightTransferEngine
