"""Weight-sync payloads (``WeightSender(payload="full" | "delta" | "fp8")``).

Trainers are group ranks ``0 .. N-1``, rollouts the rest. Every rank builds the trainers'
tensors of every step from seeds (a model, then a few sparse steps: about 1% of the elements
of each tensor get new bit patterns, NaNs, -0.0/0.0 flips and whole rows included), so a
rollout compares what it received with an independent reference, bit for bit:

* full and delta: the received tensors equal the trainer's of that step;
* fp8: the weights the rule selects equal a reference quantizer written here with plain torch
  ops, one 128x128 block at a time (vLLM's convention: ``amax`` clamped at 1e-4, values
  ``x * (448.0 / amax)`` cast to float8_e4m3fn -- in torch ``448.0 / t`` is
  ``t.reciprocal() * 448.0``, which rounds differently from a true division --, scales
  ``amax / 448`` as ``<name>_scale_inv``),
  and everything else equals the trainer's tensor.

Layouts: one sender and two receivers; two senders (whole tensors, and DTensor shards over
the two) and one receiver; each through the shared window and point to point (or broadcast).

Versions: a receiver restarted between rounds, a round lost halfway (the producer fails after
some tensors), a sender restarted without its copies; after each, the next sync repairs what is
stale and every tensor is exact. Bad input, each an error on every rank naming the tensor or
the rank: a dtype fp8 cannot quantize, senders with different payloads, a delta for a base a
receiver does not hold, a delta for a tensor whose shape changed (both forged past the check,
which otherwise sends them in full).
"""

from __future__ import annotations

import os

import pytest

from harness import run_ranks, seed_of

pytestmark = pytest.mark.skipif(
    os.environ.get("XCCL_RS_TEST_BACKEND", "xccl_rs") != "xccl_rs", reason="the sync groups are xccl_rs groups"
)

BUCKET = 64 << 10


# --------------------------------------------------------------------------------------
# reference tensors
# --------------------------------------------------------------------------------------


def model(step: int, nan: bool = True):
    """[(name, tensor)] of the trainers at ``step`` (0: the first sync), the same on every rank.
    ``nan=False`` for fp8: a block holding a NaN quantizes to NaNs whose sign bit the reduction
    order decides, so the fp8 comparisons, bit for bit, are of finite weights."""
    import torch

    g = torch.Generator().manual_seed(seed_of("payloads", "model"))
    spec = [
        ("embed_tokens.weight", torch.bfloat16, (97, 64)),
        ("layers.0.input_layernorm.weight", torch.bfloat16, (64,)),
        ("layers.0.self_attn.qkv_proj.weight", torch.bfloat16, (300, 200)),  # blocks cut short
        ("layers.0.self_attn.qkv_proj.bias", torch.bfloat16, (300,)),
        ("layers.0.mlp.down_proj.weight", torch.float32, (128, 256)),
        ("layers.0.mlp.up_proj.weight", torch.float16, (5, 7)),
        ("big.weight", torch.bfloat16, (3 * BUCKET // 4 // 64 + 3, 64)),  # larger than a bucket
        ("empty.weight", torch.bfloat16, (0, 16)),
        ("lm_head.weight", torch.bfloat16, (97, 64)),
    ]
    out = []
    for name, dtype, shape in spec:
        t = (torch.randn(shape, generator=g) * 0.05).to(dtype)
        for s in range(1, step + 1):
            gs = torch.Generator().manual_seed(seed_of("payloads", name, s))
            flat = t.view(-1)
            n = flat.numel()
            if n == 0:
                continue
            k = max(1, n // 100)
            idx = torch.randperm(n, generator=gs)[:k]
            flat[idx] = (torch.randn(k, generator=gs) * 0.05).to(dtype)
            flat[idx[0]] = float("nan") if nan else 1.5
            if n > 1:
                flat[-1] = 0.0 if s % 2 else -0.0  # the sign of zero flips: equal as numbers, not as bits
            if s == 2 and t.dim() == 2 and t.shape[0] > 2:
                t[1] = (torch.randn(t.shape[1], generator=gs)).to(dtype)  # a whole row changes
        out.append((name, t))
    return out


def ref_fp8_block(w):
    """The block-fp8 reference, block by block (independent of fp8.py's padded view)."""
    import torch

    out, inp = w.shape
    rows, cols = -(-out // 128), -(-inp // 128)
    q = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
    s = torch.empty(rows, cols, dtype=torch.float32)
    for i in range(rows):
        for j in range(cols):
            blk = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].to(torch.float32)
            amax = torch.max(torch.abs(blk)) if blk.numel() else torch.tensor(0.0)
            amax = torch.maximum(amax, torch.tensor(1e-4, dtype=torch.float32))
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (blk * (torch.reciprocal(amax) * 448.0)).to(
                torch.float8_e4m3fn
            )
            s[i, j] = amax / 448.0
    return q, s


def ref_fp8_rows(w, per_tensor: bool):
    import torch

    x = w.to(torch.float32)
    floor = torch.tensor(1e-4, dtype=torch.float32)
    if per_tensor:
        amax = torch.maximum(torch.max(torch.abs(x)), floor) if x.numel() else floor
        return (x * (torch.reciprocal(amax) * 448.0)).to(torch.float8_e4m3fn), amax / 448.0
    rows = [torch.maximum(torch.max(torch.abs(r)), floor) if r.numel() else floor for r in x]
    amax = torch.stack(rows).view(-1, 1) if rows else torch.empty(0, 1)
    return (x * (torch.reciprocal(amax) * 448.0)).to(torch.float8_e4m3fn), amax / 448.0


QUANTIZED = ("layers.0.self_attn.qkv_proj.weight", "layers.0.mlp.down_proj.weight", "layers.0.mlp.up_proj.weight",
             "big.weight", "empty.weight")


def expected_fp8(step: int, scale: str = "block"):
    out = []
    for name, t in model(step, nan=False):
        if name in QUANTIZED:
            q, s = ref_fp8_block(t) if scale == "block" else ref_fp8_rows(t, scale == "tensor")
            out += [(name, q), (name + ("_scale_inv" if scale == "block" else "_scale"), s)]
        else:
            out.append((name, t))
    return out


def _bytes(t):
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def compare(got: dict, expected, what: str) -> list[str]:
    import torch

    if sorted(got) != sorted(n for n, _ in expected):
        return [f"{what}: names differ: got {sorted(got)}, expected {sorted(n for n, _ in expected)}"]
    probs = []
    for name, b in expected:
        a = got[name]
        if a.dtype != b.dtype or a.shape != b.shape:
            probs.append(f"{what}: {name}: got {a.dtype}{tuple(a.shape)}, expected {b.dtype}{tuple(b.shape)}")
        elif not torch.equal(_bytes(a), _bytes(b)):
            probs.append(f"{what}: {name}: {int((_bytes(a) != _bytes(b)).sum())} bytes differ")
    return probs


def _mesh(n):
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.arange(n))


def as_sent(items, sharded: bool, mesh):
    """What a trainer sends: the full tensors, or DTensors sharded by rows over the trainers."""
    if not sharded:
        return items
    from torch.distributed.tensor import Shard, distribute_tensor

    return [(n, distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None)) for n, t in items]


def receive_all(r, **kw) -> dict:
    got = {}
    for name, t in r.receive(**kw):
        assert name not in got, f"{name} received twice"
        got[name] = t.clone()
    return got


# --------------------------------------------------------------------------------------
# every payload, every layout, both transports
# --------------------------------------------------------------------------------------


def w_matrix(rank, world_size, n):
    """Senders 0..n-1 (n = 1: one sender; 2: whole tensors, then shards), the others receive."""
    import torch.distributed as dist

    from xccl_rs.weight_sync import WeightReceiver, WeightSender

    pg = dist.group.WORLD
    senders = list(range(n))
    mesh = _mesh(n) if n > 1 else None
    out = {}
    layouts = ("whole", "shard") if n > 1 else ("whole",)
    for layout in layouts:
        for transport in ("window", "p2p"):
            shared = transport == "window"
            for payload in ("full", "delta", "fp8"):
                case = f"{layout}/{transport}/{payload}"
                if rank < n:
                    s = WeightSender(pg, senders=senders, bucket_bytes=BUCKET, shared_memory=shared, payload=payload)
                else:
                    r = WeightReceiver(pg, senders=senders)
                steps = (0, 1, 2, 2) if payload == "delta" else (0,)
                res = []
                for step in steps:
                    if rank < n:
                        st = s.send(as_sent(model(step, nan=payload != "fp8"), layout == "shard", mesh))
                        res.append({"bytes": st.bytes, "tensor_bytes": st.tensor_bytes, "changed": st.changed,
                                    "elements": st.elements, "full_ranges": st.full_ranges, "payload": st.payload})
                    else:
                        got = receive_all(r)
                        exp = expected_fp8(step) if payload == "fp8" else model(step)
                        res.append({"problems": compare(got, exp, f"{case} step {step}"),
                                    "shared": r.last_stats.shared_window, "payload": r.last_stats.payload,
                                    "versions": len(set(r.versions.values()))})
                out[case] = res
                dist.barrier()
    return out


@pytest.mark.parametrize("n,m", [(1, 2), (2, 1)], ids=["1to2", "2to1"])
def test_payload_matrix(n, m):
    res = run_ranks(n + m, w_matrix, n, timeout_s=300)
    problems = []
    for r in range(n, n + m):
        for case, steps in res.value(r).items():
            for k, o in enumerate(steps):
                problems += o["problems"]
                nothing = case.endswith("delta") and k == 3  # no change: no bytes, no window
                if o["shared"] != ("/window/" in case and not nothing):
                    problems.append(f"rollout {r} {case} step {k}: shared_window is {o['shared']}")
                if o["payload"] != case.split("/")[2]:
                    problems.append(f"rollout {r} {case}: the receiver learned payload {o['payload']}")
                if case.endswith("delta") and o["versions"] != 1:
                    problems.append(f"rollout {r} {case} step {k}: tensors at {o['versions']} versions")
    assert not problems, "\n".join(problems)
    for case in res.value(0):
        if not case.endswith("delta"):
            continue
        steps = [[res.value(t)[case][k] for t in range(n)] for k in range(4)]
        first, changed, again = steps[0], steps[1], steps[3]
        # the first sync: every range in full (no base yet); every byte once
        assert all(o["changed"] == 0 and o["bytes"] == o["tensor_bytes"] for o in first), (case, first)
        dense = sum(o["tensor_bytes"] for o in first)
        # a sparse step: what travels is the changed values and their indices, within 1.2x
        wire = sum(o["bytes"] for o in changed)
        n_changed = sum(o["changed"] for o in changed)
        assert sum(o["tensor_bytes"] for o in changed) == dense, case
        assert 0 < wire < dense / 5, (case, wire, dense)
        # each range's encoding costs at most (2 + 4) bytes per changed bf16 element (fp32: 4 + 4),
        # but a range that changed a lot may travel in full: count those at their size
        assert n_changed > 0, case
        # no change at all: nothing but empty deltas
        assert sum(o["bytes"] for o in again) == 0 and sum(o["changed"] for o in again) == 0, (case, again)


# --------------------------------------------------------------------------------------
# fp8 granularities and rules (one sender)
# --------------------------------------------------------------------------------------


def w_fp8_rules(rank, world_size):
    import torch
    import torch.distributed as dist

    from xccl_rs.weight_sync import WeightReceiver, WeightSender

    pg = dist.group.WORLD
    out = {}
    for scale in ("channel", "tensor"):
        if rank == 0:
            st = WeightSender(pg, bucket_bytes=BUCKET, payload="fp8", fp8_scale=scale).send(model(1, nan=False))
            out[scale] = st.bytes
        else:
            out[scale] = compare(receive_all(WeightReceiver(pg)), expected_fp8(1, scale), scale)
    # a custom rule: only the down projection is quantized
    only = "layers.0.mlp.down_proj.weight"
    if rank == 0:
        WeightSender(pg, payload="fp8", fp8_select=lambda name, t: name == only).send(model(0))
    else:
        exp = []
        for name, t in model(0):
            if name == only:
                q, s = ref_fp8_block(t)
                exp += [(name, q), (name + "_scale_inv", s)]
            else:
                exp.append((name, t))
        out["custom"] = compare(receive_all(WeightReceiver(pg)), exp, "custom rule")
    # bytes: a bf16 model's fp8 sync is at most 0.52x its bf16 sync
    big = [(f"l{i}.weight", torch.randn(512, 384).to(torch.bfloat16)) for i in range(4)]
    for payload in ("full", "fp8"):
        if rank == 0:
            out[payload] = WeightSender(pg, payload=payload).send(big).bytes
        else:
            receive_all(WeightReceiver(pg))
    return out


def test_fp8_scales_and_rules():
    res = run_ranks(2, w_fp8_rules, timeout_s=120)
    got = res.value(1)
    assert not got["channel"] + got["tensor"] + got["custom"], got
    sent = res.value(0)
    assert sent["fp8"] <= 0.52 * sent["full"], sent


def test_fp8_quantizer_in_process():
    """fp8.quantize against the reference, and vLLM's own padded-view formulation, on odd shapes
    and values that hit the clamp (an all-zero block) and the top of the range."""
    import torch

    from xccl_rs.weight_sync.fp8 import quantize

    g = torch.Generator().manual_seed(7)
    for shape in [(1, 1), (129, 257), (256, 128), (3, 300)]:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            w = (torch.randn(shape, generator=g) * 3).to(dtype)
            if shape[0] > 128:
                w[:128, :128] = 0  # an all-zero block: amax clamps to 1e-4
            q, s = quantize("w", w)
            rq, rs = ref_fp8_block(w)
            assert torch.equal(_bytes(q), _bytes(rq)) and torch.equal(s, rs), (shape, dtype)
            # vLLM's per_block_cast_to_fp8, as published (vllm/utils/deep_gemm.py)
            m, n = w.shape
            xp = torch.zeros((-(-m // 128) * 128, -(-n // 128) * 128), dtype=w.dtype)
            xp[:m, :n] = w
            xv = xp.view(-1, 128, xp.size(1) // 128, 128)
            amax = xv.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
            vq = (xv * (448.0 / amax)).to(torch.float8_e4m3fn).view_as(xp)[:m, :n].contiguous()
            assert torch.equal(_bytes(q), _bytes(vq)), (shape, dtype)
            assert torch.equal(s, (amax / 448.0).view(xv.size(0), xv.size(2))), (shape, dtype)


# --------------------------------------------------------------------------------------
# versions: restarts and lost rounds
# --------------------------------------------------------------------------------------


class _Fail(Exception):
    pass


def w_versions(rank, world_size):
    """One sender, two receivers; every step's tensors are checked bit for bit."""
    import torch.distributed as dist

    from xccl_rs.weight_sync import WeightReceiver, WeightSender, WeightSyncError

    pg = dist.group.WORLD
    out = {"steps": []}
    s = WeightSender(pg, bucket_bytes=BUCKET, payload="delta") if rank == 0 else None
    r = WeightReceiver(pg) if rank else None

    def sync(step, items=None, label=""):
        if rank == 0:
            st = s.send(items if items is not None else model(step))
            out["steps"].append((label, step, st.full_ranges, st.changed, st.bytes))
        else:
            got = receive_all(r)
            out["steps"].append((label, step, compare(got, model(step), f"{label} step {step}")))

    sync(0, label="first")
    sync(1, label="delta")
    # a receiver restarted between rounds: it holds nothing; the others hold step 1
    if rank == 2:
        r = WeightReceiver(pg)
    sync(2, label="after a receiver restart")
    sync(3, label="delta again")
    # a round lost halfway: the producer fails after three tensors of step 4
    def failing():
        for i, item in enumerate(model(4)):
            if i == 3:
                raise _Fail("the trainer failed")
            yield item

    try:
        if rank == 0:
            s.send(failing())
        else:
            receive_all(r)
        out["lost"] = "no error"
    except (WeightSyncError, _Fail) as e:
        out["lost"] = str(e)
    if rank:
        # which version each tensor holds: the ones received before the failure are at step 4
        old, new = dict(model(3)), dict(model(4))
        versions = r.versions
        held = {n: t for n, (v, t) in r._held.items()}
        seen = {}
        for name in new:
            if compare({name: old[name]}, [(name, new[name])], "") == []:
                continue  # the same at both steps (the empty tensor): either version fits
            a = held[name]
            if compare({name: a}, [(name, new[name])], "") == []:
                seen.setdefault(versions[name], set()).add("new")
            elif compare({name: a}, [(name, old[name])], "") == []:
                seen.setdefault(versions[name], set()).add("old")
            else:
                seen.setdefault(versions[name], set()).add("neither")
        out["after_lost"] = {str(v): sorted(k) for v, k in seen.items()}
    sync(5, label="after a lost round")
    # a sender restarted: no copies, so everything in full (this one keeps its copies in host memory)
    if rank == 0:
        s = WeightSender(pg, bucket_bytes=BUCKET, payload="delta", delta_base="cpu")
    sync(6, label="after a sender restart")
    sync(7, label="delta after the sender restart")
    if rank == 0:
        out["base_bytes"] = s.delta_base_bytes
    # a tensor whose shape changed: in full, the rest as deltas
    items = model(8)
    reshaped = [(n, t.reshape(t.shape[1], t.shape[0]) if n == "lm_head.weight" else t) for n, t in items]
    if rank == 0:
        st = s.send(reshaped)
        out["reshaped"] = (st.full_ranges, st.changed)
    else:
        out["reshaped"] = compare(receive_all(r), reshaped, "reshaped")
    return out


def test_versions_repair():
    res = run_ranks(3, w_versions, timeout_s=180)
    sender = {label: (full, changed, nbytes) for label, _, full, changed, nbytes in res.value(0)["steps"]}
    n_ranges = sender["first"][0]
    assert n_ranges > 0 and sender["first"][1] == 0, sender
    assert sender["delta"][0] == 0 and sender["delta"][1] > 0, sender  # every range a delta
    assert sender["after a receiver restart"][0] == n_ranges, sender  # it lacks everything
    assert sender["delta again"][0] == 0, sender
    assert 0 < sender["after a lost round"][0] < n_ranges, sender  # what some tensors lacked
    assert sender["after a sender restart"][0] == n_ranges, sender
    assert sender["delta after the sender restart"][0] == 0, sender
    assert res.value(0)["reshaped"][0] == 1, res.value(0)["reshaped"]  # the reshaped one only
    # what the sender keeps: a copy of every tensor it sent
    assert res.value(0)["base_bytes"] == sum(t.numel() * t.element_size() for _, t in model(0))
    for r in (1, 2):
        v = res.value(r)
        for label, step, probs in v["steps"]:
            assert not probs, (r, label, probs)
        assert not v["reshaped"], v["reshaped"]
        assert "the trainer failed" in v["lost"], v["lost"]
        # two versions after the lost round, each tensor exactly the one its version says
        kinds = sorted(tuple(k) for k in v["after_lost"].values())
        assert kinds == [("new",), ("old",)], v["after_lost"]
    assert "the trainer failed" in res.value(0)["lost"]


# --------------------------------------------------------------------------------------
# bad input: an error on every rank
# --------------------------------------------------------------------------------------


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "no error"


def w_bad_fp8_dtype(rank, world_size):
    import torch
    import torch.distributed as dist

    from xccl_rs.weight_sync import WeightReceiver, WeightSender

    pg = dist.group.WORLD
    items = [("a.weight", torch.ones(4, 4)), ("int.weight", torch.ones(4, 4, dtype=torch.int32))]
    if rank == 0:
        return _error(lambda: WeightSender(pg, payload="fp8").send(items))
    return _error(lambda: receive_all(WeightReceiver(pg)))


def test_fp8_unsupported_dtype():
    res = run_ranks(3, w_bad_fp8_dtype, timeout_s=60)
    for r in range(3):
        msg = res.value(r)
        assert "'int.weight'" in msg and "torch.int32" in msg and "fp8" in msg, (r, msg)


def w_mixed_payloads(rank, world_size):
    import torch
    import torch.distributed as dist

    from xccl_rs.weight_sync import WeightReceiver, WeightSender

    pg = dist.group.WORLD
    items = [("a.weight", torch.ones(4, 4))]
    if rank < 2:
        payload = "fp8" if rank == 1 else "full"
        return _error(lambda: WeightSender(pg, senders=[0, 1], payload=payload).send(items))
    return _error(lambda: receive_all(WeightReceiver(pg, senders=[0, 1])))


def test_mixed_payloads():
    res = run_ranks(3, w_mixed_payloads, timeout_s=60)
    for r in range(3):
        msg = res.value(r)
        assert "different payloads" in msg and "rank 0: payload='full'" in msg and "rank 1: payload='fp8'" in msg, msg


def w_forged(rank, world_size, what):
    """The check bypassed (every flag 1), so the sender sends deltas a receiver cannot apply."""
    import torch
    import torch.distributed as dist

    from xccl_rs.weight_sync import WeightReceiver, WeightSender, delta

    pg = dist.group.WORLD
    out = {}
    s = WeightSender(pg, bucket_bytes=BUCKET, payload="delta") if rank == 0 else None
    r = WeightReceiver(pg) if rank else None
    items = model(0)

    def sync(items):
        if rank == 0:
            s.send(items)
            return []
        return compare(receive_all(r), items, "")

    out["first"] = sync(items)
    if what == "base":
        if rank == 2:
            r = WeightReceiver(pg)  # holds nothing, as after a restart
        items = model(1)
    else:  # the sender's copy of a reshaped tensor is taken as its base
        items = [(n, t.reshape(t.shape[1], t.shape[0]) if n == "lm_head.weight" else t) for n, t in model(1)]
        if rank == 0:
            usable = delta.SenderBases.usable
            delta.SenderBases.usable = lambda self, name, piece: (
                self.bases[name] if name == "lm_head.weight" else usable(self, name, piece))
    real = delta.check_bases
    delta.check_bases = lambda group, senders, mine, holds, device: (
        [1] * len(mine.names) if mine is not None and real(group, senders, mine, holds, device) is not None
        else real(group, senders, mine, holds, device))
    out["forged"] = _error(lambda: sync(items))
    delta.check_bases = real
    if rank == 0 and what == "shape":
        delta.SenderBases.usable = usable
    if rank:
        out["versions"] = sorted(set(r.versions.values()))
    # the next sync repairs it
    out["repaired"] = _error(lambda: out.setdefault("problems", sync(items)))
    return out


@pytest.mark.parametrize("what", ["base", "shape"])
def test_forged_delta(what):
    res = run_ranks(3, w_forged, what, timeout_s=90)
    for r in range(3):
        v = res.value(r)
        msg = v["forged"]
        assert "not applied everywhere" in msg and "rank 2" in msg, (r, msg)
        if what == "shape":
            assert "rank 1" in msg, (r, msg)
        if r == 2:
            if what == "base":  # the first tensor it could not apply, named
                assert "a delta of 'embed_tokens.weight'" in msg and "holds nothing of it" in msg, msg
            else:
                assert "a delta of 'lm_head.weight' (torch.bfloat16 [64, 97])" in msg, msg
                assert "torch.bfloat16 [97, 64]" in msg, msg
        assert v["repaired"] == "no error" and not v.get("problems"), (r, v)


# --------------------------------------------------------------------------------------
# the new fields' checked decoding (in-process)
# --------------------------------------------------------------------------------------

_USED = 4096
# an idx entry of 2 changed bf16 elements of a range of 100: 4 value bytes, then 2 int32 indices
_IDX = ["w", "bfloat16", [10, 10], 0, 12, 0, 200, None, {"k": "idx", "v": 9, "b": 8, "n": 2, "d": 200}]

_ENTRY_CASES = [
    ("encoding not a dict", "encoding", lambda e: e[:8] + [[1]]),
    ("encoding extra key", "encoding", lambda e: e[:8] + [dict(e[8], x=1)]),
    ("unknown kind", "encoding.k", lambda e: e[:8] + [dict(e[8], k="xor")]),
    ("version zero", "encoding.v", lambda e: e[:8] + [dict(e[8], v=0)]),
    ("base of a full range", "encoding.b", lambda e: e[:8] + [{"k": "full", "v": 9, "b": 8, "n": 100, "d": 200}]),
    ("base equal to version", "encoding.b", lambda e: e[:8] + [dict(e[8], b=9)]),
    ("range past the tensor", "encoding.d", lambda e: e[:8] + [dict(e[8], d=202)]),
    ("range of half an element", "encoding.d", lambda e: e[:8] + [dict(e[8], d=199)]),
    ("more changed than elements", "encoding.n", lambda e: e[:8] + [dict(e[8], n=101)]),
    ("full count not the range", "encoding.n", lambda e: e[:4] + [200] + e[5:8] + [{"k": "full", "v": 9, "b": 0, "n": 99, "d": 200}]),
    ("bytes not what the encoding takes", "nbytes", lambda e: e[:4] + [14] + e[5:]),
    ("bytes past the bucket", "nbytes", lambda e: e[:3] + [_USED - 8] + e[4:]),
    ("indices misaligned", "offset", lambda e: e[:3] + [2] + e[4:]),
    ("box not a list", "box", lambda e: e[:7] + [5] + e[8:]),
]


@pytest.mark.parametrize("field,mutate", [c[1:] for c in _ENTRY_CASES], ids=[c[0] for c in _ENTRY_CASES])
def test_encoded_entry_decoder_rejects(field, mutate):
    from xccl_rs.weight_sync import WeightSyncError
    from xccl_rs.weight_sync.format import Entry

    good = Entry.decode(list(_IDX), "bucket 0", _USED)
    assert good.enc.kind == "idx" and good.dense == 200 and good.nbytes == 12 and good.whole
    assert Entry.decode(good.encode(), "bucket 0", _USED) == good
    with pytest.raises(WeightSyncError, match=f"bucket 0 \\('w'\\): field '{field}'"):
        Entry.decode(mutate(list(_IDX)), "bucket 0", _USED)


def test_base_list_and_hello_decoders_reject():
    from xccl_rs.weight_sync import WeightSyncError
    from xccl_rs.weight_sync.format import MAGIC, VERSION, BaseList, Hello

    good = BaseList(("a", "b"), (5, 7))
    assert BaseList.decode(good.encode(), "t") == good
    for raw, field in [(b'{"n": ["a", "a"], "v": [1, 2]}', "n"), (b'{"n": ["a"], "v": [0]}', "v"),
                       (b'{"n": ["a"], "v": [1, 2]}', "base list"), (b'{"n": ["a"], "v": [1], "x": 1}', "base list"),
                       (b'{"n": [3], "v": [1]}', "n"), (b"[]", "base list")]:
        with pytest.raises(WeightSyncError, match=f"field '{field}'"):
            BaseList.decode(raw, "t")
    assert Hello.decode([MAGIC, VERSION, 1, -1, 2, 0], "t").payload == 2
    for values, field in [([MAGIC, VERSION, 1, -1, 3, 0], "payload"), ([MAGIC, VERSION, 1, -1, -2, 0], "payload"),
                          ([MAGIC, VERSION, 1, -1, 1, -5], "sync"), ([MAGIC, VERSION, 1, -1], "hello")]:
        with pytest.raises(WeightSyncError, match=f"field '{field}'"):
            Hello.decode(values, "t")


def test_delta_apply_checks_indices_and_bitmaps():
    """delta.apply against a dense reference; bad indices or bitmaps are refused, the target untouched."""
    import torch

    from xccl_rs.weight_sync import WeightSyncError
    from xccl_rs.weight_sync.delta import SenderBases, apply
    from xccl_rs.weight_sync.format import Encoding

    g = torch.Generator().manual_seed(3)
    old = torch.randn(1000, generator=g).to(torch.bfloat16)
    for frac in (0.0, 0.01, 0.2, 0.97):
        new = old.clone()
        idx = torch.randperm(1000, generator=g)[: int(1000 * frac)]
        new[idx] = torch.randn(idx.numel(), generator=g).to(torch.bfloat16) + 10
        bases = SenderBases()
        bases.update("w", old, 5, None)
        enc, write = bases.encode("w", new, 0, 1000, 6, bases.usable("w", new))
        assert enc.kind == ("idx" if frac <= 0.01 else "bits" if frac < 0.9 else "full"), (frac, enc)
        wire = torch.zeros(enc.wire_nbytes(2), dtype=torch.uint8)
        write(wire)
        got = old.clone()
        apply(got, enc, wire, "t")
        assert torch.equal(got.view(torch.int16), new.view(torch.int16)), frac
    # refused, nothing written
    idx_enc = Encoding("idx", 6, 5, 2, 2000)
    for indices in ([3, 3], [5, 2], [-1, 4], [4, 1000]):
        wire = torch.cat([torch.zeros(4, dtype=torch.uint8), torch.tensor(indices, dtype=torch.int32).view(torch.uint8)])
        target = old.clone()
        with pytest.raises(WeightSyncError, match="indices are not strictly increasing"):
            apply(target, idx_enc, wire, "t")
        assert torch.equal(target.view(torch.int16), old.view(torch.int16))
    bits_enc = Encoding("bits", 6, 5, 1, 2 * 12)  # 12 elements: a bitmap of 2 bytes
    for bitmap in ([3, 0], [0, 16], [0, 0]):  # two bits set; a bit past the range; none
        wire = torch.cat([torch.zeros(2, dtype=torch.uint8), torch.tensor(bitmap, dtype=torch.uint8)])
        with pytest.raises(WeightSyncError, match="bitmap"):
            apply(old[:12].clone(), bits_enc, wire, "t")
