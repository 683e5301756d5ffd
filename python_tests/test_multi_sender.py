"""Several senders (xccl_rs.weight_sync with ``senders=[...]``): every trainer rank sends its share.

Trainers are group ranks ``0 .. N-1`` of the sync group, rollouts the rest. Scenarios, one spawn each:

* layouts 2->2, 4->2, 3->1, 1->3, through the shared windows, point to point, and both in one
  sync (one sender's window, the others' bytes sent): whole tensors
  (the same full tensors on every trainer, shared out by bucket), DTensor shards as they are
  (``distribute_tensor`` of seeded tensors: Shard(0) with first dimensions the trainer count
  does not divide, rows fewer than trainers, Shard(1), Replicate, a 2-D mesh at 4 trainers),
  and the two mixed; bf16 and fp32; tensors larger than a bucket. Every rollout's tensors must
  equal, bit for bit, the trainers' ``full_tensor()`` (computed after the sync, by torch's own
  all-gather, and shipped to the rollouts through a file), and the seeded originals;
* FSDP2: trainers ``fully_shard`` a small model over a gloo group of their own, take an
  optimizer step, and send ``model.state_dict()`` as it is (DTensors), compared with
  ``full_tensor()`` likewise; each rank's memory is measured during the sync (below);
* a sending trainer dies mid-sync: every other rank raises within the timeout, naming it; the
  next sync, over a new group of the ranks left, works.

Memory: the RSS high-water mark over the sync, above the RSS before (``PeakRss``, peak_rss.py).
It counts every page the process touches -- torch's allocations, Python's, and the shared
window's pages, which a rollout reads in place (they count in its RSS although the sender
allocated them) -- so it is an upper bound on what the sync costs that rank, not a count of our
own allocations. A warm-up sync first touches the group's own buffers. The control: the same meter
around torch's ``full_tensor()`` of every weight must see the full model. Rollouts copy each
tensor into a model allocated before the measurement and drop it, as a rollout engine does.

In-process: the share-out of the plan, and placements refused with their name.
"""

from __future__ import annotations

import os
import time

import pytest

from harness import ctx, run_ranks, seed_of
from peak_rss import PeakRss

pytestmark = pytest.mark.skipif(
    os.environ.get("XCCL_RS_TEST_BACKEND", "xccl_rs") != "xccl_rs", reason="the sync groups are xccl_rs groups"
)

BUCKET = 32 << 10


# --------------------------------------------------------------------------------------
# reference tensors and how each trainer holds them
# --------------------------------------------------------------------------------------


def make_full(case: str):
    """[(name, full tensor, placements for a 1-D mesh, for a 2-D mesh)], seeded: every rank builds
    the same. Bit patterns random (NaNs included)."""
    import torch
    from torch.distributed.tensor import Replicate, Shard

    g = torch.Generator().manual_seed(seed_of("multi_sender", case))

    def rnd(dtype, *shape):
        n = 1
        for s in shape:
            n *= s
        raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
        return raw.view(dtype).view(shape)

    S0, S1, R = Shard(0), Shard(1), Replicate()
    return [
        ("embed", rnd(torch.float32, 203, 64), [S0], [S0, S0]),  # 52 KB: larger than a bucket; uneven
        ("big.bf16", rnd(torch.bfloat16, 3 * BUCKET // 2 + 7), [S0], [R, S0]),  # 1-D, larger than a bucket
        ("row", rnd(torch.float32, 1, 300), [S0], [S0, R]),  # fewer rows than trainers: empty shards
        ("odd.bf16", rnd(torch.bfloat16, 7, 13), [S0], [S1, R]),
        ("proj", rnd(torch.float32, 33, 77), [S1], [S0, S1]),  # Shard(1): boxes, not row blocks
        ("bias.bf16", rnd(torch.bfloat16, 5), [R], [R, R]),
        ("empty", rnd(torch.float32, 0, 4), [S0], [S0, R]),
        ("scalar", rnd(torch.float32), [R], [R, R]),
        ("wide.bf16", rnd(torch.bfloat16, 9, 2 * BUCKET // 9 + 1), [S0], [S0, S1]),  # one row > a bucket's room
    ]


def make_mesh(n: int):
    """Every rank builds it (ranks outside it take part in torch's subgroup set-up)."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    shape = (2, 2) if n == 4 else (n,)
    return DeviceMesh("cpu", torch.arange(n).view(shape))


def as_sent(full, mode: str, mesh):
    """What a trainer sends: the full tensors ("whole"), DTensor shards ("shard"), or both in turn."""
    from torch.distributed.tensor import distribute_tensor

    out = []
    for i, (name, t, p1, p2) in enumerate(full):
        if mode == "shard" or (mode == "mixed" and i % 2 == 0):
            placements = p2 if mesh.ndim == 2 else p1
            out.append((name, distribute_tensor(t, mesh, placements, src_data_rank=None)))
        else:
            out.append((name, t))
    return out


def _bytes(t):
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def compare(got: dict, expected, what: str) -> list[str]:
    """Problems between received {name: tensor} and [(name, tensor)]: names, dtype, shape, bits."""
    import torch

    probs = []
    if sorted(got) != sorted(n for n, _ in expected):
        return [f"{what}: names differ: got {sorted(got)}, expected {sorted(n for n, _ in expected)}"]
    for name, b in expected:
        a = got[name]
        if a.dtype != b.dtype or a.shape != b.shape:
            probs.append(f"{what}: {name}: got {a.dtype}{tuple(a.shape)}, expected {b.dtype}{tuple(b.shape)}")
        elif not torch.equal(_bytes(a), _bytes(b)):
            diff = (_bytes(a) != _bytes(b)).nonzero()
            probs.append(f"{what}: {name}: {diff.numel()} bytes differ, first at byte {diff[0].item()}")
    return probs


def full_tensors(items):
    """torch's full tensors of what a trainer sent (``full_tensor()``: its all-gather, collective)."""
    from torch.distributed.tensor import DTensor

    return [(n, t.full_tensor() if isinstance(t, DTensor) else t) for n, t in items]


# --------------------------------------------------------------------------------------
# layouts
# --------------------------------------------------------------------------------------


def w_layout(rank, world_size, n):
    import torch
    import torch.distributed as dist

    from xccl_rs.weight_sync import WeightReceiver, WeightSender

    pg = dist.group.WORLD
    senders = list(range(n))
    mesh = make_mesh(n)
    ref_path = os.path.join(ctx().tmpdir, "ref.pt")
    out = {}
    # through the windows, point to point, and both in one sync (sender 0's window, the others' bytes sent)
    for transport in ("window", "p2p", "both"):
        for mode in ("whole", "shard", "mixed") if transport != "both" else ("mixed",):
            if transport == "both" and n == 1:
                continue
            case = f"{mode}/{transport}"
            shared = transport == "window" or (transport == "both" and rank == 0)
            full = make_full(case)
            if rank < n:
                items = as_sent(full, mode, mesh)
                stats = WeightSender(pg, senders=senders, bucket_bytes=BUCKET, shared_memory=shared).send(items)
                out[case] = {"bytes": stats.bytes, "buckets": stats.buckets, "shared": stats.shared_window}
                ref = full_tensors(items)
                if rank == 0:
                    torch.save(ref, ref_path)
            else:
                r = WeightReceiver(pg, senders=senders, bucket_bytes=BUCKET)
                got = {}
                for name, t in r.receive():
                    if name in got:
                        raise AssertionError(f"{name} received twice")
                    got[name] = t
                out[case] = {"buckets": r.last_stats.buckets, "shared": r.last_stats.shared_window}
            dist.barrier()
            if rank >= n:
                ref = torch.load(ref_path)
                probs = compare(got, ref, "vs full_tensor()")
                probs += compare(got, [(name, t) for name, t, _, _ in full], "vs the seeded tensors")
                out[case]["problems"] = probs
            dist.barrier()
    if n > 1:
        # one sender given a DTensor sharded over the n trainers: refused, naming the mesh, and
        # every other rank (all receivers here) gets the abort notice
        name, t, p1, p2 = make_full("mismatch")[0]
        try:
            if rank == 0:
                dt = as_sent([(name, t, p1, p2)], "shard", mesh)
                WeightSender(pg, src=0, bucket_bytes=BUCKET).send(dt)
            else:
                list(WeightReceiver(pg, src=0).receive())
            out["mismatch"] = "no error"
        except Exception as e:  # noqa: BLE001
            out["mismatch"] = f"{type(e).__name__}: {e}"
    # a sync too small for every sender: those with no bytes allocate nothing
    case = "tiny"
    full = make_full(case)[3:4]
    if rank < n:
        s = WeightSender(pg, senders=senders, bucket_bytes=BUCKET)
        st = s.send([(name, t) for name, t, _, _ in full])
        out[case] = {"bytes": st.bytes, "allocated": [slot.buf is not None for slot in s._slots]}
    else:
        got = dict(WeightReceiver(pg, senders=senders).receive())
        out[case] = {"problems": compare(got, [(name, t) for name, t, _, _ in full], "tiny")}
    return out


@pytest.mark.parametrize("n,m", [(2, 2), (4, 2), (3, 1), (1, 3)], ids=["2to2", "4to2", "3to1", "1to3"])
def test_layouts(n, m):
    res = run_ranks(n + m, w_layout, n, timeout_s=240)
    problems = []
    for r in range(n, n + m):
        for case, o in res.value(r).items():
            if case == "mismatch":
                continue
            problems += [f"rollout {r} {case}: {p}" for p in o["problems"]]
            if case not in ("tiny", "mismatch") and o["shared"] != (not case.endswith("p2p")):
                problems.append(f"rollout {r} {case}: shared_window is {o['shared']}")
    assert not problems, "\n".join(problems)
    trainers = [res.value(r) for r in range(n)]
    for case in trainers[0]:
        if case in ("tiny", "mismatch"):
            continue
        mode = case.split("/")[0]
        full = {name: t for name, t, _, _ in make_full(case)}
        total = sum(t.numel() * t.element_size() for t in full.values())
        sent = [o[case]["bytes"] for o in trainers]
        # every byte is sent once: each whole tensor by one trainer, each shard by its owner
        # (a Replicate placement's copies by coordinate 0 only)
        assert sum(sent) == total, (case, sent, total)
        if mode == "whole":  # shared out by bucket: within a bucket of each other
            assert max(sent) - min(sent) <= BUCKET, (case, sent)
        # every rollout receives every bucket: N per round
        rounds = {o[case]["buckets"] for o in trainers}
        assert len(rounds) == 1, (case, rounds)
        assert {res.value(r)[case]["buckets"] for r in range(n, n + m)} == {n * rounds.pop()}, case
    if n > 1:
        for r in range(n + m):
            msg = res.value(r)["mismatch"]
            assert f"'embed' is a DTensor on a mesh of {n} ranks" in msg and "1 sender(s)" in msg, (r, msg)
            assert r == 0 or "aborted" in msg, (r, msg)
    # the tiny sync: one trainer sends it, the others allocate nothing
    tiny = [o["tiny"] for o in trainers]
    assert [t["bytes"] > 0 for t in tiny] == [True] + [False] * (n - 1), tiny
    assert all(not any(t["allocated"]) for t in tiny[1:]), tiny


BIG_BUCKET = 24 << 20


def w_big_both(rank, world_size):
    """Sender 0's buckets through its window, sender 1's sent point to point, in one sync, with
    buckets larger than what the sockets hold: a bucket's send then waits for its receiver, so
    the ranks' operations must come in an order every rank's progress thread can follow (a
    receiver that joined the window's barrier before posting that receive hung here)."""
    import torch
    import torch.distributed as dist

    from xccl_rs.weight_sync import WeightReceiver, WeightSender

    pg = dist.group.WORLD
    senders = [0, 1]
    full = [(f"t{i}", (torch.arange(BIG_BUCKET // 4 - 64 * i, dtype=torch.int32) * (2 * i + 1)).view(torch.float32))
            for i in range(8)]
    out = []
    for _ in range(2):
        if rank in senders:
            stats = WeightSender(pg, senders=senders, bucket_bytes=BIG_BUCKET, shared_memory=(rank == 0)).send(full)
            out.append(stats.shared_window)
        else:
            got = dict(WeightReceiver(pg, senders=senders).receive())
            out.append(compare(got, full, "both transports"))
    return out


def test_window_and_sends_in_one_sync():
    res = run_ranks(4, w_big_both, timeout_s=180, pg_timeout_s=30)
    assert res.value(0) == [True, True] and res.value(1) == [False, False], (res.value(0), res.value(1))
    assert res.value(2) == [[], []] and res.value(3) == [[], []], (res.value(2), res.value(3))


# --------------------------------------------------------------------------------------
# FSDP2: a trainer's state dict as it is, and the memory of a sync
# --------------------------------------------------------------------------------------

FSDP_BUCKET = 256 << 10
SLACK = 1 << 20  # Python's arenas and torch's small tensors, touched anew after the trim


VOCAB, DIM, HIDDEN, BLOCKS = 1003, 160, 389, 24


def make_model(dtype):
    """A small transformer-shaped model (3.3M parameters) whose first dimensions the trainer
    count does not divide, and whose embedding is larger than a bucket."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    vocab, dim, hidden = VOCAB, DIM, HIDDEN
    layers = [nn.Embedding(vocab, dim)]
    for _ in range(BLOCKS):
        layers += [nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim), nn.LayerNorm(dim)]
    layers.append(nn.Linear(dim, vocab))
    return nn.Sequential(*layers).to(dtype)


def w_fsdp2(rank, world_size, n, dtype_name):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from xccl_rs.weight_sync import WeightReceiver, WeightSender

    dtype = getattr(torch, dtype_name)
    pg = dist.group.WORLD
    senders = list(range(n))
    trainers = dist.new_group(senders, backend="gloo")  # the trainers' own group (every rank calls new_group)
    ref_path = os.path.join(ctx().tmpdir, "ref.pt")
    out = {"mem": {}, "problems": []}
    if rank < n:
        model = make_model(dtype)
        mesh = DeviceMesh.from_group(trainers, "cpu")
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(rank))
        model(x).float().square().mean().backward()  # FSDP2's reduce-scatter over gloo
        opt.step()
        sd = model.state_dict()  # DTensors: each rank's shards, as they are
        out["placements"] = sorted({str(tuple(t.placements)) for t in sd.values()})
        out["model_bytes"] = sum(t.numel() * t.element_size() for t in sd.values())
        sender = WeightSender(pg, senders=senders, bucket_bytes=FSDP_BUCKET)
    else:
        model = make_model(dtype)  # where a rollout loads the weights: allocated before measuring
        dest = dict(model.state_dict())
        receiver = WeightReceiver(pg, senders=senders, bucket_bytes=FSDP_BUCKET)
    # Warm-up: the group's own buffers (xccl_rs's shared-memory slots, touched on their first
    # use) and lazy imports are not the sync's; a bucket size of its own, so that the measured
    # syncs still make (and fault in) their windows.
    warm = [(f"warm{i}", torch.ones(3 * FSDP_BUCKET // 8 + i, dtype=dtype)) for i in range(3)]
    for shared in (None, False):
        if rank < n:
            WeightSender(pg, senders=senders, bucket_bytes=FSDP_BUCKET // 2, shared_memory=shared).send(warm)
        else:
            list(WeightReceiver(pg, senders=senders).receive())
    for sync in ("window", "window again", "p2p", "p2p again"):
        if sync == "p2p" and rank < n:
            sender.release()
            sender = WeightSender(pg, senders=senders, bucket_bytes=FSDP_BUCKET, shared_memory=False)
        dist.barrier()
        if rank < n:
            with PeakRss() as mem:
                stats = sender.send(sd)
            out["mem"][sync] = (mem.extra, stats.shared_window)
        else:
            loaded = set()
            with PeakRss() as mem:
                for name, t in receiver.receive(copy=False):
                    dest[name].copy_(t)  # what a rollout engine does with each tensor
                    loaded.add(name)
                    del t
            out["mem"][sync] = (mem.extra, receiver.last_stats.shared_window)
            if loaded != set(dest):
                out["problems"].append(f"{sync}: loaded {sorted(loaded)}, the model has {sorted(dest)}")
        dist.barrier()
    if rank < n:
        # torch's all-gather over the trainers' group, after the syncs: the reference, and what a
        # gather costs on the same meter (the control: the meter sees a full model)
        with PeakRss() as mem:
            ref = full_tensors(sd.items())
        out["gather"] = mem.extra
        if rank == 0:
            torch.save(ref, ref_path)
    dist.barrier()
    if rank >= n:
        out["problems"] += compare(dest, torch.load(ref_path), "vs full_tensor()")
    return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fsdp2_state_dict(dtype):
    n, m = 2, 2
    res = run_ranks(n + m, w_fsdp2, n, dtype, timeout_s=240)
    problems = [f"rollout {r}: {p}" for r in range(n, n + m) for p in res.value(r)["problems"]]
    assert not problems, "\n".join(problems)
    assert res.value(0)["placements"] == ["(Shard(dim=0),)"], res.value(0)["placements"]
    model = res.value(0)["model_bytes"]
    largest = VOCAB * DIM * getattr(__import__("torch"), dtype).itemsize  # the embedding and the head
    report = []
    for r in range(n + m):
        role = "trainer" if r < n else "rollout"
        for sync, (extra, shared) in res.value(r)["mem"].items():
            report.append(f"{role} {r} {sync}: +{extra / 1e6:.2f} MB (shared window: {shared})")
            assert shared == sync.startswith("window"), report[-1]
            if r < n:
                # two buckets of staging (the window's pages, or two private buckets), nothing gathered
                bound = 2 * FSDP_BUCKET + SLACK
            else:
                # two buckets per sender -- with the window, each sender's two, read in place (they
                # count in RSS); sent, a round in flight and one being unpacked -- the tensors being
                # assembled (about a round: n buckets' worth of shards, and the largest tensor,
                # larger than a bucket), the one handed out, the slack
                staging = 2 * n * FSDP_BUCKET
                bound = staging + n * FSDP_BUCKET + 2 * largest + SLACK
            assert extra <= bound and extra < model / 2, f"{report[-1]}: above {bound / 1e6:.2f} MB (model {model / 1e6:.2f} MB)"
        if r < n:
            gather = res.value(r)["gather"]
            report.append(f"{role} {r} full_tensor() of every weight (the control): +{gather / 1e6:.2f} MB")
            assert gather >= model * 0.9, report[-1]
    print(f"\nmodel {model / 1e6:.2f} MB ({dtype}), buckets {FSDP_BUCKET / 1e6:.3f} MB\n" + "\n".join(report))


# --------------------------------------------------------------------------------------
# a sending trainer dies mid-sync
# --------------------------------------------------------------------------------------

DEAD_TIMEOUT_S = 15.0
DYING = 2


def w_dead_sender(rank, world_size, n):
    import torch
    import torch.distributed as dist

    import xccl_rs
    from xccl_rs.weight_sync import WeightReceiver, WeightSender

    c = ctx()
    store = c.connect_store()
    mesh = make_mesh(n)
    full = [(f"{i}.{name}", t, p1, p2) for i in range(4) for name, t, p1, p2 in make_full(f"dead{i}")]
    out = {}
    # the first sync, over a private xccl_rs group of every rank
    pg = xccl_rs.new_group(dist.PrefixStore("first/", store), rank, world_size, timeout=c.timeout(DEAD_TIMEOUT_S))
    items = as_sent(full, "shard", mesh) if rank < n else None  # before the sync: only the death is slow
    dist.barrier()
    t0 = time.monotonic()
    try:
        if rank < n:
            def weights():
                for i, item in enumerate(items):
                    if rank == DYING and i == len(full) // 2:
                        store.set("died_at", repr(time.time()))
                        os._exit(0)  # a trainer dies with half of its shards unsent
                    yield item

            WeightSender(pg, senders=list(range(n)), bucket_bytes=BUCKET).send(weights())
        else:
            list(WeightReceiver(pg, senders=list(range(n))).receive())
        out["first"] = {"raised": False}
    except Exception as e:  # noqa: BLE001 - every rank must raise
        out["first"] = {"raised": True, "msg": f"{type(e).__name__}: {e}", "late_s": time.time() - float(store.get("died_at")),
                        "elapsed": time.monotonic() - t0}
    xccl_rs.destroy_group(pg)
    # the next sync, with the ranks left: a new group (trainers 0, 1, then the rollouts)
    left = [r for r in range(world_size) if r != DYING]
    pg = xccl_rs.new_group(dist.PrefixStore("next/", store), left.index(rank), len(left), timeout=c.timeout())
    senders = list(range(n - 1))
    expected = [(name, t) for name, t, _, _ in make_full("after")]
    if rank < n:
        WeightSender(pg, senders=senders, bucket_bytes=BUCKET).send(expected)
        out["next"] = []
    else:
        got = dict(WeightReceiver(pg, senders=senders).receive())
        out["next"] = compare(got, expected, "the next sync")
    xccl_rs.destroy_group(pg)
    return out


def test_dead_sender():
    n, m = 3, 2
    res = run_ranks(n + m, w_dead_sender, n, timeout_s=180, pg_timeout_s=30, expect_fail_ranks=(DYING,))
    for r in range(n + m):
        if r == DYING:
            continue
        o = res.value(r)
        first = o["first"]
        assert first["raised"], f"rank {r} did not raise: {first}"
        assert first["msg"].startswith("WeightSyncError"), (r, first)
        assert f"rank {DYING}" in first["msg"], f"rank {r}'s error does not name rank {DYING}: {first['msg']}"
        assert first["late_s"] < DEAD_TIMEOUT_S + 5, (r, first)
        assert o["next"] == [], (r, o["next"])


# --------------------------------------------------------------------------------------
# in-process: the plan
# --------------------------------------------------------------------------------------


def test_share_out():
    """Whole tensors: every bucket has one sender (bucket k: sender k % N), every byte of every
    tensor is in exactly one bucket, each sender gets a share within a bucket of the others',
    and one sender's plan is the single-sender plan."""
    import torch

    from xccl_rs.weight_sync import plan_buckets

    bucket = 4096
    g = torch.Generator().manual_seed(3)
    ts = [(f"t{i}", torch.empty(int(s), dtype=torch.bfloat16 if i % 3 else torch.float32, device="meta"))
          for i, s in enumerate(torch.randint(1, 3000, (200,), generator=g))]
    ts.append(("huge", torch.empty(5 * bucket + 3, dtype=torch.uint8, device="meta")))
    total = sum(t.numel() * t.element_size() for _, t in ts)
    single = plan_buckets(ts, bucket)
    for n in (1, 2, 3, 4, 7):
        plan = plan_buckets(ts, bucket, senders=n)
        assert len(plan) % n == 0
        if n == 1:
            assert plan == single
        covered: dict[str, list] = {}
        per_sender = [0] * n
        for k, b in enumerate(plan):
            for name, _, _, off, nbytes, start, tot in b:
                covered.setdefault(name, []).append((start, start + nbytes))
                per_sender[k % n] += nbytes
                assert off + nbytes <= bucket
        for name, t in ts:
            runs = sorted(covered[name])
            assert runs[0][0] == 0 and runs[-1][1] == t.numel() * t.element_size(), name
            assert all(a[1] == b[0] for a, b in zip(runs, runs[1:])), f"{name}: {runs}"
        assert sum(per_sender) == total
        assert max(per_sender) - min(per_sender) <= bucket, (n, per_sender)


def test_sharded_places():
    """A sharded tensor takes the same place in every bucket of a round, after what is already
    there; a whole tensor goes to the sender with the fewest bytes so far."""
    import torch

    from xccl_rs.weight_sync.plan import EVERY, NEXT_ROUND, Place, RoundPlanner

    p = RoundPlanner(4096, 3)
    assert p.add_whole("a", torch.float32, 1000, 4) == [Place(0, 0, 0, 1000)]
    steps = p.add_sharded("s", torch.float32, 3000, 4)
    assert [(s.sender, s.offset, s.start, s.nbytes) for s in steps] == [(EVERY, 1024, 0, 3000)]
    steps = p.add_sharded("big", torch.float32, 6000, 4)  # fills the round's room, continues in the next
    assert [None if s is NEXT_ROUND else (s.sender, s.offset, s.start, s.nbytes) for s in steps] == [
        NEXT_ROUND, (EVERY, 0, 0, 4096), NEXT_ROUND, (EVERY, 0, 4096, 1904)]
    # sender 0 had "a" too: "b" goes to sender 1, after the shard's place
    assert [(s.sender, s.offset) for s in p.add_whole("b", torch.float32, 100, 4)] == [(1, 2048)]


def test_placements_refused_by_name():
    """A DTensor whose shards cannot be sent as they are is refused, naming the placement; a mesh
    of one is the whole tensor (in-process: a one-rank gloo world). test_layouts refuses a mesh
    of another size than the senders."""
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Partial, Shard

    from xccl_rs.weight_sync.sender import _piece

    if dist.is_initialized():
        pytest.skip("needs a process without a default group")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=10))
    try:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh("cpu", torch.arange(1))
        partial = DTensor.from_local(torch.ones(4, 2), mesh, [Partial()])
        with pytest.raises(TypeError, match=r"'x' is a DTensor with placement Partial\(sum\) on mesh dimension 0"):
            _piece("x", partial, 1)
        sharded = DTensor.from_local(torch.ones(4, 2), mesh, [Shard(0)])
        for senders in (1, 2):
            assert _piece("y", sharded, senders).footprint is None  # a mesh of one: the whole tensor
    finally:
        dist.destroy_process_group()
