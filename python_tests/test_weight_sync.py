"""xccl_rs.weight_sync: bucketed weight broadcast (the verl weight-sync pattern).

Every rank regenerates the sender's tensors from a seed, so receivers compare what they got
with an independent reference, bit for bit (byte views: NaN payloads count). One spawn per
scenario, a few MB each:

* round trips (world 3, source rank 1): mixed dtypes, odd / zero-size / 0-d / non-contiguous
  tensors, tensors larger than a bucket (contiguous and not), a bucket filled exactly, a
  receiver with a different bucket_bytes, an empty sync, a bucket_bytes above 2 GiB;
* group layout: a sync group over global ranks [0, 2] of a world of 3 (dist.new_group), and a
  private group from xccl_rs.new_group;
* failure: a receiver that dies mid-sync makes the sender raise within the group timeout.

The packing plan is also checked in-process on the meta device with sizes above 4 GiB.
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from harness import ctx, run_ranks, seed_of

BUCKET = 64 << 10  # small buckets: many buckets from a few MB


# --------------------------------------------------------------------------------------
# reference tensors (any rank can build them)
# --------------------------------------------------------------------------------------


def make_tensors(case: str, bucket: int = BUCKET):
    """[(name, tensor)] with every dtype / layout the sync must carry; bit patterns random."""
    import torch

    g = torch.Generator().manual_seed(seed_of("weight_sync", case))

    def rnd(dtype, *shape):
        n = 1
        for s in shape:
            n *= s
        if dtype == torch.bool:
            return (torch.rand(shape, generator=g) < 0.5)
        item = torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, (n * item,), dtype=torch.uint8, generator=g)
        return raw.view(dtype).view(shape)  # any bit pattern, NaNs and infs included

    out = [
        ("embed.weight", rnd(torch.float32, 37, 129)),
        ("layers.0.attn.qkv", rnd(torch.bfloat16, 3, 5, 7)),
        ("layers.0.mlp.up.T", rnd(torch.float16, 64, 33).t()),  # non-contiguous
        ("step", rnd(torch.int64, 1001)),
        ("mask", rnd(torch.bool, 17, 13)),
        ("empty", rnd(torch.float32, 0, 5)),
        ("scalar", rnd(torch.float64, )),
        ("odd.int8", rnd(torch.int8, 3)),
        # larger than a bucket: contiguous, then strided (every other column)
        ("big.contig", rnd(torch.float32, (3 * bucket) // 4 + 77)),
        ("big.strided", rnd(torch.bfloat16, 211, 2 * 401)[:, ::2]),
        # exactly one bucket: starts a fresh bucket and fills it to the last byte
        ("exact", rnd(torch.int32, bucket // 4)),
        ("after.exact", rnd(torch.float16, 5, 5)),
        ("empty.bf16", rnd(torch.bfloat16, 4, 0, 3)),
    ]
    for name in ("float8_e4m3fn", "float8_e5m2"):
        dt = getattr(torch, name, None)
        if dt is not None:
            out.append((f"fp8.{name}", rnd(dt, 300, 7)))
    out.append(("expanded", rnd(torch.float32, 1, 50).expand(40, 50)))  # stride 0
    out.append(("tail.fp32", rnd(torch.float32, 999)))
    return out


def _bytes(t):
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def compare(received, expected) -> list[str]:
    """Problems between [(name, tensor)] lists: names, order, dtype, shape, bytes."""
    import torch

    probs = []
    if [n for n, _ in received] != [n for n, _ in expected]:
        return [f"names differ: got {[n for n, _ in received]}, expected {[n for n, _ in expected]}"]
    for (name, a), (_, b) in zip(received, expected):
        if a.dtype != b.dtype or a.shape != b.shape:
            probs.append(f"{name}: got {a.dtype}{tuple(a.shape)}, expected {b.dtype}{tuple(b.shape)}")
        elif not torch.equal(_bytes(a), _bytes(b)):
            diff = (_bytes(a) != _bytes(b)).nonzero()
            probs.append(f"{name}: {diff.numel()} bytes differ, first at byte {diff[0].item()}")
        elif not a.is_contiguous():
            probs.append(f"{name}: received tensor is not contiguous")
    return probs


# --------------------------------------------------------------------------------------
# worker side
# --------------------------------------------------------------------------------------

# The mode under test (set per test through the workers' environment): "1" lets the sender use
# the shared window (its default on an xccl_rs group), "0" makes it broadcast every bucket.
SHARED_ENV = "WS_TEST_SHARED"


def _sender(pg, **kwargs):
    from xccl_rs.weight_sync import WeightSender

    kwargs.setdefault("shared_memory", None if os.environ.get(SHARED_ENV, "1") == "1" else False)
    return WeightSender(pg, **kwargs)


def _expect_mode(stats, what) -> list[str]:
    """The mode the stats report is the one this test expects (shared only on xccl_rs)."""
    import torch.distributed as dist

    from xccl_rs.weight_sync.window import uses_shared_memory

    want = os.environ.get(SHARED_ENV, "1") == "1" and os.environ.get("WS_TEST_FALLBACK") != "1"
    want = want and uses_shared_memory(dist.group.WORLD)
    if stats is not None and stats.shared_window != want:
        return [f"{what}: shared_window is {stats.shared_window}, expected {want}"]
    return []


def _sync(pg, src, case, bucket, recv_bucket=None, progress=False, gen=False, sender_kwargs=None, copy=True):
    """One sync of make_tensors(case) from group rank src; returns (problems, stats). With
    ``copy=False`` the receiver clones each view before asking for the next (as a consumer
    must), and at least one tensor must have arrived as a view (no copy made)."""
    from xccl_rs.weight_sync import WeightReceiver, WeightSender

    expected = make_tensors(case, BUCKET)
    if pg.rank() == src:
        s = _sender(pg, src=src, bucket_bytes=bucket, **(sender_kwargs or {}))
        assert all(slot.buf is None for slot in s._slots), "sender allocated at construction"
        items = (x for x in expected) if gen else expected
        stats = s.send(items, progress=progress)
        return [], stats
    r = WeightReceiver(pg, src=src, bucket_bytes=recv_bucket)
    assert not any(b is not None for b in r._bufs), "receiver allocated at construction"
    if copy:
        got = list(r.receive(progress=progress))
        views = 0
    else:
        got, views = [], 0
        for name, t in r.receive(progress=progress, copy=False):
            views += t._base is not None
            got.append((name, t.clone()))
    probs = compare(got, expected)
    if not copy and views == 0:
        probs.append("copy=False: no tensor arrived as a view of the bucket")
    cap = max(b.numel() for b in r._bufs if b is not None) if any(b is not None for b in r._bufs) else 0
    if cap > bucket:
        probs.append(f"receiver buffer of {cap} bytes > bucket_bytes {bucket}")
    return probs, r.last_stats


def w_round_trips(rank, world_size):
    import torch.distributed as dist

    from xccl_rs.weight_sync import plan_buckets

    pg = dist.group.WORLD
    src = 1
    res = {}
    # mixed tensors over many 64 KiB buckets, a generator on the sender, tqdm on
    probs, stats = _sync(pg, src, "mixed", BUCKET, progress=True, gen=True)
    probs += _expect_mode(stats, "mixed")
    plan = plan_buckets(make_tensors("mixed"), BUCKET)
    used = [max((e[3] + e[4] for e in b), default=0) for b in plan]
    if BUCKET not in used:
        probs.append(f"no bucket filled exactly: used {used}")
    if sum(1 for b in plan for e in b if e[0] == "big.strided") < 2:
        probs.append("big.strided was not split")
    res["mixed"] = (probs, stats.buckets, len(plan))
    # views instead of copies (the consumer clones each at once)
    res["views"] = _sync(pg, src, "views", BUCKET, copy=False)[0]
    # the receivers think buckets are 1 MiB and the sender uses 4 KiB: headers rule
    res["other_bucket"] = _sync(pg, src, "other", 4096, recv_bucket=1 << 20)[0]
    # nothing to send
    from xccl_rs.weight_sync import WeightReceiver, WeightSender

    if rank == src:
        st = _sender(pg, src=src, bucket_bytes=BUCKET).send([])
        res["empty"] = [] if st.tensors == 0 and st.buckets == 1 else [f"stats {st}"]
    else:
        got = list(WeightReceiver(pg, src=src).receive())
        res["empty"] = [] if got == [] else [f"got {len(got)} tensors"]
    # bucket_bytes above 2 GiB (the buffer is allocated lazily, only its used part touched)
    res["2gib"] = _sync(pg, src, "2gib", (2 << 30) + 4096)[0]
    # the source rank 0 this time, same objects reused for two syncs
    sender = receiver = None
    probs = []
    for i in range(2):
        case = f"reuse{i}"
        expected = make_tensors(case)
        if rank == 0:
            sender = sender or _sender(pg, src=0, bucket_bytes=3 * BUCKET)
            sender.send(expected)
        else:
            receiver = receiver or WeightReceiver(pg, src=0)
            probs += compare(list(receiver.receive()), expected)
    res["reuse"] = probs
    # the sender's producer fails mid-sync: receivers get an abort notice, the group stays usable
    probs = []

    def failing():
        for i, item in enumerate(make_tensors("abort")):
            if i == 9:
                raise KeyError("producer broke")
            yield item

    try:
        if rank == src:
            _sender(pg, src=src, bucket_bytes=BUCKET).send(failing())
        else:
            list(WeightReceiver(pg, src=src).receive())
        probs.append("no error")
    except Exception as e:  # noqa: BLE001
        want = "producer broke" if rank == src else "aborted"
        if want not in str(e):
            probs.append(f"{type(e).__name__}: {e}")
    probs += _sync(pg, src, "after_abort", BUCKET)[0]
    res["abort"] = probs
    return {k: (v if isinstance(v, tuple) else (v, None, None)) for k, v in res.items()}


def w_group_layout(rank, world_size):
    """World of 3; the sync group is global ranks [0, 2], source global rank 2 (group rank 1)."""
    import torch
    import torch.distributed as dist

    import xccl_rs

    res = {}
    sub = dist.new_group([0, 2])
    if rank in (0, 2):
        res["new_group"] = _sync(sub, 1, "layout", BUCKET)[0]
    # the default world still works beside it
    t = torch.ones(3)
    dist.all_reduce(t)
    res["world"] = [] if t.tolist() == [3.0] * 3 else [f"world all_reduce gave {t.tolist()}"]
    c = ctx()
    if rank in (0, 2):
        store = dist.PrefixStore("ws_private/", c.connect_store())
        pg = xccl_rs.new_group(store, rank // 2, 2, timeout=c.timeout())
        res["private"] = _sync(pg, 0, "private", BUCKET)[0]
        xccl_rs.destroy_group(pg)
    return res


def w_dead_receiver(rank, world_size):
    """Rank 2 dies after its first tensor; the sender (rank 0) must raise, not hang."""
    import torch.distributed as dist

    from xccl_rs.weight_sync import WeightReceiver, WeightSender

    pg = dist.group.WORLD
    big = make_tensors("dead") * 6  # several MB over 64 KiB buckets: the sender must block
    big = [(f"{i}.{n}", t) for i, (n, t) in enumerate(big)]
    if rank == 0:
        t0 = time.monotonic()
        try:
            _sender(pg, src=0, bucket_bytes=BUCKET).send(big)
        except Exception as e:  # noqa: BLE001
            return {"raised": True, "type": type(e).__name__, "msg": str(e), "elapsed": time.monotonic() - t0}
        return {"raised": False, "elapsed": time.monotonic() - t0}
    it = WeightReceiver(pg, src=0).receive()
    next(it)
    if rank == 2:
        os._exit(0)
    try:
        for _ in it:
            pass
    except Exception as e:  # noqa: BLE001
        return {"raised": True, "msg": str(e)}
    return {"raised": False}


def _straddling_tensors():
    """With 64 KiB buckets: "straddle" (88 KiB) fills the end of bucket 0 and goes on at the start
    of bucket 1, right after it in the window; "long" (150 KiB) spans buckets 2 to 4, so it is
    assembled; bucket 2 reuses the window's first half, where "straddle" began. Eight buckets."""
    import torch

    g = torch.Generator().manual_seed(seed_of("weight_sync", "straddling"))

    def rnd(dtype, n):
        size = torch.empty((), dtype=dtype).element_size()
        return torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g).view(dtype)

    return [
        ("head", rnd(torch.uint8, 16 << 10)),
        ("straddle", rnd(torch.float32, 22 << 10).view(11, 2048)),
        ("fill", rnd(torch.uint8, 30 << 10)),
        ("mid", rnd(torch.bfloat16, 5 << 10)),
        ("long", rnd(torch.uint8, 150 << 10)),
        ("tail", rnd(torch.uint8, 1000)),
        ("small", rnd(torch.uint8, 40 << 10)),
        # would start in bucket 5 (the window's second half) and span three buckets; through
        # the window it starts bucket 6 instead and goes on in bucket 7
        ("odd", rnd(torch.uint8, 100 << 10)),
        ("end", rnd(torch.uint8, 100)),
    ]


def _inside(t, memory) -> bool:
    return memory is not None and memory.data_ptr() <= t.data_ptr() < memory.data_ptr() + memory.numel()


def w_straddling(rank, world_size):
    """Where each tensor is handed out from, with copy=False and copy=True: a tensor whose two
    pieces lie back to back across the window's halves is read whole from the window (no
    assembly); a CPU tensor assembled from pieces lies in the receiver's kept assembly memory.
    The consumer holds "straddle" while the sender could already pack bucket 2 over its first
    piece, so it must still be intact when cloned later. Every tensor compares bit for bit."""
    import torch.distributed as dist

    from xccl_rs.weight_sync import WeightReceiver

    pg = dist.group.WORLD
    expected = _straddling_tensors()
    out = {}
    for copy in (False, True):
        if rank == 0:
            stats = _sender(pg, src=0, bucket_bytes=BUCKET).send(expected)
            out[copy] = ([] if stats.buckets == 8 else [f"{stats.buckets} buckets, expected 8"], None)
            continue
        receiver = WeightReceiver(pg, src=0)
        got, where = [], {}
        for name, t in receiver.receive(copy=copy):
            window = receiver._windows[0]
            places = {"window": window.memory if window is not None else None, "assembly": receiver._assembly_memory}
            places.update({"bucket": b for b in receiver._bufs if b is not None and _inside(t, b)})
            where.setdefault(next((k for k, m in places.items() if _inside(t, m)), "own"), []).append(name)
            if name == "straddle":
                time.sleep(0.3)  # the sender packs bucket 2 meanwhile, unless it waits for this view
            got.append((name, t.clone()))
        out[copy] = (compare(got, expected) + _expect_mode(receiver.last_stats, "straddling"), where)
    return out


# --------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------


def _no_window_files():
    import glob

    left = glob.glob("/dev/shm/xccl_rs-ws-*")
    assert not left, f"shared windows left in /dev/shm: {left}"


@pytest.mark.parametrize("shared", ["1", "0"], ids=["shared-window", "broadcast"])
def test_round_trips(shared):
    res = run_ranks(3, w_round_trips, timeout_s=90, env={SHARED_ENV: shared})
    _no_window_files()
    problems = []
    for rank in range(3):
        for case, (probs, nb, nplan) in res.value(rank).items():
            problems += [f"rank {rank} {case}: {p}" for p in probs]
            if nb is not None and nb != nplan:
                problems.append(f"rank {rank} {case}: {nb} buckets, plan says {nplan}")
            if case == "mixed" and nb is not None and nb < 3:
                problems.append(f"rank {rank}: only {nb} buckets")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("shared", ["1", "0"], ids=["shared-window", "broadcast"])
def test_large_tensors_are_read_whole_from_the_window_or_assembled_in_kept_memory(shared):
    res = run_ranks(3, w_straddling, timeout_s=90, env={SHARED_ENV: shared})
    _no_window_files()
    problems = []
    whole = ["head", "fill", "mid", "tail", "small", "end"]
    wants = {
        ("1", False): {"window": ["head", "straddle", "fill", "mid", "tail", "small", "odd", "end"],
                       "assembly": ["long"]},
        ("0", False): {"bucket": whole, "assembly": ["straddle", "long", "odd"]},
    }
    for rank in range(3):
        for copy, (probs, where) in res.value(rank).items():
            problems += [f"rank {rank} copy={copy}: {p}" for p in probs]
            want = None if rank == 0 else wants.get((shared, copy), {"own": [n for n, _ in _straddling_tensors()]})
            if want is not None:
                where = {k: sorted(v) for k, v in where.items()}
                want = {k: sorted(v) for k, v in want.items()}
            if where != want:
                problems.append(f"rank {rank} copy={copy}: handed out from {where}, expected {want}")
    assert not problems, "\n".join(problems)


def test_window_falls_back_across_hosts():
    """Rank 2 poses as another host (XCCL_RS_HOST_ID): it cannot map the window, so the group
    agrees to broadcast the buckets; every tensor still arrives, and no window file stays."""
    res = run_ranks(
        3, w_round_trips, timeout_s=120, env={"WS_TEST_FALLBACK": "1"},
        rank_env=lambda r: {"XCCL_RS_HOST_ID": "host-b" if r == 2 else "host-a"},
    )
    _no_window_files()
    problems = [f"rank {r} {case}: {p}" for r in range(3) for case, (probs, _, _) in res.value(r).items() for p in probs]
    assert not problems, "\n".join(problems)


def w_window_reuse(rank, world_size):
    """Sync 0 in a private group of ranks {0, 1}; sync 1 in a group of {0, 1, 2} reuses the
    window rank 2 never mapped, so the sender offers a fresh one, which everyone maps (rank 1,
    which kept the first, then holds two); sync 2 reuses that one. Every sync delivers every
    tensor through the window."""
    import torch.distributed as dist

    import xccl_rs
    from xccl_rs.weight_sync import WeightReceiver, WeightSender, window

    c = ctx()
    out = {}
    for i, members in enumerate([(0, 1), (0, 1, 2), (0, 1, 2)]):
        if rank not in members:
            continue
        store = dist.PrefixStore(f"reuse{i}/", c.connect_store())
        pg = xccl_rs.new_group(store, members.index(rank), len(members), timeout=c.timeout())
        expected = make_tensors(f"reuse{i}")
        if rank == 0:
            stats = WeightSender(pg, src=0, bucket_bytes=BUCKET).send(expected)
            probs = []
        else:
            r = WeightReceiver(pg, src=0)
            probs = compare(list(r.receive()), expected)
            stats = r.last_stats
        out[i] = (probs, stats.shared_window, len(window._mapped))
        xccl_rs.destroy_group(pg)
    return out


def test_window_reuse_and_newcomer():
    res = run_ranks(3, w_window_reuse, timeout_s=120)
    _no_window_files()
    for rank in range(3):
        for i, (probs, shared, _) in res.value(rank).items():
            assert not probs, f"rank {rank} sync {i}: {probs}"
            assert shared, f"rank {rank} sync {i}: the buckets were broadcast, not shared"
    assert set(res.value(2)) == {1, 2}
    # rank 1 mapped the first window and the fresh one offered in sync 1; rank 2 only the fresh one
    assert [res.value(1)[i][2] for i in range(3)] == [1, 2, 2], res.value(1)
    assert [res.value(2)[i][2] for i in (1, 2)] == [1, 1], res.value(2)


def w_unmappable(rank, world_size):
    """Every rank claims the sender's host (one XCCL_RS_HOST_ID), so the first step lets the
    sender make a window, but rank 2 cannot open its file (its /dev/shm is elsewhere): the flag
    after bucket 0 fails and the buckets are broadcast."""
    import torch.distributed as dist

    from xccl_rs.weight_sync import window

    if rank == 2:
        window.SHM_DIR = "/nonexistent-shm"
    probs, stats = _sync(dist.group.WORLD, 0, "unmappable", BUCKET)
    if stats.shared_window:
        probs.append("the buckets went through a window rank 2 cannot map")
    return probs


def test_window_falls_back_when_a_rank_cannot_map_it():
    res = run_ranks(3, w_unmappable, timeout_s=90, env={"XCCL_RS_HOST_ID": "one-host"})
    _no_window_files()
    res.assert_no_problems()


def test_group_layout():
    res = run_ranks(3, w_group_layout, timeout_s=90)
    problems = []
    for rank in range(3):
        for case, probs in res.value(rank).items():
            problems += [f"rank {rank} {case}: {p}" for p in (probs or [])]
    assert "new_group" in res.value(0) and "new_group" in res.value(2)
    assert not problems, "\n".join(problems)


def test_dead_receiver_raises():
    pg_timeout = 8.0
    res = run_ranks(3, w_dead_receiver, timeout_s=90, pg_timeout_s=pg_timeout, expect_fail_ranks=(1, 2), check=False)
    out = res.value(0)
    assert out is not None, res.report()
    assert out["raised"], f"sender did not raise: {out}"
    assert out["type"] == "WeightSyncError", out
    assert "bucket" in out["msg"], out["msg"]
    assert out["elapsed"] < pg_timeout + 20, out
    _no_window_files()


def test_plan_through_a_window_starts_large_tensors_in_its_first_half():
    """One sender through a shared window: a tensor of one to two buckets that would start in
    an odd-numbered bucket (the window's second half) starts the next bucket instead, filling it
    and ending in the one after, where receivers read it whole; a larger tensor, which cannot
    be read whole, and a plan without a window are laid out as before."""
    import torch

    from xccl_rs.weight_sync import plan_buckets

    b = 1 << 20
    ts = [(n, torch.empty(k, dtype=torch.uint8, device="meta")) for n, k in
          [("a", b + 1000), ("x", 1000), ("two", 2 * b - 4096), ("y", 1000), ("three", 2 * b + 4096)]]
    layout = [[(e[0], e[3], e[4]) for e in bucket] for bucket in plan_buckets(ts, b, window_halves=True)]
    assert layout == [
        [("a", 0, b)], [("a", 0, 1000), ("x", 1024, 1000)],  # "a" starts in bucket 0: as it was
        [("two", 0, b)], [("two", 0, b - 4096), ("y", b - 4096, 1000), ("three", b - 3072, 3072)],  # moved on
        [("three", 0, b)], [("three", 0, b)], [("three", 0, 1024)],  # larger than two buckets: not moved
    ], layout
    plain = [[(e[0], e[3]) for e in bucket] for bucket in plan_buckets(ts, b)]
    assert plain[1] == [("a", 0), ("x", 1024), ("two", 2048)], plain  # without a window it starts in bucket 1


def test_plan_64bit():
    """Packing arithmetic with sizes past 2^31 and 2^32 bytes (meta tensors: no memory)."""
    import torch

    from xccl_rs.weight_sync import plan_buckets

    bucket = (5 << 30) // 2  # 2.5 GiB
    ts = [
        ("a", torch.empty(100, dtype=torch.bfloat16, device="meta")),
        ("b", torch.empty(3 << 30, dtype=torch.uint8, device="meta")),  # 3 GiB: split
        ("c", torch.empty(600 << 20, dtype=torch.float32, device="meta")),  # 2.34 GiB: own bucket
        ("d", torch.empty(5, dtype=torch.float64, device="meta")),
    ]
    plan = plan_buckets(ts, bucket)
    chunks = [e for b in plan for e in b if e[0] == "b"]
    assert sum(e[4] for e in chunks) == 3 << 30 and len(chunks) == 2
    assert chunks[0][3] == 256 and chunks[0][3] + chunks[0][4] == bucket  # fills bucket 0
    assert chunks[1][5] == bucket - 256 and chunks[1][3] == 0
    c = [e for b in plan for e in b if e[0] == "c"]
    assert len(c) == 1 and c[0][3] == 0 and c[0][4] == 600 << 22  # fresh bucket, not split
    for b in plan:
        for name, _, _, off, n, _, _ in b:
            assert off + n <= bucket
    d = [e for b in plan for e in b if e[0] == "d"][0]
    assert d[3] % 256 == 0 and d[3] >= 600 << 22


def test_constructor_checks():
    """Argument errors (a one-rank gloo group in-process)."""
    import datetime

    import torch.distributed as dist

    from xccl_rs.weight_sync import WeightReceiver, WeightSender

    store = dist.HashStore()
    pg = dist.ProcessGroupGloo(store, 0, 1, datetime.timedelta(seconds=10))
    with pytest.raises(ValueError, match="src"):
        _sender(pg, src=1)
    with pytest.raises(ValueError, match="source rank"):
        WeightReceiver(pg, src=0)
    with pytest.raises(ValueError, match="bucket_bytes"):
        _sender(pg, src=0, bucket_bytes=16)


# --------------------------------------------------------------------------------------
# the wire format (format.py): round trips, and the decoder on bad input from the peer
# --------------------------------------------------------------------------------------

_BUCKET = 4096
_A = ["a", "float32", [2, 3], 0, 24, 0, 24]
_B = ["b", "bfloat16", [100], 256, 200, 0, 200]
_USED = 456  # where _B ends
_WINDOW = {"name": "xccl_rs-ws-" + "0" * 32, "host": "h", "bytes": 2 * _BUCKET, "reused": False}


def _entry_b(**changes):
    fields = ["name", "dtype", "shape", "offset", "nbytes", "chunk_offset", "total"]
    b = list(_B)
    for k, v in changes.items():
        b[fields.index(k)] = v
    return b


def _meta_obj(b=None, **changes):
    obj = {"i": 0, "total": -1, "e": [_A, _B if b is None else b]}
    obj.update(changes)
    return obj


def test_format_round_trips():
    """What the sender encodes, the receiver decodes to the same values; so do the plan's entries."""
    import torch

    from xccl_rs.weight_sync.format import Announcement, BucketMeta, Entry, Header, decode_offer, encode_offer
    from xccl_rs.weight_sync import plan_buckets

    for h in (Header(3, 77, 100, 1 << 33, last=True), Header(0, 2, 0, 256), Header(5, 30, 0, 4096, aborted=True)):
        assert Header.decode(h.encode(), "test", h.index) == h
    ann = Announcement("xccl_rs-ws-" + "ab" * 16, "host|1|2", 2 * _BUCKET, True)
    entries = [Entry("a", torch.float32, (2, 3), 0, 24, 0, 24), Entry("b", torch.bfloat16, (100,), 256, 200, 0, 200)]
    meta = BucketMeta(0, entries, 1234, ann)
    raw = meta.encode()
    h = Header(0, len(raw), _USED, _BUCKET)
    assert BucketMeta.decode(raw, h, "test") == meta
    abort = BucketMeta(4, abort="x" * 5000)
    got = BucketMeta.decode(abort.encode(), Header(4, 1, 0, _BUCKET, aborted=True), "test")
    assert got.abort == "x" * 2000 and got.entries == []
    assert decode_offer(encode_offer(ann), "test", 2 * _BUCKET) == ann and decode_offer(encode_offer(None), "t", 1) is None
    for bucket in plan_buckets(make_tensors("format"), BUCKET):
        used = max((e[3] + e[4] for e in bucket), default=0)
        for e in bucket:
            assert Entry.decode(e, "test", used).encode() == e


# (case id, the field the error must name, header values or None for the good one)
_HEADER_CASES = [
    ("truncated", "header", lambda g: g[:7]),
    ("too long", "header", lambda g: g + [0]),
    ("not a list", "header", lambda g: "header"),
    ("wrong magic", "magic", lambda g: [0x1234] + g[1:]),
    ("magic as float", "magic", lambda g: [float(g[0])] + g[1:]),
    ("wrong version", "version", lambda g: g[:1] + [g[1] - 1] + g[2:]),
    ("future version", "version", lambda g: g[:1] + [g[1] + 1] + g[2:]),
    ("negative meta_nbytes", "meta_nbytes", lambda g: g[:2] + [-1] + g[3:]),
    ("oversized meta_nbytes", "meta_nbytes", lambda g: g[:2] + [1 << 40] + g[3:]),
    ("negative used_bytes", "used_bytes", lambda g: g[:3] + [-4] + g[4:]),
    ("used_bytes past the bucket", "used_bytes", lambda g: g[:3] + [_BUCKET + 1] + g[4:]),
    ("used_bytes on an abort", "used_bytes", lambda g: g[:3] + [8, -1] + g[5:]),
    ("last out of range", "last", lambda g: g[:4] + [2] + g[5:]),
    ("last as bool", "last", lambda g: g[:4] + [True] + g[5:]),
    ("bucket_bytes too small", "bucket_bytes", lambda g: g[:3] + [0, 0, 16] + g[6:]),
    ("bucket_bytes too large", "bucket_bytes", lambda g: g[:5] + [1 << 50] + g[6:]),
    ("negative bucket_bytes", "bucket_bytes", lambda g: g[:5] + [-_BUCKET] + g[6:]),
    ("wrong index", "index", lambda g: g[:6] + [7, 0]),
    ("reserved not zero", "reserved", lambda g: g[:7] + [1]),
]


@pytest.mark.parametrize("field,mutate", [c[1:] for c in _HEADER_CASES], ids=[c[0] for c in _HEADER_CASES])
def test_header_decoder_rejects(field, mutate):
    from xccl_rs.weight_sync import WeightSyncError
    from xccl_rs.weight_sync.format import Header

    good = Header(0, 40, 100, _BUCKET).encode()
    Header.decode(good, "bucket 0 from rank 1", 0)
    with pytest.raises(WeightSyncError, match=f"bucket 0 from rank 1: .*field '{field}'"):
        Header.decode(mutate(list(good)), "bucket 0 from rank 1", 0)


def test_header_decoder_checks_bucket_bytes_against_bucket_0():
    from xccl_rs.weight_sync import WeightSyncError
    from xccl_rs.weight_sync.format import Header

    h = Header(2, 40, 100, 2 * _BUCKET).encode()
    with pytest.raises(WeightSyncError, match="field 'bucket_bytes' is 8192, expected 4096, as in bucket 0"):
        Header.decode(h, "bucket 2", 2, bucket_bytes=_BUCKET)


# (case id, the field the error must name, the metadata (a JSON value, or raw bytes), header kwargs)
_META_CASES = [
    ("not utf-8", "metadata", b"\xff\xfe{}", {}),
    ("not json", "metadata", b'{"i": 0,', {}),
    ("truncated json", "metadata", None, {"truncate": 10}),
    ("a list", "metadata", [], {}),
    ("index missing", "i", {"total": -1, "e": []}, {"used": 0}),
    ("wrong index", "i", _meta_obj(i=3), {}),
    ("index as string", "i", _meta_obj(i="0"), {}),
    ("total as string", "total", _meta_obj(total="5"), {}),
    ("total below -1", "total", _meta_obj(total=-2), {}),
    ("entries missing", "e", {"i": 0, "total": -1}, {"used": 0}),
    ("entries a dict", "e", _meta_obj(e={"a": _A}), {}),
    ("entry a dict", "entry", _meta_obj(b={"name": "b"}), {}),
    ("entry truncated", "entry", _meta_obj(b=_B[:6]), {}),
    ("entry too long", "entry", _meta_obj(b=_B + [[[0, 100]], None, 0]), {}),
    ("box not a list", "box", _meta_obj(b=_B + [0]), {}),
    ("box of another rank", "box", _meta_obj(b=_B + [[[0, 50], [0, 1]]]), {}),
    ("box past the dimension", "box", _meta_obj(b=_B + [[[60, 50]]]), {}),
    ("empty box", "box", _meta_obj(b=_B + [[[10, 0]]]), {}),
    ("nbytes past the box", "nbytes", _meta_obj(b=_entry_b(nbytes=200) + [[[0, 50]]]), {}),
    ("name not a string", "name", _meta_obj(b=_entry_b(name=5)), {}),
    ("unknown dtype", "dtype", _meta_obj(b=_entry_b(dtype="float33")), {}),
    ("dtype not a dtype", "dtype", _meta_obj(b=_entry_b(dtype="nn")), {}),
    ("dtype dunder", "dtype", _meta_obj(b=_entry_b(dtype="__class__")), {}),
    ("dtype not a string", "dtype", _meta_obj(b=_entry_b(dtype=7)), {}),
    ("shape a string", "shape", _meta_obj(b=_entry_b(shape="100")), {}),
    ("negative dimension", "shape", _meta_obj(b=_entry_b(shape=[-100])), {}),
    ("float dimension", "shape", _meta_obj(b=_entry_b(shape=[100.0])), {}),
    ("bool dimension", "shape", _meta_obj(b=_entry_b(shape=[True])), {}),
    ("too many dimensions", "shape", _meta_obj(b=_entry_b(shape=[1] * 65)), {}),
    ("total_nbytes disagrees with shape", "total_nbytes", _meta_obj(b=_entry_b(total=100)), {}),
    ("total_nbytes as string", "total_nbytes", _meta_obj(b=_entry_b(total="200")), {}),
    ("negative offset", "offset", _meta_obj(b=_entry_b(offset=-256)), {}),
    ("offset past used bytes", "offset", _meta_obj(b=_entry_b(offset=1000)), {}),
    ("offset as float", "offset", _meta_obj(b=_entry_b(offset=256.0)), {}),
    ("misaligned offset", "offset", _meta_obj(b=_entry_b(offset=255)), {}),
    ("negative nbytes", "nbytes", _meta_obj(b=_entry_b(nbytes=-200)), {}),
    ("nbytes past the used bytes", "nbytes", _meta_obj(b=_entry_b(offset=400, chunk_offset=0)), {}),
    ("nbytes past the tensor", "nbytes", _meta_obj(b=_entry_b(nbytes=202)), {}),
    ("oversized nbytes", "nbytes", _meta_obj(b=_entry_b(nbytes=1 << 70)), {}),
    ("zero nbytes of a non-empty tensor", "nbytes", _meta_obj(b=_entry_b(nbytes=0)), {}),
    ("nbytes as string", "nbytes", _meta_obj(b=_entry_b(nbytes="200")), {}),
    ("negative chunk_offset", "chunk_offset", _meta_obj(b=_entry_b(chunk_offset=-2)), {}),
    ("chunk_offset past the tensor", "chunk_offset", _meta_obj(b=_entry_b(chunk_offset=400)), {}),
    ("misaligned chunk_offset", "chunk_offset", _meta_obj(b=_entry_b(chunk_offset=1, nbytes=198)), {}),
    ("used_bytes not where the entries end", "used_bytes", _meta_obj(), {"used": 1000}),
    ("window after bucket 0", "w", _meta_obj(i=1, w=_WINDOW), {"index": 1}),
    ("window not an object", "w", _meta_obj(w=[1]), {}),
    ("window name not a string", "w.name", _meta_obj(w={**_WINDOW, "name": 3}), {}),
    ("window name too long", "w.name", _meta_obj(w={**_WINDOW, "name": "x" * 300}), {}),
    ("window host missing", "w.host", _meta_obj(w={k: v for k, v in _WINDOW.items() if k != "host"}), {}),
    ("window of another size", "w.bytes", _meta_obj(w={**_WINDOW, "bytes": _BUCKET}), {}),
    ("window size negative", "w.bytes", _meta_obj(w={**_WINDOW, "bytes": -1}), {}),
    ("window reused not a bool", "w.reused", _meta_obj(w={**_WINDOW, "reused": 1}), {}),
    ("abort reason not a string", "abort", {"i": 0, "abort": ["x"]}, {"aborted": True}),
    ("abort reason too long", "abort", {"i": 0, "abort": "x" * 3000}, {"aborted": True}),
]


@pytest.mark.parametrize("field,meta,hkw", [c[1:] for c in _META_CASES], ids=[c[0] for c in _META_CASES])
def test_metadata_decoder_rejects(field, meta, hkw):
    import json

    from xccl_rs.weight_sync import WeightSyncError
    from xccl_rs.weight_sync.format import BucketMeta, Header

    good = json.dumps(_meta_obj()).encode()
    BucketMeta.decode(good, Header(0, len(good), _USED, _BUCKET), "t")
    if meta is None:
        raw = good[: hkw.pop("truncate")]
    else:
        raw = meta if isinstance(meta, bytes) else json.dumps(meta).encode()
    aborted = hkw.get("aborted", False)
    h = Header(hkw.get("index", 0), len(raw), 0 if aborted else hkw.get("used", _USED), _BUCKET, aborted=aborted)
    with pytest.raises(WeightSyncError, match=f"bucket 0 from rank 1.*: field '{field}'"):
        BucketMeta.decode(raw, h, "bucket 0 from rank 1")


@pytest.mark.parametrize(
    "what,call,field",
    [
        ("negative offer length", lambda f: f.check_length(-1, "the window offer", "length", f.MAX_OFFER_BYTES), "length"),
        ("oversized offer length", lambda f: f.check_length(1 << 20, "the window offer", "length", f.MAX_OFFER_BYTES), "length"),
        ("offer not json", lambda f: f.decode_offer(b"{", "the window offer", 2 * _BUCKET), "offer"),
        ("offer a list", lambda f: f.decode_offer(b"[]", "the window offer", 2 * _BUCKET), "offer"),
        ("offer of another size", lambda f: f.decode_offer(
            json.dumps({**_WINDOW, "bytes": 7}).encode(), "the window offer", 2 * _BUCKET), "offer.bytes"),
    ],
    ids=lambda x: x if isinstance(x, str) and " " in x else "",
)
def test_offer_decoder_rejects(what, call, field):
    from xccl_rs.weight_sync import WeightSyncError, format

    with pytest.raises(WeightSyncError, match=f"the window offer: field '{re.escape(field)}'"):
        call(format)


# --------------------------------------------------------------------------------------
# accelerator and large-size scenarios (not run on the CPU-only CI machine)
# --------------------------------------------------------------------------------------


def w_gpu(rank, world_size, device_type="cuda"):
    """Accelerator tensors in and out: over an NCCL group with CUDA buckets (2+ devices), and
    over the harness's group with CPU buckets (device-to-host packing, host-to-device output)
    and with device buckets (xccl_rs stages them to the host and back)."""
    import torch
    import torch.distributed as dist

    from xccl_rs.weight_sync import WeightReceiver, WeightSender

    mod = getattr(torch, device_type)
    dev = torch.device(device_type, rank % mod.device_count())
    mod.set_device(dev)
    probs = []
    # "cuda" without an index is the current device (a bucket on cuda:0 must count as on it)
    for backend, bucket_dev in (("nccl", dev), (None, torch.device("cpu")), (None, device_type)):
        if backend == "nccl" and (
            device_type != "cuda" or not dist.is_nccl_available() or torch.cuda.device_count() < world_size
        ):
            continue
        pg = dist.new_group(backend=backend) if backend else dist.group.WORLD
        case = f"gpu-{backend}-{bucket_dev}"
        expected = [(n, t.to(dev)) for n, t in make_tensors(case)]
        if rank == 0:
            _sender(pg, src=0, bucket_bytes=BUCKET, device=bucket_dev).send(expected)
        else:
            got = list(WeightReceiver(pg, src=0, device=dev, bucket_device=bucket_dev).receive())
            probs += [f"{backend}: {n} on {t.device}" for n, t in got if t.device != dev]
            probs += [f"{backend}: {p}" for p in compare([(n, t.cpu()) for n, t in got],
                                                          [(n, t.cpu()) for n, t in expected])]
    return probs


@pytest.mark.gpu
def test_gpu_tensors():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    res = run_ranks(2, w_gpu, timeout_s=180)
    probs = res.value(0) + res.value(1)
    assert not probs, "\n".join(probs)


def w_gpu_window(rank, world_size, device_type="cuda"):
    """Device tensors through the shared window (an xccl_rs group, CPU buckets), two syncs: every
    rank registers the window with the device runtime (its memory reads as pinned), once (the
    same registration in the second sync, the window being kept), and the tensors arrive bit
    for bit although each side holds its stream: in the first sync the producer queues a 10 ms
    kernel before each tensor (the sender must not publish a bucket before its copies from the
    device land), in the second the consumer one after each tensor (a receiver must not hand a
    bucket back before its copies out of it are done). Returns the problems."""
    import torch
    import torch.distributed as dist

    import xccl_rs
    from accel import sleep, use
    from xccl_rs.weight_sync import WeightReceiver, WeightSender, window

    dev = use(device_type)
    c = ctx()
    pg = xccl_rs.new_group(dist.PrefixStore("gpu_window/", c.connect_store()), rank, world_size, timeout=c.timeout())
    probs, registrations = [], []
    pinned = device_type == "cuda"  # other runtimes register nothing: the copies stay blocking
    sender = WeightSender(pg, src=0, bucket_bytes=BUCKET) if rank == 0 else None
    receiver = WeightReceiver(pg, src=0, device=dev) if rank != 0 else None
    for sync, slow_side in enumerate(("sender", "receivers")):
        expected = [(n, t.to(dev)) for n, t in make_tensors(f"gpu-window-{sync}")]
        if rank == 0:
            def produce():
                for n, t in expected:
                    if slow_side == "sender":
                        sleep(device_type, 10)  # the producer still busy when the copy is queued
                    yield n, t
            stats = sender.send(produce())
            mappings = [window._kept.get(BUCKET)]
        else:
            got = []
            for n, t in receiver.receive():
                got.append((n, t))
                if slow_side == "receivers":
                    sleep(device_type, 10)  # the next copies out of the window queue behind it
            stats = receiver.last_stats
            probs += [f"sync {sync}: {n} on {t.device}" for n, t in got if t.device != dev]
            probs += [f"sync {sync}: {p}" for p in compare([(n, t.cpu()) for n, t in got],
                                                          [(n, t.cpu()) for n, t in expected])]
            mappings = list(window._mapped.values())
        if not stats.shared_window:
            probs.append(f"sync {sync}: the buckets were broadcast, not read in place")
        if len(mappings) != 1 or mappings[0] is None:
            probs.append(f"sync {sync}: {len(mappings)} windows kept, expected one")
            continue
        m = mappings[0]
        if m.registration is None or m.registration.pinned != pinned or m.memory.is_pinned() != pinned:
            probs.append(f"sync {sync}: the window is {'' if m.memory.is_pinned() else 'not '}pinned, expected "
                         f"{pinned} (registration: {m.registration and m.registration.pinned})")
        registrations.append(m.registration)
    if len(registrations) == 2 and registrations[0] is not registrations[1]:
        probs.append("the kept window was registered again in the second sync")
    (sender or receiver).release()
    if rank != 0 and window._mapped:
        probs.append("release() left a mapping")
    xccl_rs.destroy_group(pg)
    return probs


@pytest.mark.gpu
def test_gpu_tensors_through_a_registered_window():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    res = run_ranks(3, w_gpu_window, timeout_s=180)
    probs = [f"rank {r}: {p}" for r in range(3) for p in res.value(r)]
    assert not probs, "\n".join(probs)


@pytest.mark.gpu
def test_register_host_pins_and_unpins():
    """host_memory.register_host: a mapping of /dev/shm reads as pinned while registered and not
    after; memory torch pinned itself stays pinned when a registration of it ends; the CPU
    registers nothing."""
    import mmap
    import tempfile

    import torch

    from xccl_rs import host_memory

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    with tempfile.TemporaryFile(dir="/dev/shm") as f:  # the kind of memory a window is
        f.truncate(1 << 20)
        memory = torch.frombuffer(mmap.mmap(f.fileno(), 1 << 20, flags=mmap.MAP_SHARED), dtype=torch.uint8)
    assert not memory.is_pinned()
    reg = host_memory.register_host(memory, "cuda")
    assert reg.pinned and memory.is_pinned()
    dev = torch.arange(1 << 18, dtype=torch.int32, device="cuda")
    memory.view(torch.int32).copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(memory.view(torch.int32), dev.cpu())
    reg.unregister()
    assert not reg.pinned and not memory.is_pinned()
    own = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
    reg = host_memory.register_host(own, "cuda")
    assert reg.pinned
    reg.unregister()
    assert own.is_pinned(), "ending a registration unpinned memory torch pinned itself"
    assert not host_memory.register_host(torch.empty(16), "cpu").pinned


def large_tensors():
    """About 5.4 GB: a 3 GiB tensor split across a 2.5 GiB bucket boundary, then a 1.9 GiB
    one and a small one at bucket offsets beyond 2^31 (cheap deterministic patterns)."""
    import torch

    def pat(n, dtype, k):
        x = (torch.arange(n, dtype=torch.int64) * (2 * k + 1) + k) % 251
        return x.to(torch.uint8).view(dtype) if dtype == torch.uint8 else x.to(dtype)

    return [
        ("head", pat(100, torch.bfloat16, 1)),
        ("split_3gib", pat(3 << 30, torch.uint8, 2)),
        ("f32_1_9gib", pat(490 << 20, torch.float32, 3)),
        ("tail", pat(1001, torch.float64, 4)),
    ]


def w_large(rank, world_size):
    import torch.distributed as dist

    from xccl_rs.weight_sync import WeightReceiver, WeightSender, plan_buckets

    bucket = (5 << 30) // 2
    expected = large_tensors()
    plan = plan_buckets(expected, bucket)
    tail = [e for b in plan for e in b if e[0] == "tail"][0]
    probs = [] if tail[3] > (1 << 31) else [f"tail at offset {tail[3]}"]
    pg = dist.group.WORLD
    if rank == 0:
        st = _sender(pg, src=0, bucket_bytes=bucket).send(expected)
        return probs + ([] if st.buckets == len(plan) else [f"{st.buckets} buckets"]), str(st)
    r = WeightReceiver(pg, src=0)
    got = list(r.receive())
    return probs + compare(got, expected), str(r.last_stats)


@pytest.mark.skipif(not os.environ.get("XCCL_RS_TEST_LARGE"), reason="set XCCL_RS_TEST_LARGE=1 (needs ~25 GB of memory)")
def test_large_bucket_above_2gib():
    res = run_ranks(2, w_large, timeout_s=600, pg_timeout_s=300)
    probs = res.value(0)[0] + res.value(1)[0]
    print(res.value(0)[1], "|", res.value(1)[1])
    assert not probs, "\n".join(probs)
