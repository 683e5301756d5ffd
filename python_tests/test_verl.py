"""The verl checkpoint engine "xccl_rs" (xccl_rs.verl_engine), driven through the real verl
package's registry and base class the way verl's CheckpointEngineManager drives it:
prepare on every worker -> build_topology -> init_process_group -> send_weights on every
trainer rank / receive_weights on every rollout rank -> finalize.

Four processes: trainer ranks 0, 1 (actor world 2; rank 0 is the master) and rollout workers
2, 3. The trainers' weight generator is collective over the trainer group (an all_reduce per
tensor), so trainer rank 1, outside the sync group, must drain it or rank 0 hangs. Skipped
when verl is not installed.
"""

from __future__ import annotations

import os
import pickle

import pytest

pytest.importorskip("verl.checkpoint_engine")

from harness import ctx, run_ranks  # noqa: E402
from test_weight_sync import compare, make_tensors  # noqa: E402

ACTOR_WS, ROLLOUT_WS = 2, 2
BUCKET = 64 << 10


def _exchange(store, key, rank, world, value):
    """all-gather of picklable values through the harness store (the manager's ray.get)."""
    store.set(f"{key}/{rank}", pickle.dumps(value))
    return [pickle.loads(store.get(f"{key}/{r}")) for r in range(world)]


def w_verl_engine(rank, world_size, device="cpu", bucket_device="cpu"):
    import asyncio

    import torch
    import torch.distributed as dist

    import xccl_rs.verl_engine as ve
    from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry

    store = ctx().connect_store()
    trainers = dist.new_group([0, 1])  # the trainers' own collectives (every rank calls new_group)
    is_trainer = rank < ACTOR_WS
    out = {"problems": [], "keys": []}
    cls = CheckpointEngineRegistry.get("xccl_rs")
    if cls is not ve.XcclRsCheckpointEngine or not issubclass(cls, CheckpointEngine):
        out["problems"].append(f"registry gave {cls}")

    def weights(step):
        for name, t in make_tensors(f"verl{step}", BUCKET):
            x = torch.ones(1)
            dist.all_reduce(x, group=trainers)  # producing a weight is collective
            if x.item() != ACTOR_WS:
                raise AssertionError("trainer all_reduce")
            yield name, t

    async def aweights(step):
        for item in weights(step):
            yield item

    async def receive(engine, step):
        return [item async for item in engine.receive_weights(global_steps=step)]

    step = 0
    for rebuild in (False, True):
        engine = CheckpointEngineRegistry.new(
            "xccl_rs", bucket_size=BUCKET, is_master=(rank == 0),
            rebuild_group=rebuild, device=device, bucket_device=bucket_device, timeout_s=30,
            group_name=f"t{int(rebuild)}",
        )
        for _ in range(2):
            meta = engine.prepare()
            metadata = _exchange(store, f"meta{step}", rank, world_size, meta)
            actor_kwargs, rollout_kwargs = cls.build_topology(ACTOR_WS, ROLLOUT_WS, metadata)
            kw, i = (actor_kwargs, rank) if is_trainer else (rollout_kwargs, rank - ACTOR_WS)
            engine.init_process_group(**{k: v[i] for k, v in kw.items()})
            if is_trainer:
                src = aweights(step) if step % 2 else weights(step)
                metrics = asyncio.run(engine.send_weights(src, global_steps=step))
                if rank == 0 and not metrics.get("xccl_rs/sync_bytes"):
                    out["problems"].append(f"step {step}: metrics {metrics}")
            else:
                got = asyncio.run(receive(engine, step))
                out["problems"] += [f"step {step}: {n} on {t.device}" for n, t in got if t.device.type != device]
                got = [(n, t.cpu()) for n, t in got]
                out["problems"] += [f"step {step}: {p}" for p in compare(got, make_tensors(f"verl{step}", BUCKET))]
            out["keys"].append((rebuild, engine.group_key and engine.group_key[1:]))
            engine.finalize()
            step += 1
        engine._drop_group()
    return out


def test_verl_engine():
    res = run_ranks(ACTOR_WS + ROLLOUT_WS, w_verl_engine, timeout_s=120)
    problems = []
    for rank in range(ACTOR_WS + ROLLOUT_WS):
        problems += [f"rank {rank}: {p}" for p in res.value(rank)["problems"]]
    assert not problems, "\n".join(problems)
    # rank 1 is outside the group; the others keep generation 1 with rebuild_group=False and
    # build generations 1 and 2 with rebuild_group=True
    assert res.value(1)["keys"] == [(False, None), (False, None), (True, None), (True, None)]
    for rank, grank in ((0, 0), (2, 1), (3, 2)):
        assert res.value(rank)["keys"] == [
            (False, (1, 3, grank)), (False, (1, 3, grank)), (True, (1, 3, grank)), (True, (2, 3, grank))
        ], res.value(rank)["keys"]


# --------------------------------------------------------------------------------------
# elastic rollouts: one dies mid-sync, the next round goes to the others, a newcomer joins
# --------------------------------------------------------------------------------------

# The processes taking part in each round: rank 0 is the trainer (actor world 1), ranks 1-3
# rollouts. Rank 2 dies in the middle of round 1. Rank 1 stalls for longer than the timeout in
# round 3, which fails that group on every member although nobody left: round 4, with the same
# members, must not reuse it. Rank 3 is new in round 5; round 6 repeats round 5's members.
ELASTIC_ROUNDS = [[0, 1, 2], [0, 1, 2], [0, 1], [0, 1], [0, 1], [0, 1, 3], [0, 1, 3]]
DIES_IN_ROUND, DYING_RANK = 1, 2
STALLS_IN_ROUND, STALLING_RANK = 3, 1
ELASTIC_TIMEOUT_S = 4.0
FAILING_ROUNDS = (DIES_IN_ROUND, STALLS_IN_ROUND)


def _elastic_tensors(step):
    """Several buckets' worth, so that a failure falls in the middle of the sync."""
    return [(f"{i}.{n}", t) for i in range(3) for n, t in make_tensors(f"elastic{step}.{i}", BUCKET)]


def w_verl_elastic(rank, world_size, rebuild):
    import asyncio
    import time

    from verl.checkpoint_engine import CheckpointEngineRegistry

    import xccl_rs.verl_engine  # noqa: F401 - what verl's custom_backend_module does: registers "xccl_rs"

    store = ctx().connect_store()
    cls = CheckpointEngineRegistry.get("xccl_rs")
    engine = CheckpointEngineRegistry.new(
        "xccl_rs", bucket_size=BUCKET, is_master=(rank == 0), rebuild_group=rebuild, device="cpu",
        timeout_s=ELASTIC_TIMEOUT_S, group_name=f"elastic{int(rebuild)}",
    )
    out = {"problems": [], "rounds": {}}

    async def receive(step):
        got = []
        async for item in engine.receive_weights(global_steps=step):
            got.append(item)
            if step == DIES_IN_ROUND and rank == DYING_RANK and len(got) == 2:
                store.set("died_at", repr(time.time()))
                os._exit(0)  # a rollout dies with buckets still to come
            if step == STALLS_IN_ROUND and rank == STALLING_RANK and len(got) == 2:
                time.sleep(ELASTIC_TIMEOUT_S + 1)  # alive, but too slow for the group's timeout
        return got

    for step, members in enumerate(ELASTIC_ROUNDS):
        if rank not in members:
            continue
        # What verl's manager does each update: prepare on the live workers, then the topology.
        me = members.index(rank)
        store.set(f"meta{step}/{me}", pickle.dumps(engine.prepare()))
        metadata = [pickle.loads(store.get(f"meta{step}/{i}")) for i in range(len(members))]
        actor_kwargs, rollout_kwargs = cls.build_topology(1, len(members) - 1, metadata)
        kw, i = (actor_kwargs, 0) if rank == 0 else (rollout_kwargs, me - 1)
        group_before = engine.group
        engine.init_process_group(**{k: v[i] for k, v in kw.items()})
        record = {"key": engine.group_key and engine.group_key[1:], "kept": engine.group is group_before}
        expected = _elastic_tensors(step)
        try:
            if rank == 0:
                asyncio.run(engine.send_weights(iter(expected), global_steps=step))
            else:
                out["problems"] += [f"round {step}: {p}" for p in compare(asyncio.run(receive(step)), expected)]
        except Exception as e:  # noqa: BLE001 - the round with the dead rollout must raise
            record["error"] = f"{type(e).__name__}: {e}"
            record["late_s"] = time.time() - float(store.get("died_at")) if step == DIES_IN_ROUND else None
        engine.finalize()
        out["rounds"][step] = record
    return out


def survivors_problems(res, ranks, must_fail, death_round: int, named) -> list[str]:
    """What went wrong on the surviving ``ranks`` of a run in which one rank dies in round
    ``death_round``: the problems each found, a round that ``must_fail(step, rank)`` but did not,
    or failed more than the timeout after the death or with an error not naming ``named(rank)``
    (None: not checked), and any other round that failed."""
    problems = []
    for rank in ranks:
        out = res.value(rank)
        assert out is not None, res.report()
        problems += [f"rank {rank}: {p}" for p in out["problems"]]
        for step, rec in out["rounds"].items():
            if not must_fail(step, rank):
                if "error" in rec:
                    problems.append(f"rank {rank}: round {step} failed: {rec['error']}")
                continue
            name = named(rank) if step == death_round else None
            if "error" not in rec:
                problems.append(f"rank {rank}: round {step} did not fail")
            elif step == death_round and rec["late_s"] > ELASTIC_TIMEOUT_S + 2:
                problems.append(f"rank {rank}: round {step} failed {rec['late_s']:.1f} s after the death")
            elif name is not None and name not in rec["error"]:
                problems.append(f"rank {rank}: the error does not name {name}: {rec['error']}")
    return problems


@pytest.mark.parametrize("rebuild", [False, True], ids=["keep-group", "rebuild-group"])
def test_verl_engine_elastic_rollouts(rebuild):
    res = run_ranks(4, w_verl_elastic, rebuild, timeout_s=120, expect_fail_ranks=(DYING_RANK,))
    problems = survivors_problems(
        res, (0, 1, 3), lambda step, rank: step in FAILING_ROUNDS and rank in ELASTIC_ROUNDS[step],
        DIES_IN_ROUND, lambda rank: "rank 2" if rank == 0 else None,  # rank 0 names the dead one's group rank
    )
    assert not problems, "\n".join(problems)
    keys = {step: rec["key"] for step, rec in res.value(0)["rounds"].items()}
    kept = {step: rec["kept"] for step, rec in res.value(0)["rounds"].items()}
    # (generation, world size, rank): with rebuild_group off the same members keep their group
    # (rounds 0 -> 1, 2 -> 3, 5 -> 6) but a failed one is never reused (round 4); with it on
    # every round has a new one.
    sizes = [len(m) for m in ELASTIC_ROUNDS]
    if rebuild:
        assert keys == {step: (step + 1, sizes[step], 0) for step in range(len(sizes))}, keys
    else:
        gens = [1, 1, 2, 2, 3, 4, 4]
        assert keys == {step: (gens[step], sizes[step], 0) for step in range(len(sizes))}, keys
        assert [kept[s] for s in range(len(sizes))] == [False, True, False, True, False, False, True], kept


def test_registry_and_topology():
    """In-process: registration, the ABC is satisfied, topology of 3 trainers and 2 rollouts."""
    import xccl_rs.verl_engine as ve
    from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry

    assert CheckpointEngineRegistry.get("xccl_rs") is ve.XcclRsCheckpointEngine
    eng = CheckpointEngineRegistry.new("xccl_rs", bucket_size=1 << 20, is_master=False)
    assert isinstance(eng, CheckpointEngine)
    assert eng.prepare() == {"is_master": False, "group": None}
    master = {"is_master": True, "group": None, "addr": "h", "port": 1, "nonce": "n",
              "generation": 0, "rebuild_group": False}
    other = {"is_master": False, "group": None}
    a, r = ve.XcclRsCheckpointEngine.build_topology(3, 2, [master, other, other, other, other])
    assert a["rank"] == [0, -1, -1] and r["rank"] == [1, 2]
    assert a["world_size"] == [3] * 3 and r["world_size"] == [3] * 2
    assert a["generation"] == [1] * 3
    # everyone already holds generation 1 of this master: kept
    held = dict(master, generation=1, group=("n", 1, 3, 0))
    members = [held, other, other] + [{"is_master": False, "group": ("n", 1, 3, k)} for k in (1, 2)]
    assert ve.XcclRsCheckpointEngine.build_topology(3, 2, members)[1]["generation"] == [1, 1]
    # a new rollout worker (no group): rebuilt as generation 2
    members[-1] = other
    assert ve.XcclRsCheckpointEngine.build_topology(3, 2, members)[1]["generation"] == [2, 2]
    with pytest.raises(ValueError, match="master"):
        ve.XcclRsCheckpointEngine.build_topology(1, 1, [other, other])


# --------------------------------------------------------------------------------------
# verl's own manager and rollout harness, over Ray (opt-in: slow, several processes)
# --------------------------------------------------------------------------------------


def _tiny_qwen2(path) -> str:
    """A 2-layer bf16 Qwen2 and a WordLevel tokenizer saved locally (no hub access)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(252)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return str(path)


def _trainer_cls():
    """A plain verl Worker on the trainer side that sends a Hugging Face model's state_dict
    (verl's FSDP trainer engine needs an accelerator)."""
    import torch

    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import Dispatch, register

    class Trainer(Worker):
        def __init__(self, model_path, checkpoint_engine_config):
            super().__init__()
            import xccl_rs.verl_engine  # noqa: F401  (registers "xccl_rs")
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.bfloat16)
            cfg = checkpoint_engine_config
            self.checkpoint_engine = CheckpointEngineRegistry.new(
                cfg.backend, bucket_size=cfg.update_weights_bucket_megabytes << 20,
                is_master=(self.rank == 0), **cfg.engine_kwargs.get(cfg.backend, {}),
            )

        @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
        async def update_weights(self, global_steps=None, mode="auto"):
            return await self.checkpoint_engine.send_weights(
                iter(self.model.state_dict().items()), global_steps=global_steps
            )

        @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
        def execute_checkpoint_engine(self, method, *args, **kwargs):
            return getattr(self.checkpoint_engine, method)(*args, **kwargs)

    return Trainer


def _run_manager_over_ray(model_dir: str, rebuild_group: bool) -> None:
    """verl's CheckpointEngineManager.update_weights x3 from 2 trainers to 2 rollout workers
    (verl's CheckpointEngineWorker + MockServerAdapter), each followed by verl's check_weights.
    Runs in a child process of its own (see the test below)."""
    import asyncio

    import ray

    from tests.checkpoint_engine.test_utils import create_rollout_worker_group
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.single_controller.ray.base import split_resource_pool
    from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig

    model_path = _tiny_qwen2(model_dir)
    here = os.path.dirname(os.path.abspath(__file__))
    ray.init(num_cpus=4, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": here, "OMP_NUM_THREADS": "1"}})
    try:
        cfg = CheckpointEngineConfig(
            backend="xccl_rs", update_weights_bucket_megabytes=1,
            custom_backend_module="xccl_rs.verl_engine",
            engine_kwargs={"xccl_rs": {"rebuild_group": rebuild_group, "timeout_s": 60, "device": "cpu"}},
        )
        model_config = HFModelConfig(path=model_path, use_remove_padding=True)
        rollout_config = RolloutConfig(name="vllm", checkpoint_engine=cfg)
        pool = RayResourcePool(process_on_nodes=[4], use_gpu=False, max_colocate_count=1)
        trainer_pool, rollout_pool = split_resource_pool(pool, [2, 2])
        actor_wg = RayWorkerGroup(
            resource_pool=trainer_pool, device_name="cpu",
            ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(_trainer_cls()), model_path=model_path,
                                                   checkpoint_engine_config=cfg),
        )
        rollout, replicas = asyncio.run(create_rollout_worker_group(rollout_pool, model_config, rollout_config))
        manager = CheckpointEngineManager(config=cfg, actor_wg=actor_wg, replicas=replicas)
        for step in range(3):
            metrics = manager.update_weights(global_steps=step)
            assert metrics.get("xccl_rs/sync_bytes", 0) > 0, metrics
            rollout.check_weights()
    finally:
        ray.shutdown()


@pytest.mark.skipif(bool(os.environ.get("XCCL_RS_SKIP_VERL_RAY")), reason="XCCL_RS_SKIP_VERL_RAY is set")
@pytest.mark.parametrize("rebuild_group", [False, True])
def test_verl_manager_over_ray(tmp_path, rebuild_group):
    """verl's own manager and Ray worker groups driving the engine. Ray's driver runs in a child
    process: Ray's core worker can crash during interpreter teardown (after ray.shutdown()),
    which must neither kill the pytest process nor count as our failure; the child leaves with
    os._exit once every check has passed, and any failure before that is its exit status."""
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        "import os, sys, traceback\n"
        "import test_verl\n"
        "try:\n"
        f"    test_verl._run_manager_over_ray({str(tmp_path / 'qwen2')!r}, {rebuild_group!r})\n"
        "except BaseException:\n"
        "    traceback.print_exc(); sys.stdout.flush(); sys.stderr.flush(); os._exit(1)\n"
        "sys.stdout.flush(); sys.stderr.flush(); os._exit(0)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], cwd=here, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"


# --------------------------------------------------------------------------------------
# senders: all -- every trainer rank sends its share
# --------------------------------------------------------------------------------------


def _dtensor_step(step):
    """Whether a step sends DTensors (each trainer its shards) rather than full tensors."""
    return step % 2 == 1


def _sharded_tensors(step):
    """Float tensors of the mixed set, as DTensors are made of them (contiguous; 0-d replicated)."""
    return [(n, t.contiguous()) for n, t in make_tensors(f"verl{step}", BUCKET) if t.is_floating_point()]


def w_verl_all_senders(rank, world_size):
    import asyncio

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import xccl_rs.verl_engine as ve
    from verl.checkpoint_engine import CheckpointEngineRegistry

    store = ctx().connect_store()
    trainers = dist.new_group([0, 1])
    is_trainer = rank < ACTOR_WS
    mesh = DeviceMesh.from_group(trainers, "cpu") if is_trainer else None
    cls = CheckpointEngineRegistry.get("xccl_rs")
    out = {"problems": [], "keys": [], "bytes": []}

    def weights(step):
        if _dtensor_step(step):  # the trainer's shards as they are (FSDP2's state dict without full_tensor())
            for name, t in _sharded_tensors(step):
                yield name, distribute_tensor(t, mesh, [Shard(0) if t.dim() else Replicate()], src_data_rank=None)
            return
        for name, t in make_tensors(f"verl{step}", BUCKET):  # full tensors on every rank, made collectively
            x = torch.ones(1)
            dist.all_reduce(x, group=trainers)
            yield name, t

    engine = CheckpointEngineRegistry.new(
        "xccl_rs", bucket_size=BUCKET, is_master=(rank == 0), device="cpu", timeout_s=30,
        group_name="all", senders="all",
    )
    for step in range(4):
        metadata = _exchange(store, f"allmeta{step}", rank, world_size, engine.prepare())
        actor_kwargs, rollout_kwargs = cls.build_topology(ACTOR_WS, ROLLOUT_WS, metadata)
        kw, i = (actor_kwargs, rank) if is_trainer else (rollout_kwargs, rank - ACTOR_WS)
        engine.init_process_group(**{k: v[i] for k, v in kw.items()})
        if is_trainer:
            metrics = asyncio.run(engine.send_weights(weights(step), global_steps=step))
            out["bytes"].append(metrics["xccl_rs/sync_bytes"])
        else:
            got = asyncio.run(_receive_all(engine, step))
            expected = _sharded_tensors(step) if _dtensor_step(step) else make_tensors(f"verl{step}", BUCKET)
            out["problems"] += [f"step {step}: {p}" for p in compare(_by_name(got), _by_name(expected))]
        out["keys"].append(engine.group_key and engine.group_key[1:])
        engine.finalize()
    engine._drop_group()
    return out


def _by_name(items):
    """With several senders tensors complete in any order (each sender's buckets take turns)."""
    return sorted(items, key=lambda item: item[0])


async def _receive_all(engine, step):
    return [item async for item in engine.receive_weights(global_steps=step)]


def test_verl_engine_all_senders():
    """senders: all over verl's registry: both trainers are group ranks (0, 1), the rollouts 2, 3;
    full tensors from a collective generator and DTensor shards in turn, one kept group."""
    res = run_ranks(ACTOR_WS + ROLLOUT_WS, w_verl_all_senders, timeout_s=180)
    problems = [f"rank {r}: {p}" for r in range(ACTOR_WS + ROLLOUT_WS) for p in res.value(r)["problems"]]
    assert not problems, "\n".join(problems)
    for rank in range(ACTOR_WS + ROLLOUT_WS):
        assert res.value(rank)["keys"] == [(1, 4, rank)] * 4, res.value(rank)["keys"]
    for step in range(4):  # both trainers sent a share
        assert all(res.value(r)["bytes"][step] > 0 for r in range(ACTOR_WS)), [res.value(r)["bytes"] for r in range(2)]


def test_topology_all_senders():
    """In-process: with senders: all, every trainer rank is a sender, the rollouts follow."""
    import xccl_rs.verl_engine as ve

    master = {"is_master": True, "group": None, "addr": "h", "port": 1, "nonce": "n",
              "generation": 0, "rebuild_group": False, "senders": "all"}
    other = {"is_master": False, "group": None}
    a, r = ve.XcclRsCheckpointEngine.build_topology(3, 2, [master, other, other, other, other])
    assert a["rank"] == [0, 1, 2] and r["rank"] == [3, 4]
    assert a["world_size"] == [5] * 3 and r["world_size"] == [5] * 2
    assert a["senders"] == [3] * 3 and r["senders"] == [3] * 2
    held = dict(master, generation=1, group=("n", 1, 5, 0))
    members = [held] + [{"is_master": False, "group": ("n", 1, 5, k)} for k in (1, 2, 3, 4)]
    assert ve.XcclRsCheckpointEngine.build_topology(3, 2, members)[0]["generation"] == [1] * 3
    members[2] = other  # a trainer without the group (a new one): rebuilt
    assert ve.XcclRsCheckpointEngine.build_topology(3, 2, members)[0]["generation"] == [2] * 3
    with pytest.raises(ValueError, match=r"senders .some. is not one of \(.rank0., .all., .node.\)"):
        ve.XcclRsCheckpointEngine(bucket_size=1 << 20, senders="some")


# A trainer dies in round 1; round 2 has trainer 0 alone (verl's actor world 1), round 3 the same.
DEAD_TRAINER_ROUNDS = [[0, 1, 2, 3], [0, 1, 2, 3], [0, 2, 3], [0, 2, 3]]
DEAD_TRAINER, DEAD_TRAINER_ROUND = 1, 1


def w_verl_dead_trainer(rank, world_size):
    import asyncio
    import time

    from verl.checkpoint_engine import CheckpointEngineRegistry

    import xccl_rs.verl_engine  # noqa: F401

    store = ctx().connect_store()
    cls = CheckpointEngineRegistry.get("xccl_rs")
    engine = CheckpointEngineRegistry.new(
        "xccl_rs", bucket_size=BUCKET, is_master=(rank == 0), device="cpu", timeout_s=ELASTIC_TIMEOUT_S,
        group_name="deadtrainer", senders="all",
    )
    out = {"problems": [], "rounds": {}}
    for step, members in enumerate(DEAD_TRAINER_ROUNDS):
        if rank not in members:
            continue
        actors = [r for r in members if r < ACTOR_WS]
        me = members.index(rank)
        store.set(f"dt{step}/{me}", pickle.dumps(engine.prepare()))
        metadata = [pickle.loads(store.get(f"dt{step}/{i}")) for i in range(len(members))]
        actor_kwargs, rollout_kwargs = cls.build_topology(len(actors), len(members) - len(actors), metadata)
        kw, i = (actor_kwargs, me) if rank < ACTOR_WS else (rollout_kwargs, me - len(actors))
        engine.init_process_group(**{k: v[i] for k, v in kw.items()})
        record = {"key": engine.group_key and engine.group_key[1:]}
        expected = _elastic_tensors(step)

        def weights():
            for j, item in enumerate(expected):
                if step == DEAD_TRAINER_ROUND and rank == DEAD_TRAINER and j == len(expected) // 2:
                    store.set("trainer_died_at", repr(time.time()))
                    os._exit(0)  # a sending trainer dies with half of its share unsent
                yield item

        try:
            if rank < ACTOR_WS:
                asyncio.run(engine.send_weights(weights(), global_steps=step))
            else:
                got = asyncio.run(_receive_all(engine, step))
                out["problems"] += [f"round {step}: {p}" for p in compare(_by_name(got), _by_name(expected))]
        except Exception as e:  # noqa: BLE001 - the round of the death must raise everywhere
            record["error"] = f"{type(e).__name__}: {e}"
            record["late_s"] = time.time() - float(store.get("trainer_died_at"))
        engine.finalize()
        out["rounds"][step] = record
    return out


def test_verl_engine_dead_trainer():
    """senders: all, and a sending trainer dies mid-round: every other rank raises within the
    timeout, naming it; the next round (trainer 0 alone, the rollouts) builds a new generation
    and works, and the one after keeps it."""
    res = run_ranks(4, w_verl_dead_trainer, timeout_s=180, expect_fail_ranks=(DEAD_TRAINER,))
    problems = survivors_problems(
        res, (0, 2, 3), lambda step, rank: step == DEAD_TRAINER_ROUND, DEAD_TRAINER_ROUND,
        lambda rank: f"rank {DEAD_TRAINER}",
    )
    assert not problems, "\n".join(problems)
    keys = {step: rec["key"] for step, rec in res.value(0)["rounds"].items()}
    assert keys == {0: (1, 4, 0), 1: (1, 4, 0), 2: (2, 3, 0), 3: (2, 3, 0)}, keys
    assert [res.value(2)["rounds"][s]["key"] for s in range(4)] == [(1, 4, 2), (1, 4, 2), (2, 3, 1), (2, 3, 1)]
