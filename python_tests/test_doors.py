"""Every combination a user can configure, through every door that runs without vLLM.

A *door* is a way into the weight sync (xccl_rs/door.py): the plain roles (``WeightSender`` /
``WeightReceiver`` over a group the user makes with ``xccl_rs.new_group``) and verl's checkpoint
engine (verl_engine.py: verl's registry class when verl is installed, else the same engine
without verl's base class). The vLLM engine's door tests need vLLM and run with its suite
(python_tests/vllm/test_vllm_doors.py, scripts/test_vllm.sh).

The matrix, mode x payload x door x transport:

* mode: one sender (trainer rank 0; trainer rank 1 takes no part, or drains its generator),
  several senders (both trainers, the same full tensors, shared out), sharded (both
  trainers, DTensor shards of a mesh of the two, as they are) and, for the engines, the
  trainer ranks of trainer rank 0's node (``senders: node``; trainer rank 1 reports another
  node's address, so rank 0 sends alone and rank 1 drains);
* payload: what travels: ``full`` (the tensors bit for bit), ``delta`` (the second sync changes
  5 % of the elements: it must arrive bit for bit in less than half the bytes) and ``fp8`` (the
  weights the default rule selects must equal torch's own block quantization of the trainer's);
* transport: through the shared window (the default on one host), or sent (``shared_memory=False``:
  broadcast from one sender, point to point from several).

Four processes: trainers 0, 1 and rollouts 2, 3. One spawn per door and mode runs every
payload and transport, two syncs each (the second over the kept group and window). Every
rollout's tensors must equal, bit for bit, what the test regenerates from the seed (never what
the engine assembled); each sync must have taken the transport and the payload asked for.
"""

from __future__ import annotations

import os

import pytest

from harness import ctx, run_ranks, seed_of
from test_multi_sender import compare, make_mesh

pytestmark = pytest.mark.skipif(
    os.environ.get("XCCL_RS_TEST_BACKEND", "xccl_rs") != "xccl_rs", reason="the doors build xccl_rs groups"
)

TRAINERS, ROLLOUTS = 2, 2
BUCKET = 32 << 10
MODES = ("one", "several", "sharded", "node")
#: senders: node -- trainer rank 1 says it is on another node (an address of TEST-NET-1, compared only)
OTHER_NODE = "192.0.2.1"
PAYLOADS = ("full", "delta", "fp8")
DOORS = ("plain", "verl")
TRANSPORTS = ("window", "sent")
STEPS = 2
CHANGED = 0.05  # the share of the elements the second sync changes


def _reference(case: str) -> list:
    """Each sync's ``[(name, tensor, placements on the trainers' mesh)]``, seeded (every rank
    builds the same): normal values (fp8 quantizes them), names that the fp8 payload's default
    rule selects (2-D ``...weight``) and keeps (embeddings, the head, norms, biases, 1-D), uneven
    shards, ``Shard(1)``, replicated tensors, tensors larger than a bucket. The second sync
    changes ``CHANGED`` of the elements, as a training step at a small learning rate does."""
    import torch
    from torch.distributed.tensor import Replicate, Shard

    g = torch.Generator().manual_seed(seed_of("doors", case))
    S0, S1, R = [Shard(0)], [Shard(1)], [Replicate()]
    first = [
        ("model.embed_tokens.weight", torch.randn(203, 64, generator=g), S0),  # 52 KB: larger than a bucket
        ("layers.0.mlp.up.weight", torch.randn(129, 77, generator=g).bfloat16(), S0),  # quantized
        ("layers.0.attn.o.weight", torch.randn(33, 300, generator=g), S1),  # quantized; larger than a bucket
        ("layers.0.row.weight", torch.randn(1, 300, generator=g), S0),  # quantized; fewer rows than trainers
        ("layers.0.norm.weight", torch.randn(64, generator=g).bfloat16(), R),
        ("layers.0.mlp.up.bias", torch.randn(5, generator=g).bfloat16(), R),
        ("scalar", torch.randn((), generator=g), R),
        ("lm_head.weight", torch.randn(9, 2 * BUCKET // 9 + 1, generator=g).bfloat16(), S0),
    ]
    second = []
    for name, t, p in first:
        mask = torch.rand(t.shape, generator=g) < CHANGED
        second.append((name, torch.where(mask, torch.randn(t.shape, generator=g).to(t.dtype), t), p))
    return [first, second]


def _sent_by(mode: str, tensors, mesh):
    """What a sending trainer gives the door in ``mode``: the full tensors, or DTensor shards."""
    from torch.distributed.tensor import distribute_tensor

    if mode != "sharded":
        return [(name, t) for name, t, _ in tensors]
    return [(name, distribute_tensor(t, mesh, p, src_data_rank=None)) for name, t, p in tensors]


def _fp8_block(w):
    """torch's block-fp8 quantization (vLLM's ``per_block_cast_to_fp8``, 128x128 blocks): the
    weight as float8_e4m3fn and its float32 scales (one per block: amax / 448)."""
    import torch

    rows, cols = w.shape
    out = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scales = torch.empty(-(-rows // 128), -(-cols // 128), dtype=torch.float32)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float()
            amax = block.abs().amax().clamp(min=1e-4)
            out[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (block * (448.0 / amax)).to(torch.float8_e4m3fn)
            scales[i, j] = amax / 448.0
    return out, scales


def expected(tensors, payload: str) -> list:
    """What every rollout must receive of ``tensors``: the tensors themselves, except that the
    fp8 payload turns each 2-D ``...weight`` other than the embeddings, the head and the norms
    into its fp8 values and ``<name>_scale_inv``."""
    out = []
    for name, t, _ in tensors:
        quantized = t.dim() == 2 and name.endswith("weight") and not any(k in name for k in ("embed", "lm_head", "norm"))
        if payload == "fp8" and quantized:
            q, scales = _fp8_block(t)
            out += [(name, q), (name + "_scale_inv", scales)]
        else:
            out.append((name, t))
    return out


class _Plain:
    """The plain door: a group per configuration, made by the user, the roles over it."""

    def __init__(self, store, rank: int, mode: str, payload: str, transport: str, tag: str):
        import torch.distributed as dist

        import xccl_rs
        from xccl_rs.weight_sync import WeightReceiver, WeightSender

        n = 1 if mode == "one" else TRAINERS
        ranks = list(range(n)) + list(range(TRAINERS, TRAINERS + ROLLOUTS))  # global ranks, in group-rank order
        self.member = rank in ranks
        if not self.member:
            return
        self.group = xccl_rs.new_group(dist.PrefixStore(f"plain/{tag}/", store), ranks.index(rank), len(ranks))
        senders = list(range(n))
        if rank < TRAINERS:
            self.role = WeightSender(self.group, senders=senders, bucket_bytes=BUCKET,
                                     shared_memory=None if transport == "window" else False, payload=payload)
        else:
            self.role = WeightReceiver(self.group, senders=senders, bucket_bytes=BUCKET)

    def send(self, step: int, items):
        if not self.member:
            return {}
        stats = self.role.send(items)
        return {"bytes": stats.bytes}

    def receive(self, step: int):
        got = {name: t.clone() for name, t in self.role.receive()}  # delta: the receiver's own, updated later
        return got, self.role.last_stats

    def close(self):
        import xccl_rs

        if self.member:
            self.role.release()
            xccl_rs.destroy_group(self.group)


class _Verl:
    """verl's door: the engine as verl's manager drives it (prepare, build_topology,
    init_process_group, send/receive, finalize), its options as ``engine_kwargs``."""

    def __init__(self, store, rank: int, mode: str, payload: str, transport: str, tag: str):
        import xccl_rs.verl_engine as ve

        self.cls = ve.XcclRsCheckpointEngine or ve._EngineImpl
        self.store, self.rank, self.tag = store, rank, tag
        if mode == "node" and rank == 1:
            ve.node_address = lambda: OTHER_NODE
        senders = {"one": "rank0", "several": "all", "sharded": "all", "node": "node"}[mode]
        self.engine = self.cls(bucket_size=BUCKET, is_master=(rank == 0), device="cpu", timeout_s=60,
                               group_name=f"verl/{tag}", senders=senders,
                               payload=payload, shared_memory=None if transport == "window" else False)

    def _join(self, step: int):
        import pickle

        key = f"verl/{self.tag}/{step}"
        self.store.set(f"{key}/{self.rank}", pickle.dumps(self.engine.prepare()))
        metadata = [pickle.loads(self.store.get(f"{key}/{r}")) for r in range(TRAINERS + ROLLOUTS)]
        actor, rollout = self.cls.build_topology(TRAINERS, ROLLOUTS, metadata)
        kw, i = (actor, self.rank) if self.rank < TRAINERS else (rollout, self.rank - TRAINERS)
        self.engine.init_process_group(**{k: v[i] for k, v in kw.items()})

    def send(self, step: int, items):
        import asyncio

        self._join(step)
        metrics = asyncio.run(self.engine.send_weights(iter(items), global_steps=step))
        self.engine.finalize()
        return {"bytes": metrics.get("xccl_rs/sync_bytes", 0)}

    def receive(self, step: int):
        import asyncio

        self._join(step)

        async def run():
            return {name: t.clone() async for name, t in self.engine.receive_weights(global_steps=step)}

        got = asyncio.run(run())
        stats = self.engine.sync.role.last_stats
        self.engine.finalize()
        return got, stats

    def close(self):
        self.engine._drop_group()


DOOR_CLASSES = {"plain": _Plain, "verl": _Verl}


def w_doors(rank, world_size, door, mode):
    """Every payload and transport of ``door`` in ``mode``: {case: record} (case: payload/transport)."""
    store = ctx().connect_store()
    mesh = make_mesh(TRAINERS)  # every rank takes part in its set-up
    out = {}
    for payload in PAYLOADS:
        for transport in TRANSPORTS:
            case = f"{payload}/{transport}"
            steps = _reference(f"{door}/{mode}/{case}")
            d = DOOR_CLASSES[door](store, rank, mode, payload, transport, f"{mode}/{case}")
            rec = out[case] = {"problems": [], "bytes": [], "shared": [], "payload": []}
            for step, tensors in enumerate(steps):
                if rank < TRAINERS:
                    if mode == "one" and rank > 0 and door == "plain":
                        continue  # not in the group
                    rec["bytes"].append(d.send(step, _sent_by(mode, tensors, mesh)).get("bytes", 0))
                else:
                    got, stats = d.receive(step)
                    rec["shared"].append(stats.shared_window)
                    rec["payload"].append(stats.payload)
                    rec["problems"] += compare(got, expected(tensors, payload), f"step {step}")
            d.close()
    return out


@pytest.fixture(scope="module")
def door_runs():
    """One spawn per (door, mode), run when a test first asks for it."""
    runs = {}

    def get(door: str, mode: str):
        if (door, mode) not in runs:
            res = run_ranks(TRAINERS + ROLLOUTS, w_doors, door, mode, timeout_s=300)
            runs[door, mode] = [res.value(r) for r in range(TRAINERS + ROLLOUTS)]
        return runs[door, mode]

    return get


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("mode,door", [(m, d) for m in MODES for d in DOORS if (m, d) != ("node", "plain")])
def test_door(door_runs, mode, payload, door, transport):
    case = f"{payload}/{transport}"
    values = door_runs(door, mode)
    problems = []
    for r in range(TRAINERS, TRAINERS + ROLLOUTS):
        rec = values[r][case]
        problems += [f"rollout {r}: {p}" for p in rec["problems"]]
        if rec["shared"] != [transport == "window"] * STEPS:
            problems.append(f"rollout {r}: shared_window {rec['shared']}, asked for {transport}")
        if rec["payload"] != [payload] * STEPS:
            problems.append(f"rollout {r}: payload {rec['payload']}, asked for {payload}")
    assert not problems, "\n".join(problems)
    # the senders the mode names sent: every byte once (full), less (fp8; delta after the first sync)
    sent = [values[r][case]["bytes"] for r in range(TRAINERS)]
    for step, tensors in enumerate(_reference(f"{door}/{mode}/{case}")):
        total = sum(t.numel() * t.element_size() for _, t, _ in tensors)
        by = [s[step] if step < len(s) else 0 for s in sent]
        if mode in ("one", "node"):  # node: trainer rank 1 is on another node
            assert by[1:] == [0] * (TRAINERS - 1) and by[0] > 0, by
        else:
            assert all(b > 0 for b in by), by
        if payload == "full" or (payload == "delta" and step == 0):
            assert sum(by) == total, (step, by, total)
        elif payload == "delta":
            assert sum(by) < total / 2, (step, by, total)
        else:
            assert sum(by) < total, (step, by, total)


def test_options_checked_at_every_door():
    """A bad option is refused where it is set, naming the door and the option."""
    import xccl_rs.verl_engine as ve
    from xccl_rs.door import SyncOptions

    cls = ve.XcclRsCheckpointEngine or ve._EngineImpl
    for kw, what in (({"senders": "some"}, "senders 'some'"), ({"payload": "zip"}, "payload 'zip'"),
                     ({"fp8_scale": "row"}, "fp8_scale 'row'"), ({"delta_base": "disk"}, "delta_base 'disk'"),
                     ({"fp8_select": "down_proj("}, r"fp8_select 'down_proj\(' is not a regular expression"),
                     ({"shared_memory": "yes"}, "shared_memory 'yes'")):
        with pytest.raises(ValueError, match=f"xccl_rs verl engine: {what}"):
            cls(bucket_size=BUCKET, **kw)
        with pytest.raises(ValueError, match=f"my door: {what}"):
            SyncOptions(who="my door", **kw)
    with pytest.raises(ValueError, match="xccl_rs verl engine: bucket_bytes 16 is not in"):
        cls(bucket_size=16)
    with pytest.raises(ValueError, match="my door: group_backend 'mpi'"):
        SyncOptions(who="my door", group_backend="mpi")


def test_pick_senders():
    from xccl_rs.door import pick_senders

    assert pick_senders("rank0", 3) == [0]
    assert pick_senders("all", 3) == [0, 1, 2]
    assert pick_senders("node", 4, ["a", "b", "a", "a"]) == [0, 2, 3]
    assert pick_senders("node", 2, ["a", "b"]) == [0]
    with pytest.raises(ValueError, match="needs the host of each of the 3 trainer ranks"):
        pick_senders("node", 3, ["a"])


def test_verl_topology_node_senders():
    """``senders: node``: the trainer ranks on trainer rank 0's node send, as group ranks 0 ..
    S-1 in trainer-rank order; the others get -1 and drain."""
    import xccl_rs.verl_engine as ve

    cls = ve.XcclRsCheckpointEngine or ve._EngineImpl
    master = {"is_master": True, "group": None, "addr": "h", "port": 1, "nonce": "n", "generation": 0,
              "rebuild_group": False, "senders": "node", "host": "10.0.0.1"}

    def worker(host):
        return {"is_master": False, "group": None, "host": host}

    metadata = [master, worker("10.0.0.2"), worker("10.0.0.1"), worker("10.0.0.9"), worker("10.0.0.9")]
    a, r = cls.build_topology(3, 2, metadata)
    assert a["rank"] == [0, -1, 1] and r["rank"] == [2, 3], (a, r)
    assert a["senders"] == [2] * 3 and r["senders"] == [2] * 2
    assert a["world_size"] == [4] * 3


def test_node_address_asks_ray_first(monkeypatch):
    """One rule for every door: Ray's node IP when Ray is initialised here, else the host's."""
    import socket
    import sys
    import types

    from xccl_rs import door

    host = socket.gethostbyname(socket.gethostname())
    fake = types.ModuleType("ray")
    fake.is_initialized = lambda: True
    fake.util = types.SimpleNamespace(get_node_ip_address=lambda: "[fd00::7]")
    monkeypatch.setitem(sys.modules, "ray", fake)
    assert door.node_address() == "fd00::7"
    fake.is_initialized = lambda: False
    assert door.node_address() == host
    monkeypatch.delitem(sys.modules, "ray")
    assert door.node_address() == host
