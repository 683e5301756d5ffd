"""Several trainer ranks send (``XcclRsTrainerInitInfo(senders="all")``), through vLLM's own classes.

Two trainer processes in a gloo default group hold the same transformers Qwen2, FSDP2-sharded
(``fully_shard``) over that group: every parameter a ``Shard(0)`` DTensor, the vocabulary (257
rows) and the MLP (129) uneven over two ranks, the embedding and the head larger than a bucket.
Each calls vLLM's ``WeightTransferTrainerFactory.trainer_init`` and ``send_weights``; rank 0 alone
drives the workers through the client (the other rank's client fails the test if called). The
workers are the vLLM worker processes of test_vllm_engine.py (_vllm_harness.py).

After every round each worker's parameters are compared bit for bit with what torch's own
``full_tensor()`` of the trainers' parameters (its all-gather, run after the round) gives after
sharding and fusing -- never with the engine's assembly. Shares: every byte is sent once, by one
trainer (full tensors) or by its shard's owner (shards), and every trainer sends some. Memory:
a sharded round gathers nothing (``DTensor.full_tensor`` is counted on each trainer) and raises
no trainer's RSS by a full tensor (``PeakRss``, python_tests/peak_rss.py).

Run by scripts/test_vllm.sh (a venv with vLLM); elsewhere not collected (conftest.py).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("vllm.distributed.weight_transfer")

import torch  # noqa: E402

import _vllm_harness as H  # noqa: E402

TIMEOUT_S = 30.0  # the engine's group and store timeout
N = 2  # trainer ranks
WORKERS = 2  # single-worker replicas
BUCKET = 8 << 10
SHAPE = dict(vocab=257, hidden=64, inter=129)  # uneven over 2; embedding and head 16 / 32 KB: above a bucket
ROUND = ["start_weight_update", "update_weights", "finish_weight_update"]


def options(**kw) -> dict:
    out = dict(senders="all", num_trainer_ranks=N, bucket_bytes=BUCKET, timeout_s=TIMEOUT_S)
    out.update(kw)
    return out


class Setup:
    def __init__(self, ctx, tmp_path):
        self.ctx, self.tmp_path = ctx, tmp_path
        self.made = []

    def __call__(self, cfg: H.Cfg, replicas: int = WORKERS, shard: bool = True, group: bool = True):
        client = H.PipeClient([])
        for r in range(replicas):
            client.replicas.append(H.start_workers(self.ctx, cfg, r, 1, replicas))
        trainers = H.Trainers(self.ctx, cfg, N, client, str(self.tmp_path / f"store{len(self.made)}"), shard=shard,
                              group=group)
        self.made.append((client, trainers))
        return client, trainers

    def close(self):
        for client, trainers in self.made:
            trainers.close()
            H.stop_workers(client.workers)


@pytest.fixture
def setup(ctx, tmp_path):
    s = Setup(ctx, tmp_path)
    yield s
    s.close()


def check(client: H.PipeClient, cfg: H.Cfg, ref: dict, only=None) -> None:
    """Every worker holds ``ref`` (torch's full tensors of the trainers' parameters), bit for bit."""
    for w in client.workers:
        got, want = w.call("params"), H.expected_params(cfg, ref, 1, 0)
        if only is not None:
            got, want = {k: got[k] for k in only}, {k: want[k] for k in only}
        bad = H.compare(got, want)
        assert not bad, f"{w}: " + "; ".join(bad)


def sent(res: list) -> list:
    """The trainers' answers to a round that must have worked."""
    bad = [f"trainer {r}: {o}" for r, o in enumerate(res) if not isinstance(o, dict) or "error" in o]
    assert not bad, "\n".join(bad)
    return res


def nbytes(ref: dict) -> int:
    return sum(t.numel() * t.element_size() for t in ref.values())


@pytest.mark.parametrize("sharded", [False, True], ids=["full", "sharded"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_two_trainers_fsdp2(setup, dtype, sharded):
    """2 FSDP2 trainers -> 2 workers, two rounds: full tensors from the source's ``iter_full()``
    shared out, or each trainer's shards from ``iter_local()`` as they are."""
    cfg = H.Cfg(dtype=dtype, **SHAPE)
    client, trainers = setup(cfg)
    model = trainers.all("model_info")[0]
    assert model["placements"] == ["(Shard(dim=0),)"], model
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(model["uneven"]), model
    assert model["largest"] > BUCKET, model
    trainers.all("init", N + WORKERS, options(sharded=sharded))
    for seed in (1, 2):
        res = sent(trainers.all("send", seed))
        ref = trainers.all("reference")[0]
        check(client, cfg, ref)
        assert sum(r["bytes"] for r in res) == nbytes(ref), res  # every byte sent once
        assert all(r["bytes"] > 0 and r["shared"] for r in res), res  # each trainer sends a share
        # sharded: no trainer gathers a full tensor; full: each gathers every one (ModuleSource)
        assert [r["full_tensor_calls"] for r in res] == [0 if sharded else len(ref)] * N, res
        assert [r["generation"] for r in res] == [1] * N, res  # the group is kept between rounds
    assert client.calls == ["init_weight_transfer_engine"] + ROUND * 2


def test_weights_given_per_round(setup):
    """An engine made without a source: ``send_weights(weights)`` on every trainer. One plain
    tensor: one trainer sends it, the other sends nothing and allocates nothing; then the
    parameters as they are (FSDP2's DTensors): each trainer sends its shards, nothing gathered."""
    cfg = H.Cfg(dtype="bfloat16", **SHAPE)
    client, trainers = setup(cfg)
    trainers.all("init", N + WORKERS, options(source=False))
    res = sent(trainers.all("send", 5, "norm"))
    ref = trainers.all("reference")[0]
    check(client, cfg, ref, only=["model.norm.weight"])
    assert sorted(r["bytes"] > 0 for r in res) == [False, True], res
    idle = [r for r in res if r["bytes"] == 0][0]
    assert idle["allocated"] == [False, False], res
    res = sent(trainers.all("send", 6, "params"))
    ref = trainers.all("reference")[0]
    check(client, cfg, ref)
    assert sum(r["bytes"] for r in res) == nbytes(ref) and all(r["bytes"] > 0 for r in res), res
    assert [r["full_tensor_calls"] for r in res] == [0] * N, res
    # a tensor the workers' model does not have: refused, and every trainer rank raises, naming
    # it and the workers (rank 0 sees the refusals; it tells rank 1 how the round ended)
    res = trainers.all("send", 7, "unknown")
    for r, o in enumerate(res):
        msg = o.get("error", "")
        assert "refused" in msg and "'model.layers.0.mlp.extra_bias': KeyError" in msg, (r, o)
        assert "replica dp=0" in msg and "replica dp=1" in msg, (r, msg)
    assert "reported by trainer rank 0" in res[1]["error"], res[1]
    res = sent(trainers.all("send", 8, "params"))  # the group ran that round to its end: kept
    check(client, cfg, trainers.all("reference")[0])
    assert [o["generation"] for o in res] == [1] * N, res


def test_sharded_trainers_hold_no_full_tensor(setup):
    """Each trainer's RSS high-water mark over a sharded round stays within its two buckets and
    a slack, far below one full tensor (the embedding, 8.4 MB); the control: the same meter over a
    round of ``iter_full()`` (FSDP's gathers) sees at least that tensor."""
    cfg = H.Cfg(dtype="float32", vocab=16411, hidden=128, inter=129, layers=1)
    bucket = 256 << 10
    client, trainers = setup(cfg)
    largest = trainers.all("model_info")[0]["largest"]
    slack = 1 << 20  # Python's arenas and torch's small tensors, touched anew after the trim
    report = []
    for sharded in (True, False):
        trainers.all("init", N + WORKERS, options(sharded=sharded, bucket_bytes=bucket))
        sent(trainers.all("send", 1))  # the group, its windows and the lazy imports are not the round's
        res = sent(trainers.all("send", 2))
        ref = trainers.all("reference")[0]
        check(client, cfg, ref)
        trainers.all("shutdown")
        for r, o in enumerate(res):
            report.append(f"{'sharded' if sharded else 'iter_full'} trainer {r}: +{o['rss'] / 1e6:.2f} MB, "
                          f"{o['full_tensor_calls']} full_tensor() calls")
            if sharded:
                assert o["full_tensor_calls"] == 0 and o["rss"] <= 2 * bucket + slack < largest, report
            else:
                assert o["rss"] >= 0.9 * largest, report
    print(f"\nlargest tensor {largest / 1e6:.2f} MB, buckets {bucket / 1e6:.2f} MB\n" + "\n".join(report))


def test_worker_dies_then_next_round(setup):
    """A worker dies in the middle of round 2: both trainers fail within the timeout, naming it;
    round 3 builds a new generation over the worker left."""
    import time

    cfg = H.Cfg(dtype="bfloat16", **SHAPE)
    client, trainers = setup(cfg)
    trainers.all("init", N + WORKERS, options(sharded=True))
    sent(trainers.all("send", 10))
    check(client, cfg, trainers.all("reference")[0])
    dead = client.replicas[1]
    pid = dead[0].call("pid")
    dead[0].call("die_after_loading", 5)
    t0 = time.monotonic()
    res = trainers.all("send", 11)
    assert time.monotonic() - t0 < TIMEOUT_S + 10
    for r, o in enumerate(res):
        assert "error" in o and o["elapsed"] < TIMEOUT_S, (r, o)
        assert "replica dp=1" in o["error"] and f"pid {pid}" in o["error"], (r, o["error"])
    dead[0].proc.join(10)
    assert dead[0].proc.exitcode == 17
    assert client.replicas[0][0].call("meta_params") == []
    client.replicas = [client.replicas[0]]  # the client no longer calls the dead replica
    res = sent(trainers.all("send", 12))
    check(client, cfg, trainers.all("reference")[0])
    assert [o["generation"] for o in res] == [2] * N, res


def test_trainer_dies_mid_round(setup):
    """Trainer rank 1 dies in the middle of a round: rank 0 fails within the timeout, naming it,
    and the workers end the round with whole layers."""
    cfg = H.Cfg(dtype="bfloat16", **SHAPE)
    client, trainers = setup(cfg)
    trainers.all("init", N + WORKERS, options(sharded=True))
    sent(trainers.all("send", 20))
    check(client, cfg, trainers.all("reference")[0])
    trainers.all("die_in_next_round", 5, ranks=[1])
    res = trainers.all("send", 21)
    assert res[1] == ("died", 17), res[1]
    assert "error" in res[0] and res[0]["elapsed"] < TIMEOUT_S, res[0]
    assert "trainer rank 1" in res[0]["error"], res[0]["error"]
    for w in client.workers:
        assert w.call("meta_params") == [], w


def test_refused_on_every_rank(setup):
    """``senders="all"`` refused, by every trainer rank, naming why: trainers without a process
    group; a trainer whose ``rank`` is not its rank in the group (the ranks agree first, so the
    rank that is right raises too)."""
    cfg = H.Cfg(dtype="bfloat16", **SHAPE)
    client, trainers = setup(cfg, replicas=0, shard=False, group=False)
    res = trainers.all("init", N + 1, options(), errors=True)
    for r, o in enumerate(res):
        assert o[0] == "error" and "senders='all' makes several trainer ranks senders" in o[1] and "init_process_group" in o[1], (r, o)
    client, trainers = setup(cfg, replicas=0, shard=False)
    res = trainers.all("init", N + 1, options(rank=0), errors=True)
    for r, o in enumerate(res):
        assert o[0] == "error" and "trainer rank 1: ValueError: its rank is 0, but it is rank 1" in o[1], (r, o)
    assert client.calls == []


def test_refused_in_process():
    """The same refusals in this process (no default group; then a one-rank one), and
    ``sharded=True`` without ``senders="all"``."""
    import datetime

    import torch.distributed as dist
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from xccl_rs.vllm_engine import XcclRsTrainerInitInfo

    if dist.is_initialized():
        pytest.skip("needs a process without a default group")
    client = H.PipeClient([])

    def init(**kw):
        return WeightTransferTrainerFactory.trainer_init(XcclRsTrainerInitInfo(**kw), client=client)

    for rank in (0, 1):
        with pytest.raises(ValueError, match="but there is none: call torch.distributed.init_process_group"):
            init(world_size=3, rank=rank, senders="all", num_trainer_ranks=2)
    with pytest.raises(ValueError, match="sharded=True .* needs senders='all'"):
        init(world_size=2, rank=0, sharded=True)
    with pytest.raises(ValueError, match="senders 'some' is not one of"):
        init(world_size=2, rank=0, senders="some")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=10))
    try:
        with pytest.raises(ValueError, match="num_trainer_ranks 2, but the trainer process group has 1 ranks"):
            init(world_size=3, rank=0, senders="all", num_trainer_ranks=2)
    finally:
        dist.destroy_process_group()
    assert client.calls == []
