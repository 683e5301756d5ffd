"""Bad input gives a clear error on every rank within the timeout, never a hang; the Work
API behaves.

One spawn (world size 3) runs the non-fatal scenarios, each on a fresh process group and
after an out-of-band store barrier; the timeout and dead-peer scenarios get their own
spawns. Error messages are only checked for xccl_rs (gloo's wording differs).
"""

from __future__ import annotations

import datetime
import os
import time

import pytest

import harness
from harness import IS_GLOO, IS_XCCL, ctx, run_ranks

W = 3
SCENARIO_PG_TIMEOUT_S = 10.0


def check_message(msg: str, *keyword_groups) -> str | None:
    """Loose check of an error message (xccl_rs only): it names the backend and contains
    at least one keyword of every group. Returns a problem description or None."""
    if not IS_XCCL:
        return None
    low = msg.lower()
    probs = []
    if "xccl" not in low:
        probs.append("does not mention xccl_rs")
    for group in keyword_groups:
        if not any(k in low for k in group):
            probs.append(f"mentions none of {list(group)}")
    return ("error message " + ", ".join(probs) + f": {msg[:500]!r}") if probs else None


TIMEOUT_WORDS = ("timed out", "timeout", "time out", "deadline")


# --------------------------------------------------------------------------------------
# worker side
# --------------------------------------------------------------------------------------


def _store_barrier(store, key, w, timeout_s=60.0):
    store.add(key, 1)
    t0 = time.monotonic()
    while int(store.add(key, 0)) < w:
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"store barrier {key} timed out")
        time.sleep(0.005)


def _outcome(fn):
    """Run fn(); return dict(raised, msg, elapsed, value)."""
    t0 = time.monotonic()
    try:
        v = fn()
        return {"raised": False, "msg": "", "elapsed": time.monotonic() - t0, "value": v}
    except Exception as e:  # noqa: BLE001
        return {
            "raised": True,
            "msg": f"{type(e).__name__}: {e}",
            "elapsed": time.monotonic() - t0,
            "value": None,
        }


def _work_api(rank, w, g):
    """Returns a list of problems."""
    import warnings

    import torch
    import torch.distributed as dist

    probs = []
    t = torch.full((1001,), float(rank + 1))
    work = dist.all_reduce(t, group=g, async_op=True)
    if work is None:
        return ["all_reduce(async_op=True) returned None"]
    r = work.wait()
    if r is not True:
        probs.append(f"wait() returned {r!r}, expected True")
    if not work.is_completed():
        probs.append("is_completed() is False after wait()")
    total = float(w * (w + 1) // 2)
    if not torch.equal(t, torch.full((1001,), total)):
        probs.append(f"all_reduce result {t[:3].tolist()}..., expected {total}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exc = work.exception()
    if exc is not None:
        probs.append(f"exception() after success is {exc!r}, expected None")
    try:
        val = work.get_future().value()
        if not isinstance(val, list) or len(val) != 1 or not isinstance(val[0], torch.Tensor):
            probs.append(f"get_future().value() is {type(val).__name__} {val!r:.200}, expected [tensor]")
        elif not torch.equal(val[0], t):
            probs.append("get_future().value()[0] differs from the output tensor")
    except Exception as e:  # noqa: BLE001
        probs.append(f"get_future().value() raised {type(e).__name__}: {e}")
    # wait(timeout=...) on a completed-in-time op
    t2 = torch.arange(7, dtype=torch.float64) * (rank + 1)
    work2 = dist.all_reduce(t2, op=dist.ReduceOp.MAX, group=g, async_op=True)
    try:
        r2 = work2.wait(timeout=datetime.timedelta(seconds=20))
        if r2 is not True:
            probs.append(f"wait(timeout=20s) returned {r2!r}, expected True")
    except Exception as e:  # noqa: BLE001
        probs.append(f"wait(timeout=20s) raised {type(e).__name__}: {e}")
    if not torch.equal(t2, torch.arange(7, dtype=torch.float64) * w):
        probs.append(f"MAX result {t2.tolist()}")
    # is_completed() eventually becomes True without wait()
    t3 = torch.ones(5)
    work3 = dist.broadcast(t3, src=0, group=g, async_op=True)
    deadline = time.monotonic() + 20
    while not work3.is_completed() and time.monotonic() < deadline:
        time.sleep(0.001)
    if not work3.is_completed():
        probs.append("broadcast work never reported is_completed() without wait()")
    work3.wait()
    # several outstanding works, waited in reverse order
    ts = [torch.full((33,), float(rank * 10 + k)) for k in range(4)]
    works = [dist.all_reduce(x, group=g, async_op=True) for x in ts]
    for wk in reversed(works):
        wk.wait()
    for k, x in enumerate(ts):
        exp = float(sum(r * 10 + k for r in range(w)))
        if not torch.equal(x, torch.full((33,), exp)):
            probs.append(f"outstanding work {k}: got {x[0].item()}, expected {exp}")
    # a barrier Work
    bw = dist.barrier(group=g, async_op=True)
    if bw is None or bw.wait() is not True:
        probs.append("barrier(async_op=True).wait() did not return True")
    return probs


def _noncontig(rank, w, g):
    """Each case: ('ok'|'wrong'|'raised', detail). Values are checked when no error."""
    import torch
    import torch.distributed as dist

    out = {}

    def run(name, fn):
        try:
            ok, detail = fn()
            out[name] = ("ok" if ok else "wrong", detail)
        except Exception as e:  # noqa: BLE001
            out[name] = ("raised", f"{type(e).__name__}: {e}")

    def ar_strided():
        base = torch.arange(40.0).reshape(5, 8) + 100 * rank
        v = base[:, ::2]
        before_other = base[:, 1::2].clone()
        dist.all_reduce(v, group=g)
        exp = sum(torch.arange(40.0).reshape(5, 8)[:, ::2] + 100 * r for r in range(w))
        ok = torch.equal(v, exp) and torch.equal(base[:, 1::2], before_other)
        return ok, f"got {v.tolist()} expected {exp.tolist()}; untouched columns kept: {torch.equal(base[:, 1::2], before_other)}"

    def ar_transposed():
        base = torch.arange(12.0).reshape(3, 4) * (rank + 1)
        v = base.t()
        dist.all_reduce(v, group=g)
        exp = torch.arange(12.0).reshape(3, 4).t() * (w * (w + 1) // 2)
        return torch.equal(v, exp), f"got {v.tolist()} expected {exp.tolist()}"

    def bcast_strided():
        base = (torch.arange(30.0).reshape(5, 6) if rank == 0 else torch.full((5, 6), -1.0))
        v = base[:, 1::3]
        dist.broadcast(v, src=0, group=g)
        exp_full = torch.full((5, 6), -1.0) if rank else torch.arange(30.0).reshape(5, 6)
        exp_full[:, 1::3] = torch.arange(30.0).reshape(5, 6)[:, 1::3]
        return torch.equal(base, exp_full), f"got {base.tolist()} expected {exp_full.tolist()}"

    def ag_strided_outputs():
        big = torch.zeros(w, 6)
        outs = [big[i, ::2] for i in range(w)]
        dist.all_gather(outs, torch.full((3,), float(rank + 1)), group=g)
        exp = torch.zeros(w, 6)
        for i in range(w):
            exp[i, ::2] = float(i + 1)
        return torch.equal(big, exp), f"got {big.tolist()} expected {exp.tolist()}"

    def ag_strided_input():
        src = (torch.arange(8.0) + 10 * rank)[::2]
        outs = [torch.zeros(4) for _ in range(w)]
        dist.all_gather(outs, src, group=g)
        exps = [(torch.arange(8.0) + 10 * r)[::2] for r in range(w)]
        ok = all(torch.equal(o, e) for o, e in zip(outs, exps))
        return ok, f"got {[o.tolist() for o in outs]}"

    for name, fn in [
        ("all_reduce t[:, ::2]", ar_strided),
        ("all_reduce t.t()", ar_transposed),
        ("broadcast t[:, 1::3]", bcast_strided),
        ("all_gather strided output list", ag_strided_outputs),
        ("all_gather strided input", ag_strided_input),
    ]:
        run(name, fn)
    return out


def errors_sweep(rank, w):
    import torch
    import torch.distributed as dist

    c = ctx()
    store = c.connect_store()
    results = {}
    timeout = datetime.timedelta(seconds=SCENARIO_PG_TIMEOUT_S)

    def scenario(name, fn):
        c.progress(name)
        _store_barrier(store, f"errors/{name}/before", w)
        g = dist.new_group(backend=c.backend, timeout=timeout)
        results[name] = _outcome(lambda: fn(g))
        c.put_result(name, results[name])
        _store_barrier(store, f"errors/{name}/after", w, timeout_s=120)

    scenario("work_api", lambda g: _work_api(rank, w, g))
    scenario("band_float32", lambda g: dist.all_reduce(torch.ones(10), op=dist.ReduceOp.BAND, group=g))
    scenario("bor_float64", lambda g: dist.all_reduce(torch.ones(10, dtype=torch.float64), op=dist.ReduceOp.BOR, group=g))
    scenario("float8_all_reduce", lambda g: dist.all_reduce(torch.ones(10).to(torch.float8_e4m3fn), group=g))
    scenario(
        "float8_reduce_scatter",
        lambda g: dist.reduce_scatter_tensor(
            torch.zeros(4).to(torch.float8_e5m2), torch.ones(4 * w).to(torch.float8_e5m2), group=g
        ),
    )
    scenario("noncontiguous", lambda g: _noncontig(rank, w, g))
    scenario(
        "all_gather_wrong_list_length",
        lambda g: dist.all_gather([torch.zeros(3) for _ in range(w + 1)], torch.ones(3), group=g),
    )
    scenario(
        "all_gather_wrong_output_size",
        lambda g: dist.all_gather([torch.zeros(4) for _ in range(w)], torch.ones(3), group=g),
    )
    # The world group still works after all of that.
    scenario("world_after_errors", lambda g: _after(rank, w))
    return results


def mismatch_worker(rank, w, kind):
    """Cross-rank mismatches, each in its own spawn (a crash must not hide the others)."""
    import torch
    import torch.distributed as dist

    if kind == "size_small":
        t = torch.ones(1001 if rank == 1 else 1000)
    elif kind == "size_large":
        t = torch.ones(262147 if rank == 1 else 1000)
    elif kind == "dtype":
        t = torch.ones(1000, dtype=torch.float64 if rank == 1 else torch.float32)
    elif kind == "heap_size":  # zero-copy tensors (their heap answers travel with the sizes)
        import xccl_rs

        t = xccl_rs.empty(262147 if rank == 1 else 262144).fill_(1)
    elif kind == "heap_dtype":
        import xccl_rs

        t = xccl_rs.empty(65536, dtype=torch.float64 if rank == 1 else torch.float32).fill_(1)
    else:
        raise ValueError(kind)
    return _outcome(lambda: dist.all_reduce(t))


def _after(rank, w):
    import torch
    import torch.distributed as dist

    t = torch.full((5,), float(rank))
    dist.all_reduce(t)
    exp = float(sum(range(w)))
    if not torch.equal(t, torch.full((5,), exp)):
        return [f"world all_reduce gave {t.tolist()}, expected {exp}"]
    return []


def timeout_worker(rank, w, sleeper):
    import torch
    import torch.distributed as dist

    t = torch.ones(1000)
    dist.all_reduce(t)  # warm-up: connections established
    store = ctx().connect_store()
    if rank == sleeper:
        # skip the collective; stay alive (and silent) until the others are done
        t0 = time.monotonic()
        while int(store.add("timeout_test/done", 0)) < w - 1 and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        return {"sleeper": True}
    out = {"sleeper": False, **_outcome(lambda: dist.all_reduce(t))}
    store.add("timeout_test/done", 1)
    return out


def dead_peer_worker(rank, w, victim, warmup, heap=False):
    import torch
    import torch.distributed as dist

    if warmup:
        dist.all_reduce(torch.ones(1000))
    if heap:  # the survivors' tensors in their heaps: the zero-copy all-reduce's first block
        import xccl_rs

        t = xccl_rs.empty(262147).fill_(1)
    else:
        t = torch.ones(262147)
    if rank == victim:
        time.sleep(0.2)
        os._exit(1)
    time.sleep(0.5)  # let the victim die first
    return _outcome(lambda: dist.all_reduce(t))


# --------------------------------------------------------------------------------------
# pytest side
# --------------------------------------------------------------------------------------

_CACHE: dict = {}


def _sweep():
    if "sweep" not in _CACHE:
        _CACHE["sweep"] = run_ranks(
            W, errors_sweep, timeout_s=300, pg_timeout_s=SCENARIO_PG_TIMEOUT_S, check=False
        )
    return _CACHE["sweep"]


def _scenario(name):
    res = _sweep()
    probs = res.rank_problems()
    outs = {}
    for r in range(W):
        v = res.partials.get(r)
        if v is None or name not in v:
            raise AssertionError(
                f"scenario {name!r} has no result on rank {r}\n" + "\n".join(probs)
            )
        outs[r] = v[name]
    return outs


def _assert_all_raise(name, *keyword_groups, max_s=SCENARIO_PG_TIMEOUT_S + 10, outs=None):
    outs = _scenario(name) if outs is None else outs
    probs = []
    for r, o in outs.items():
        if not o["raised"]:
            probs.append(f"rank {r}: did not raise (returned {o['value']!r:.200})")
            continue
        if o["elapsed"] > max_s:
            probs.append(f"rank {r}: raised only after {o['elapsed']:.1f}s (> {max_s}s)")
        m = check_message(o["msg"], *keyword_groups)
        if m:
            probs.append(f"rank {r}: {m}")
    assert not probs, f"scenario {name}:\n" + "\n".join(probs)


def _assert_no_problems(name):
    """Scenario ``name`` raised on no rank, and each rank's list of problems is empty."""
    probs = []
    for r, o in _scenario(name).items():
        if o["raised"]:
            probs.append(f"rank {r} raised {o['msg']}")
        else:
            probs.extend(f"rank {r}: {p}" for p in o["value"])
    assert not probs, "\n".join(probs)


def test_work_api():
    _assert_no_problems("work_api")


def test_band_on_float_raises():
    _assert_all_raise("band_float32", ("band", "bitwise", "reduce op", "reduceop", "op"), ("float", "dtype", "support"))
    _assert_all_raise("bor_float64", ("bor", "bitwise", "reduce op", "reduceop", "op"), ("float", "dtype", "support"))


def test_reduction_on_float8_raises():
    f8 = ("float8", "e4m3", "e5m2", "fp8", "dtype", "support")
    _assert_all_raise("float8_all_reduce", f8)
    _assert_all_raise("float8_reduce_scatter", f8)


# gloo silently writes these strided views as if they were contiguous (this test
# detects it); they are only ignored when validating with gloo.
GLOO_CORRUPTS = {"all_reduce t[:, ::2]", "broadcast t[:, 1::3]"}


def test_noncontiguous_correct_or_clear_error():
    outs = _scenario("noncontiguous")
    probs = []
    for r, o in outs.items():
        if o["raised"]:
            probs.append(f"rank {r}: scenario raised outside the individual cases: {o['msg']}")
            continue
        for case, (status, detail) in o["value"].items():
            if IS_GLOO and case in GLOO_CORRUPTS:
                continue
            if status == "wrong":
                probs.append(f"rank {r}: {case}: WRONG VALUES (no error raised): {detail}")
            elif status == "raised":
                m = check_message(detail, ("contiguous", "stride", "dense"))
                if m:
                    probs.append(f"rank {r}: {case}: {m}")
    # the outcome must be the same on every rank
    for case in outs[0]["value"] if not outs[0]["raised"] else []:
        if IS_GLOO and case in GLOO_CORRUPTS:
            continue
        statuses = {r: o["value"][case][0] for r, o in outs.items() if not o["raised"]}
        if len(set(statuses.values())) > 1:
            probs.append(f"{case}: inconsistent outcome across ranks {statuses}")
    assert not probs, "\n".join(probs)


def test_all_gather_wrong_output_list():
    ag = ("all_gather", "allgather", "all-gather")
    _assert_all_raise("all_gather_wrong_list_length", ag, ("size", "length", "len", "list", "world", "expected"))
    _assert_all_raise("all_gather_wrong_output_size", ag, ("size", "shape", "numel", "mismatch", "expected"))


def _mismatch(kind):
    res = run_ranks(
        W, mismatch_worker, kind, timeout_s=120, pg_timeout_s=SCENARIO_PG_TIMEOUT_S,
        check=False, shutdown_grace_s=20,
    )
    outs = {}
    for r in range(W):
        v = res.value(r)
        if v is None:
            raise AssertionError(f"{kind} mismatch: rank {r} did not report\n" + "\n".join(res.rank_problems()))
        outs[r] = v
    return outs


@pytest.mark.skipif(IS_GLOO, reason="gloo does not detect cross-rank size mismatches (garbage, hang or abort)")
@pytest.mark.parametrize("kind", ["size_small", "size_large"])
def test_size_mismatch_raises_everywhere(kind):
    kw = ("mismatch", "size", "numel", "count", "length", *TIMEOUT_WORDS)
    _assert_all_raise(f"{kind} mismatch", kw, outs=_mismatch(kind))


@pytest.mark.skipif(IS_GLOO, reason="xccl_rs's shared-memory heap")
@pytest.mark.parametrize("kind", ["heap_size", "heap_dtype"])
def test_zero_copy_mismatch_raises_everywhere(kind):
    kw = ("mismatch", "size", "numel", "count", "dtype", "type")
    _assert_all_raise(f"{kind} mismatch", kw, outs=_mismatch(kind))  # no timeout words: the description check, not a hang


@pytest.mark.skipif(IS_GLOO, reason="gloo does not detect cross-rank dtype mismatches (garbage or abort)")
def test_dtype_mismatch_raises_everywhere():
    kw = ("mismatch", "dtype", "type", "size", *TIMEOUT_WORDS)
    _assert_all_raise("dtype mismatch", kw, outs=_mismatch("dtype"))


def test_groups_usable_after_errors():
    _assert_no_problems("world_after_errors")


def test_errors_run_shuts_down_cleanly():
    res = _sweep()
    probs = res.rank_problems()
    assert not probs, "\n".join(probs)


def test_timeout_raises_on_waiting_ranks():
    pg_timeout = 3.0
    res = run_ranks(3, timeout_worker, 1, timeout_s=120, pg_timeout_s=pg_timeout)
    probs = []
    for r in range(3):
        o = res.value(r)
        if o["sleeper"]:
            continue
        if not o["raised"]:
            probs.append(f"rank {r}: all_reduce with an absent peer returned normally")
            continue
        if not (pg_timeout * 0.8 <= o["elapsed"] <= 10.0 + 2):
            probs.append(f"rank {r}: raised after {o['elapsed']:.1f}s (timeout {pg_timeout}s)")
        if IS_XCCL:
            m = check_message(o["msg"], TIMEOUT_WORDS)
        else:
            m = None if any(k in o["msg"].lower() for k in TIMEOUT_WORDS) else f"no timeout wording: {o['msg']!r}"
        if m:
            probs.append(f"rank {r}: {m}")
    assert not probs, "\n".join(probs)


@pytest.mark.parametrize(
    "warmup,heap",
    [(True, False), (False, False), pytest.param(True, True, marks=pytest.mark.skipif(IS_GLOO, reason="xccl_rs's heap"))],
    ids=["after_warmup", "first_op", "zero_copy"],
)
def test_dead_peer_raises_on_survivors(warmup, heap):
    pg_timeout = 6.0
    res = run_ranks(
        3, dead_peer_worker, 1, warmup, heap, timeout_s=120, pg_timeout_s=pg_timeout,
        expect_fail_ranks=[1],
    )
    probs = []
    for r in (0, 2):
        o = res.value(r)
        if not o["raised"]:
            probs.append(f"rank {r}: all_reduce with a dead peer returned normally")
            continue
        if o["elapsed"] > pg_timeout + 5:
            probs.append(f"rank {r}: raised only after {o['elapsed']:.1f}s (timeout {pg_timeout}s)")
        m = check_message(o["msg"])
        if m:
            probs.append(f"rank {r}: {m}")
    assert res.exitcodes.get(1) == 1, f"victim exit code {res.exitcodes.get(1)}"
    assert not probs, "\n".join(probs)


def w_invalid_setting(rank, world_size):
    import torch
    import torch.distributed as dist

    try:
        dist.init_process_group(harness.BACKEND, store=ctx().connect_store(), rank=rank, world_size=world_size,
                                timeout=ctx().timeout())
        dist.all_reduce(torch.ones(1))
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return None


@pytest.mark.skipif(IS_GLOO, reason="XCCL_RS_* settings concern xccl_rs")
def test_invalid_setting_fails_every_rank():
    """XCCL_RS_TRANSPORT=shm is not a transport: every rank's group creation fails, naming the
    variable and the allowed values (it used to mean `auto`, silently)."""
    res = run_ranks(2, w_invalid_setting, init="none", timeout_s=90, env={"XCCL_RS_TRANSPORT": "shm"})
    for r in range(2):
        msg = res.value(r)
        assert msg and "XCCL_RS_TRANSPORT" in msg and '"shm"' in msg and "`auto`, `tcp`" in msg, f"rank {r}: {msg}"


def w_meta_tensors(rank, world_size):
    """What a meta tensor does: torch's dispatcher answers dist.* calls on it (its meta kernels
    return without reaching a backend); the backend called directly refuses it."""
    import torch
    import torch.distributed as dist

    t = torch.ones(4, device="meta")
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    try:
        backend.allreduce([t]).wait()
    except (RuntimeError, ValueError) as e:
        return str(e)
    return None


def test_meta_tensors_never_reach_the_wire():
    res = run_ranks(2, w_meta_tensors)
    for r in range(2):
        msg = res.value(r)
        assert msg is not None, f"rank {r}: the backend accepted a meta tensor"
        if IS_XCCL:
            assert "meta device" in msg, msg
