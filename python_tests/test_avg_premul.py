"""AVG and PREMUL_SUM: all_reduce, reduce, reduce_scatter_tensor, all_reduce_coalesced,
sync / wait() / get_future(), scalar and tensor factors, fp32/fp64/fp16/bf16 (and integer
AVG), at world sizes 2 and 3 (3 so that 1/3 is inexact)."""

from __future__ import annotations

import warnings

import pytest

import harness
from harness import IS_GLOO, Checker, run_ranks

WORLD_SIZES = [2, 3]
COLLS = ["all_reduce", "reduce", "reduce_scatter_tensor", "all_reduce_coalesced"]


def _variants(dtype):
    """(op, factor) pairs for a dtype."""
    from refs import FLOATS

    out = [("AVG", None)]
    if dtype in FLOATS:
        out += [
            ("PREMUL_SUM", 0.25),
            ("PREMUL_SUM", 1 / 3),
            ("PREMUL_SUM", -2.5),
            ("PREMUL_SUM_T", 0.5),
            ("PREMUL_SUM_T", 1 / 3),
        ]
    return out


def _check_future_value(ck, work, outputs):
    """get_future().value() must be a list of tensors equal to the outputs."""
    import torch

    if IS_GLOO and not isinstance(work, torch._C.Future):
        try:
            work.get_future()
        except RuntimeError:
            ck.skip("gloo: Work.get_future() not implemented for some ops")
            return
    fut = work if isinstance(work, torch._C.Future) else work.get_future()
    val = fut.value()
    if not ck.check(isinstance(val, list), f"future value is {type(val).__name__}, not a list"):
        return
    if not ck.check(len(val) == len(outputs), f"future value has {len(val)} tensors, expected {len(outputs)}"):
        return
    for j, (v, o) in enumerate(zip(val, outputs)):
        ck.equal(v, o, f"future value[{j}] vs output")


def avg_premul_sweep(rank, w):
    import torch
    import torch.distributed as dist

    from refs import BF16, F16, F32, F64, dname, garbage, gen, large_numel, make_op, reduce_ref
    from xcoll import reduce_and_check, reduce_issue

    ck = Checker()
    me = rank
    dtypes = [F32, BF16, F16, F64, torch.int32, torch.int64, torch.int8, torch.uint8]
    i = 0
    for coll in COLLS:
        for dtype in dtypes:
            for op, factor in _variants(dtype):
                sizes = [1, 1001, large_numel(dtype)]
                for n in sizes:
                    modes = ["sync", "wait", "future"] if n == 1001 else [["sync", "wait", "future"][i % 3]]
                    for mode in modes:
                        i += 1
                        fs = "" if factor is None else f"({factor:.4g})"
                        case = f"{coll}/{dname(dtype)}/{op}{fs}/n{n}/{mode}"
                        with ck.case(case):
                            redop, f = make_op(op, dtype, factor)
                            if coll == "all_reduce":
                                xs = [gen(dtype, n, case, r) for r in range(w)]
                                t = xs[me].clone()
                                holder = {}

                                def call(ro, a):
                                    holder["w"] = dist.all_reduce(t, op=ro, async_op=a)
                                    return holder["w"]

                                st = reduce_issue(ck, mode, op, dtype, redop, f, call, [t], w)
                                if st == "skipped":
                                    continue
                                reduce_ref(xs, op, f).check(ck, t)
                                if mode == "future" and st == "run":
                                    _check_future_value(ck, holder["w"], [t])
                            elif coll == "reduce":
                                root = i % w
                                xs = [gen(dtype, n, case, r) for r in range(w)]
                                reduce_and_check(ck, mode, op, dtype, redop, f, xs, me, root, w, f"root {root} output")
                            elif coll == "reduce_scatter_tensor":
                                m = n if n < 4096 else n // w
                                inp = torch.cat([gen(dtype, m, case, me, c) for c in range(w)])
                                out = garbage(dtype, m, case, me)
                                holder = {}

                                def call(ro, a):
                                    holder["w"] = dist.reduce_scatter_tensor(out, inp, op=ro, async_op=a)
                                    return holder["w"]

                                st = reduce_issue(ck, mode, op, dtype, redop, f, call, [out], w)
                                if st == "skipped":
                                    continue
                                xs = [gen(dtype, m, case, r, me) for r in range(w)]
                                reduce_ref(xs, op, f).check(ck, out)
                                if mode == "future" and st == "run":
                                    _check_future_value(ck, holder["w"], [out])
                            else:
                                shapes = [n, 3, 1]
                                xs = [[gen(dtype, s, case, r, j) for r in range(w)] for j, s in enumerate(shapes)]
                                ts = [x[me].clone() for x in xs]
                                holder = {}

                                def call(ro, a):
                                    with warnings.catch_warnings():
                                        warnings.simplefilter("ignore", FutureWarning)
                                        holder["w"] = dist.all_reduce_coalesced(ts, op=ro, async_op=a)
                                    return holder["w"]

                                st = reduce_issue(ck, mode, op, dtype, redop, f, call, ts, w)
                                if st == "skipped":
                                    continue
                                for j, t in enumerate(ts):
                                    reduce_ref(xs[j], op, f).check(ck, t, f"tensor {j}")
                                if mode != "sync" and st == "run":
                                    _check_future_value(ck, holder["w"], ts)
    # The same PREMUL_SUM op object used repeatedly and on several collectives.
    case = "all_reduce/reuse_premul_op"
    with ck.case(case):
        redop, f = make_op("PREMUL_SUM", F32, 0.75)
        for k in range(3):
            xs = [gen(F32, 17, case, k, r) for r in range(w)]
            t = xs[me].clone()
            reduce_issue(ck, "sync", "PREMUL_SUM", F32, redop, f,
                         lambda ro, a: dist.all_reduce(t, op=ro, async_op=a), [t], w)
            reduce_ref(xs, "PREMUL_SUM", f).check(ck, t, f"iteration {k}")
    return ck.summary()


@pytest.mark.parametrize("w", WORLD_SIZES, ids=lambda w: f"w{w}")
def test_avg_premul(w):
    res = run_ranks(w, avg_premul_sweep, timeout_s=300)
    for r in range(w):
        assert res.value(r)["cases"] > 100
    if harness.IS_GLOO:
        print("\n" + "; ".join(res.notes))
