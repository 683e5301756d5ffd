"""Helpers used inside the worker processes to issue collectives in the three
completion modes and (gloo validation only) to emulate what gloo lacks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness import IS_GLOO
from refs import F64, gloo_emulable, gloo_gap, reduce_ref


def issue(ck, mode: str, call):
    """call(async_op: bool) issues one collective; complete it according to mode.

    sync:   call(False) must return None (blocking)
    wait:   call(True).wait()
    future: call(True).get_future().wait()
    (all_reduce_coalesced(async_op=True) returns a torch.futures.Future itself.)
    """
    if mode == "sync":
        ret = call(False)
        ck.check(ret is None, f"sync call returned {type(ret).__name__}, expected None")
        return None
    work = call(True)
    if not ck.check(work is not None, "async_op=True returned None instead of a Work"):
        return None
    if isinstance(work, torch._C.Future):
        work.wait()
        ck.check(work.done(), "Future.done() is False after Future.wait()")
        return work
    if mode == "wait":
        r = work.wait()
        ck.check(r is True or r is None, f"Work.wait() returned {r!r}")
        if not work.is_completed():
            if IS_GLOO:
                ck.skip("gloo: Work.is_completed() stays False for some ops")
            else:
                ck.fail("Work.is_completed() is False after wait()")
    elif mode == "future":
        wait_future(ck, work)
    else:
        raise ValueError(mode)
    return work


def complete(ck, work, mode: str) -> None:
    """Complete an already issued Work (p2p) by wait() or get_future().wait()."""
    if mode == "future":
        wait_future(ck, work)
    else:
        work.wait()


def wait_future(ck, work) -> None:
    """work.get_future().wait(), checking the future is done; gloo lacks futures for some ops
    (then work.wait(), and the check is skipped)."""
    try:
        fut = work.get_future()
    except RuntimeError as e:
        if IS_GLOO and "not implemented" in str(e):
            ck.skip("gloo: Work.get_future() not implemented for some ops (used wait())")
            work.wait()
            return
        raise
    fut.wait()
    ck.check(fut.done(), "Future.done() is False after Future.wait()")


def emulated_post(t: torch.Tensor, op: str, factor, w: int) -> None:
    """gloo validation only: turn an all-reduced SUM into AVG (ints) / PREMUL_SUM."""
    if op == "AVG":
        t.copy_(torch.div(t.to(torch.int64), w, rounding_mode="trunc").to(t.dtype))
    else:
        t.copy_((t.to(F64) * factor).to(t.dtype))


def reduce_issue(ck, mode, op, dtype, redop, factor, call, outputs, w) -> str:
    """Issue a reduction collective call(redop, async_op).

    Returns "run", "emulated" (gloo: SUM + local post-processing of outputs) or
    "skipped" (gloo cannot do it at all). Never emulates or skips for xccl_rs.
    """
    if IS_GLOO:
        gap = gloo_gap(dtype, op)
        if gap is not None:
            if gloo_emulable(dtype, op):
                call(dist.ReduceOp.SUM, False)
                for t in outputs:
                    emulated_post(t, op, factor, w)
                ck.skip(f"gloo: {gap}")
                return "emulated"
            ck.skip(f"gloo: {gap}")
            return "skipped"
    issue(ck, mode, lambda a: call(redop, a))
    return "run"


def gloo_skip(ck, dtype=None, op=None) -> bool:
    """True (and count the skip) when gloo cannot run this case; False for xccl_rs."""
    if not IS_GLOO:
        return False
    gap = gloo_gap(dtype, op)
    if gap is None:
        return False
    ck.skip(f"gloo: {gap}")
    return True


def reduce_and_check(ck, mode, op, dtype, redop, factor, xs, me, root, w, what="root output") -> None:
    """``dist.reduce`` of ``xs[me]`` (a copy) to ``root``, checked: the reduction of ``xs`` on the
    root; elsewhere the buffer untouched, as NCCL leaves it (gloo uses it as scratch)."""
    t = xs[me].clone()
    st = reduce_issue(
        ck, mode, op, dtype, redop, factor,
        lambda ro, a: dist.reduce(t, dst=root, op=ro, async_op=a),
        [t] if me == root else [], w,
    )
    if st == "skipped":
        return
    if me == root:
        reduce_ref(xs, op, factor).check(ck, t, what)
    elif not IS_GLOO:
        ck.equal(t, xs[me], "non-root tensor changed by reduce")
