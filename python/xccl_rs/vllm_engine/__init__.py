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

Importing this package does not import vLLM; its engine classes are made on first access
(_infos.py, _worker.py, _trainer.py); _session.py has what both sides share.
"""

from __future__ import annotations

import logging

from ._session import GROUP_BACKENDS, GROUP_NAME, SENDERS, _publish  # noqa: F401 (this package's names)
from .trl import TRLWeightTransfer

logger = logging.getLogger(__name__)

BACKEND = "xccl_rs"
#: What ``register`` registers, and the classes this package makes on first access.
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


def _make_classes() -> None:
    if all(n in globals() for n in _CLASSES):
        return
    from ._infos import make_infos
    from ._trainer import make_trainer_engine
    from ._worker import make_worker_engine

    try:
        from vllm.distributed.weight_transfer import base
    except ImportError as e:
        raise ImportError(f"xccl_rs.vllm_engine: the engine classes subclass vLLM's, and vLLM does not import: {e}") from e
    infos = make_infos(base)
    for cls in (*infos, make_worker_engine(base, *infos[:2]), make_trainer_engine(base, *infos)):
        cls.__module__ = __name__  # picklable by module and name (the package's __getattr__)
        cls.__qualname__ = cls.__name__
        globals()[cls.__name__] = cls
    # A trainer that imports the init info class can use the factory at once, plugin loaded or not.
    register()
