"""Every kind of error the Rust core returns to a C++ call reaches Python as that kind's
exception, with the text the user reads whole: the kind crosses the bridge inside the error
(src/bridge_error.rs writes it, csrc/errors.cc's raise_core_error reads and strips it).
InvalidArgument raises ValueError; Timeout, Remote and Communication raise DistBackendError.
One process; the two ranks a peer's failure needs are threads of it.
"""

from __future__ import annotations

import pytest

from harness import IS_XCCL, run_ranks


def _raised(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the exception is the result
        return f"{type(e).__name__}: {e}"
    return "nothing raised"


def w_error_kinds(rank, world_size):
    import datetime
    import os
    import threading
    import time

    import torch
    import torch.distributed as dist

    import xccl_rs
    from xccl_rs import _C

    cpu = torch.device("cpu")
    out = {}

    os.environ["XCCL_RS_FAILURE_HOOKS_WAIT_MS"] = "abc"
    out["InvalidArgument"] = _raised(_C.wait_for_failure_hooks)
    del os.environ["XCCL_RS_FAILURE_HOOKS_WAIT_MS"]

    # Rank 1 never comes.
    short = datetime.timedelta(seconds=1)
    out["Timeout"] = _raised(lambda: xccl_rs.new_group(dist.HashStore(), 0, 2, timeout=short))

    alone = xccl_rs.new_group(dist.HashStore(), 0, 1, timeout=datetime.timedelta(seconds=30))
    alone._get_backend(cpu).abort()
    out["Communication"] = _raised(lambda: alone.allreduce([torch.ones(3)]))

    # Rank 1 aborts while rank 0 waits for it: rank 0's group failed because of a peer.
    store, pair = dist.HashStore(), [None, None]

    def join(r):
        pair[r] = xccl_rs.new_group(store, r, 2, timeout=datetime.timedelta(seconds=30))

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    waiting = pair[0].allreduce([torch.ones(3)])
    time.sleep(0.2)
    pair[1]._get_backend(cpu).abort()
    _raised(waiting.wait)
    out["Remote"] = _raised(lambda: pair[0].allreduce([torch.ones(3)]))
    out["Remote get_error"] = str(pair[0]._get_backend(cpu).get_error())
    return out


@pytest.mark.skipif(not IS_XCCL, reason="the errors are xccl_rs's")
def test_each_error_kind_raises_its_exception():
    got = run_ranks(1, w_error_kinds, init="none", timeout_s=120).value(0)
    want = {
        "InvalidArgument": 'ValueError: xccl_rs: XCCL_RS_FAILURE_HOOKS_WAIT_MS="abc" is not valid',
        "Timeout": "DistBackendError: xccl_rs: rank 0 ",
        "Communication": "DistBackendError: xccl_rs: rank 0: allreduce: this group failed earlier",
        "Remote": "DistBackendError: xccl_rs: rank 0: allreduce: this group failed earlier",
    }
    problems = [f"{kind}: {got[kind]!r} should start with {start!r}" for kind, start in want.items() if not got[kind].startswith(start)]
    # The prefix once, and nothing of the kind's encoding left in the text.
    problems += [f"{kind}: {got[kind]!r}" for kind in want if got[kind].count("xccl_rs:") != 1 or "\x1f" in got[kind]]
    if "timed out" not in got["Timeout"]:
        problems.append(f"Timeout: {got['Timeout']!r}")
    if "rank 1 failed and aborted the group" not in got["Remote"]:
        problems.append(f"Remote: {got['Remote']!r} should quote the peer's failure")
    if got["Remote get_error"] != "ErrorType.REMOTE_ERROR":
        problems.append(f"Remote: get_error() is {got['Remote get_error']}")
    assert not problems, "\n".join(problems)
