"""The xccl_rs weight-transfer engine through vLLM's own classes (vllm==0.33.0 from PyPI).

The trainer (this process) uses vLLM's ``WeightTransferTrainerFactory`` and ``ModuleSource`` over a
transformers Qwen2; every vLLM worker is a process that makes its engine with vLLM's
``WeightTransferEngineFactory`` after loading vLLM's plugins, and is driven in the order vLLM's
worker drives it (_vllm_harness.py). After every round each worker's parameters are compared bit
for bit with what the trainer's tensors give after sharding and fusing.

Run by scripts/test_vllm.sh (a venv with vLLM); elsewhere not collected (conftest.py).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm")
pytest.importorskip("vllm.distributed.weight_transfer")

from functools import cached_property  # noqa: E402

import torch  # noqa: E402
from vllm.distributed.weight_transfer import ModuleSource, ParamMeta, WeightSource, WeightTransferTrainerFactory  # noqa: E402

import _vllm_harness as H  # noqa: E402
from xccl_rs.vllm_engine import WeightTransferError, XcclRsTrainerInitInfo  # noqa: E402

TIMEOUT_S = 30.0  # the engine's group and store timeout


class Cluster:
    """Replicas of vLLM workers (``tp`` processes each) and the trainer's client to them."""

    def __init__(self, ctx, cfg: H.Cfg, replicas: int, tp: int = 1, dp_size: int | None = None):
        self.ctx, self.cfg, self.tp = ctx, cfg, tp
        self.dp_size = dp_size or replicas
        self.client = H.PipeClient([])
        for r in range(replicas):
            self.add(r)

    def add(self, replica: int) -> list[H.WorkerHandle]:
        handles = H.start_workers(self.ctx, self.cfg, replica, self.tp, self.dp_size)
        self.client.replicas.append(handles)
        return handles

    def send_round(self, engine, model, seed: int) -> dict:
        """A training step of ``model`` (new weights from ``seed``), sent by ``engine`` and checked
        on every worker; returns the weights sent."""
        sent = H.train_step(model, seed)
        engine.send_weights()
        self.check(sent)
        return sent

    def check(self, sent: dict, replicas=None) -> None:
        """Every worker of ``replicas`` (default: all) holds ``sent``, bit for bit."""
        for replica in replicas or self.client.replicas:
            for w in replica:
                bad = H.compare(w.call("params"), H.expected_params(self.cfg, sent, len(replica), w.rank))
                assert not bad, f"{w}: " + "; ".join(bad)

    def close(self) -> None:
        H.stop_workers(self.client.workers)


@pytest.fixture
def cluster(ctx):
    made = []

    def make(*args, **kwargs):
        c = Cluster(ctx, *args, **kwargs)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@contextlib.contextmanager
def trainer(client, model, workers: int, bucket: int = 8 << 10, source=None, group: str = "xccl_rs"):
    """Trainer rank 0's engine for ``workers`` workers, shut down at the end of the block."""
    info = XcclRsTrainerInitInfo(master_address="127.0.0.1", master_port=0, world_size=1 + workers, rank=0,
                                 bucket_bytes=bucket, timeout_s=TIMEOUT_S, group_backend=group)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source or ModuleSource(model))
    try:
        yield engine
    finally:
        engine.shutdown()


ROUND = ["start_weight_update", "update_weights", "finish_weight_update"]


@pytest.mark.parametrize("workers,dtype,fp8,group", [(1, "float32", False, "xccl_rs"), (2, "float16", False, "xccl_rs"),
                                                     (3, "bfloat16", True, "xccl_rs"), (2, "bfloat16", True, "gloo")],
                         ids=["1-fp32", "2-fp16", "3-bf16-fp8", "2-bf16-fp8-gloo"])
def test_workers_two_rounds(cluster, workers, dtype, fp8, group):
    """1, 2 and 3 single-worker replicas; two rounds in a row; buckets smaller than the largest
    tensors (the embedding and lm_head are split); the shared window on one host (xccl_rs
    groups; gloo groups broadcast the buckets)."""
    cfg = H.Cfg(dtype=dtype, fp8=fp8)
    c = cluster(cfg, workers)
    model = H.hf_model(cfg)
    with trainer(c.client, model, workers, group=group) as engine:
        for seed in (1, 2):
            sent = c.send_round(engine, model, seed)
            stats = engine.last_stats
            assert stats.tensors == len(sent) and stats.buckets > 1, stats
            for w in c.client.workers:  # the engine ran vLLM's layerwise reload
                assert w.call("layers_on_meta_at_start") > 0, w
            assert stats.shared_window == (group == "xccl_rs"), stats
        assert c.client.calls == ["init_weight_transfer_engine"] + ROUND * 2
        assert engine._generation == 1  # the group was kept between the rounds


def test_tensor_parallel_replica(cluster):
    """One replica with tensor parallelism 2: both workers receive every tensor and keep their
    shard (fused qkv / gate_up, vocabulary and row-parallel splits), fp8 kept in fp8."""
    cfg = H.Cfg(dtype="bfloat16", fp8=True)
    c = cluster(cfg, 1, tp=2)
    model = H.hf_model(cfg)
    with trainer(c.client, model, 2, bucket=4 << 10) as engine:
        for seed in (3, 4):
            c.send_round(engine, model, seed)


def test_replica_killed_mid_update_then_next_round(cluster):
    """A replica dies in the middle of round 2: the trainer's error names it within the timeout,
    the survivors' layers hold whole weights of round 1 or 2 (none on meta, none half loaded);
    round 3 goes to the replicas left."""
    cfg = H.Cfg(dtype="bfloat16")
    c = cluster(cfg, 3)
    model = H.hf_model(cfg)
    with trainer(c.client, model, 3) as engine:
        first = c.send_round(engine, model, 10)
        dead = c.client.replicas[1]
        dead_pid = dead[0].call("pid")
        dead[0].call("die_after_loading", 5)
        second = H.train_step(model, 11)
        t0 = time.monotonic()
        with pytest.raises(WeightTransferError) as err:
            engine.send_weights()
        elapsed = time.monotonic() - t0
        assert elapsed < TIMEOUT_S, f"the failure took {elapsed:.1f} s"
        msg = str(err.value)
        assert "replica dp=1" in msg and f"pid {dead_pid}" in msg, msg
        dead[0].proc.join(10)
        assert dead[0].proc.exitcode == 17
        survivors = [r for r in c.client.replicas if r is not dead]
        for replica in survivors:
            for w in replica:
                assert w.call("meta_params") == [], w
                got = w.call("params")
                old, new = H.expected_params(cfg, first, 1, 0), H.expected_params(cfg, second, 1, 0)
                for name, t in got.items():
                    assert torch.equal(H.bits(t), H.bits(old[name])) or torch.equal(H.bits(t), H.bits(new[name])), name
        c.client.replicas = survivors  # the client no longer calls the dead replica
        c.send_round(engine, model, 12)
        assert engine._generation == 2 and len(engine._members) == 2


def test_late_replica_served_from_its_first_round(cluster):
    cfg = H.Cfg(dtype="bfloat16", fp8=True)
    c = cluster(cfg, 1, dp_size=2)
    model = H.hf_model(cfg)
    with trainer(c.client, model, 1) as engine:
        c.send_round(engine, model, 20)
        late = H.start_workers(c.ctx, cfg, 1, 1, 2)
        engine.init_workers(H.PipeClient([late]))  # what a new replica gets: the worker init info
        c.client.replicas.append(late)
        c.send_round(engine, model, 21)
        assert len(engine._members) == 2 and engine._generation == 2
        c.send_round(engine, model, 22)
        assert engine._generation == 2  # unchanged members keep their group


@pytest.mark.parametrize("kind", ["name", "dtype"])
def test_mismatch_refused_on_both_sides(cluster, kind):
    """A tensor the model does not have, or sent in another dtype than the model's: refused by the
    workers, and the trainer's error names the tensor and the worker; the round is void on every
    worker, and a trainer with a matching model then updates them."""
    cfg = H.Cfg(dtype="bfloat16")
    c = cluster(cfg, 2)
    if kind == "name":
        bad_name = "model.layers.0.mlp.extra_bias"
        model = H.hf_model(cfg, extra=bad_name)
        why = "KeyError"
    else:
        bad_name = "model.norm.weight"
        model = H.hf_model(cfg, fp32_name=bad_name)
        why = "the model stores it as torch.bfloat16, the trainer sent torch.float32"
    with trainer(c.client, model, 2) as engine:
        H.train_step(model, 30)
        with pytest.raises(WeightTransferError) as err:
            engine.send_weights()
        msg = str(err.value)
        assert "refused" in msg and repr(bad_name) in msg and why in msg and "replica dp=0" in msg, msg
        worker_side = str(err.value.__cause__)  # what the workers' update_weights raised
        assert repr(bad_name) in worker_side and why in worker_side, worker_side
        assert "finish_weight_update" not in c.client.calls
        for w in c.client.workers:
            assert w.call("meta_params") == [], w
    good = H.hf_model(cfg)
    with trainer(c.client, good, 2) as engine:
        c.send_round(engine, good, 31)


class _CountingSource(WeightSource):
    """A source that counts its iterations (what a trainer rank that does not send runs)."""

    def __init__(self, model):
        self.model, self.passes = model, 0

    @cached_property
    def metadata(self):
        return [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in self.model.named_parameters()]

    def iter_full(self):
        self.passes += 1
        yield from self.model.named_parameters()


def test_trainer_rank_that_does_not_send():
    """Trainer rank 1 runs the source (its collectives) and nothing else: no store, no group, no
    buckets, no call to vLLM."""
    cfg = H.Cfg()
    client = H.PipeClient([])
    source = _CountingSource(H.hf_model(cfg))
    info = XcclRsTrainerInitInfo(world_size=3, rank=1)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    engine.send_weights()
    engine.send_weights()
    assert source.passes == 2 and client.calls == []
    assert engine._store is None and engine._sync.group is None and engine._sync.role is None


def test_registered_by_entry_point_alone():
    """A fresh process that never imports xccl_rs: vLLM's plugin loader finds the entry point, and
    both factories then make "xccl_rs" engines."""
    script = r"""
import sys, types, torch
import vllm.plugins
from vllm.config import ParallelConfig
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory
assert "xccl_rs" not in sys.modules
vllm.plugins.load_general_plugins()
cfg = types.SimpleNamespace(parallel_config=ParallelConfig(), model_config=None)
engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="xccl_rs"), cfg,
                                                   torch.device("cpu"), torch.nn.Linear(2, 2))
trainer = WeightTransferTrainerFactory._registry["xccl_rs"]()
print("OK", type(engine).__module__, type(engine).__name__, trainer.__name__, trainer.init_info_cls.backend)
"""
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
    env.pop("PYTHONPATH", None)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env, cwd="/")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    assert ("OK xccl_rs.vllm_engine XcclRsWeightTransferEngine XcclRsTrainerWeightTransferEngine xccl_rs"
            in p.stdout), p.stdout + p.stderr[-3000:]


# SGLang (0.5.23, which pins torch 2.14.1) makes its weight-update group with this function
# (sglang/srt/utils/common.py, Apache-2.0), called with the ``backend`` string of
# ``init_weights_update_group(..., backend=...)``; its workers then receive with
# ``torch.distributed.broadcast(weight, src=0, group=group, async_op=True)`` per tensor, or one
# broadcast of a flattened bucket (``load_format="flattened_bucket"``). SGLang needs CUDA, so
# only these calls are reproduced here, on CPU tensors.
SGLANG_RANK = r'''
import sys, torch, torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous
from datetime import timedelta

def init_custom_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1,
                              store=None, group_name=None, pg_options=None, device_id=None):
    # sglang/srt/utils/common.py's, as of 0.5.23 (the torch >= 2.6 branch)
    backend = Backend(backend) if backend else Backend("undefined")
    if store is None:
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name,
                                      backend_options=pg_options, timeout=timeout, device_id=device_id)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg

rank, port = int(sys.argv[1]), int(sys.argv[2])
assert "xccl_rs" not in sys.modules
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # SGLang's own world
pg = init_custom_process_group(backend="xccl_rs", init_method=f"tcp://127.0.0.1:{port}", world_size=3, rank=rank,
                               group_name="weight_update_group", timeout=timedelta(seconds=60))
assert "xccl_rs" in sys.modules, "torch's autoload did not import xccl_rs"
assert dist.get_backend(pg) == "xccl_rs", dist.get_backend(pg)
specs = [("a", torch.bfloat16, (300, 7)), ("b", torch.float32, (5,)), ("c", torch.float8_e4m3fn, (64, 64))]
g = torch.Generator().manual_seed(5)
want = [torch.randn(s, generator=g).to(dt) for _, dt, s in specs]
got = [w.clone() if rank == 0 else torch.empty(s, dtype=dt) for w, (_, dt, s) in zip(want, specs)]
for h in [dist.broadcast(t, src=0, group=pg, async_op=True) for t in got]:  # receive_weights_from_distributed
    h.wait()
flat = torch.cat([w.reshape(-1).view(torch.uint8) for w in want]) if rank == 0 else None
bucket = flat.clone() if rank == 0 else torch.empty(sum(w.numel() * w.element_size() for w in want), dtype=torch.uint8)
dist.broadcast(bucket, src=0, group=pg)  # the flattened-bucket format
for w, t in zip(want, got):
    assert torch.equal(w.view(torch.uint8), t.view(torch.uint8))
assert torch.equal(bucket, torch.cat([w.reshape(-1).view(torch.uint8) for w in want]))
dist.destroy_process_group(pg)
print("OK", rank)
'''


def test_sglang_style_group_through_torch_autoload():
    """SGLang's group creation with backend="xccl_rs" in processes that never import xccl_rs
    (torch's backend entry point loads it), and its two ways of receiving."""
    from xccl_rs._processes import free_port

    port = free_port()
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    procs = [subprocess.Popen([sys.executable, "-c", SGLANG_RANK, str(r), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env, cwd="/") for r in range(3)]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            p.kill()
            out = p.communicate()[0] + "\n<killed>"
        outs.append((p.returncode, out))
    for r, (rc, out) in enumerate(outs):
        assert rc == 0 and f"OK {r}" in out, f"rank {r}:\n{out[-4000:]}"


class _TRLClient(H.PipeClient):
    """What TRL's experimental VLLMClient offers besides vLLM's four weight-sync calls (which take
    an optional ``timeout`` there)."""

    def get_world_size(self) -> int:
        return len(self.workers)

    def wait_for_server_ready(self) -> None:
        self.calls.append("wait_for_server_ready")

    def pause(self) -> None:
        self.calls.append("pause")

    def resume(self) -> None:
        self.calls.append("resume")


def test_trl_weight_transfer_protocol(ctx):
    """xccl_rs.vllm_engine.TRLWeightTransfer as TRL's AsyncGRPOTrainer drives a weight_transfer:
    init once, then pause / send_weights(iterator) / resume, then destroy; the iterator is
    consumed once per round (an engine made without a WeightSource)."""
    from xccl_rs.vllm_engine import TRLWeightTransfer

    cfg = H.Cfg(dtype="bfloat16", fp8=True)
    c = Cluster(ctx, cfg, 2)
    c.client = _TRLClient(c.client.replicas)
    model = H.hf_model(cfg)
    wt = TRLWeightTransfer(c.client, master_address="127.0.0.1", bucket_bytes=8 << 10, timeout_s=TIMEOUT_S)
    try:
        wt.init_weight_transfer()
        for seed in (40, 41):
            sent = H.train_step(model, seed)
            wt.pause()
            wt.send_weights((n, p.detach()) for n, p in model.named_parameters())
            wt.resume()
            c.check(sent)
        assert c.client.calls == ["wait_for_server_ready", "init_weight_transfer_engine"] + (
            ["pause"] + ROUND + ["resume"]) * 2
    finally:
        wt.destroy()
        c.close()


def test_store_writes_are_visible_when_published():
    """The engine tells workers to read keys through another channel (an RPC) right after writing
    them; a TCPStore ``set`` alone may not be applied yet when another client reads (that raced:
    "no round announced"). ``_publish`` returns once it is."""
    import torch.distributed as dist

    from xccl_rs.vllm_engine import _publish

    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    writer = dist.TCPStore("127.0.0.1", server.port, None, False)
    reader = dist.TCPStore("127.0.0.1", server.port, None, False)
    misses = sum(not reader.check([f"k{i}"]) for i in range(5000) if _publish(writer, f"k{i}", "v") is None)
    assert misses == 0
