"""torch.profiler sees xccl_rs's ops as it sees gloo's and NCCL's (docs/debugging.md): a
`record_param_comms` event per call with the collective's name, element counts, dtype, the
group's name, ranks and size and the sequence number, an `xccl_rs:<op>` range from the call
to the completion with the op's tensor shapes, and an `xccl_rs:<op>:run` range for the time the
op ran, on the thread that ran it (the progress thread for an async op). Checked the way users look: a DDP step and a
subgroup's collectives profiled, the Chrome trace exported and read back."""

from __future__ import annotations

import json

import pytest

from harness import IS_GLOO, run_ranks

pytestmark = pytest.mark.skipif(IS_GLOO, reason="xccl_rs's own profiler records")


def w_profiled_step(rank, world_size, trace_dir):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(10, 7))  # one gradient bucket of 77 floats
    sub = dist.new_group([0, 2])
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        model(torch.randn(4, 10)).sum().backward()
        if rank in (0, 2):
            dist.all_gather_into_tensor(torch.empty(6, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16), group=sub)
            dist.broadcast(torch.zeros(5, dtype=torch.int64), src=2, group=sub)
    path = f"{trace_dir}/trace_{rank}.json"
    prof.export_chrome_trace(path)
    return path


def comms(events, name):
    return [e for e in events if e.get("name") == name]


def test_a_ddp_step_and_a_subgroup_appear_in_the_exported_trace(tmp_path):
    res = run_ranks(3, w_profiled_step, str(tmp_path))
    for rank in range(3):
        with open(res.value(rank)) as f:
            events = json.load(f)["traceEvents"]
        params = comms(events, "record_param_comms")
        grads = [e["args"] for e in params if e["args"].get("Collective name") == "allreduce"]
        assert len(grads) == 1, params
        g = grads[0]
        assert (g["In msg nelems"], g["Out msg nelems"], g["dtype"]) == (77, 77, "Float"), g
        assert (g["Group size"], g["Process Group Ranks"], g["Rank"]) == (3, "[0, 1, 2]", rank), g
        ranges = comms(events, "xccl_rs:all_reduce")
        assert len(ranges) == 1 and ranges[0]["args"]["Input Dims"] == [[77]], ranges
        assert ranges[0]["dur"] > 0
        # DDP's all-reduce is async: it ran on the progress thread, within the call's range
        # (the run's times are whole microseconds, and it ends just after the call's range).
        runs = comms(events, "xccl_rs:all_reduce:run")
        assert len(runs) == 1, runs
        run, call = runs[0], ranges[0]
        assert run["tid"] != call["tid"], (run, call)
        assert call["ts"] - 1 <= run["ts"] and run["ts"] + run["dur"] <= call["ts"] + call["dur"] + 5000, (run, call)
        if rank == 1:
            assert len(params) == 1, "rank 1 is not in the subgroup"
            continue
        gathers = [e["args"] for e in params if e["args"].get("Collective name") == "all_gather_into_tensor"]
        assert len(gathers) == 1, params
        a = gathers[0]
        assert (a["In msg nelems"], a["Out msg nelems"], a["dtype"]) == (3, 6, "BFloat16"), a
        assert (a["Group size"], a["Process Group Ranks"], a["Rank"]) == (2, "[0, 2]", rank // 2), a
        bcasts = [e["args"] for e in params if e["args"].get("Collective name") == "broadcast"]
        assert len(bcasts) == 1 and bcasts[0]["In msg nelems"] == 5 and bcasts[0]["dtype"] == "Long", params
        assert bcasts[0]["Seq"] == a["Seq"] + 1, (a, bcasts)
        assert len(comms(events, "xccl_rs:all_gather")) == 1 and len(comms(events, "xccl_rs:broadcast")) == 1
        assert len(comms(events, "xccl_rs:all_gather:run")) == 1 and len(comms(events, "xccl_rs:broadcast:run")) == 1
