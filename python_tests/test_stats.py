"""Per-op statistics (src/stats.rs, xccl_rs.stats, XCCL_RS_STATS): a known sequence of ops, and
every field compared with what the test computes itself (sizes by nccl-tests' rule, sequence
numbers, bandwidths from the recorded times)."""

from __future__ import annotations

import json
import os

import pytest

from harness import IS_GLOO, run_ranks

pytestmark = pytest.mark.skipif(IS_GLOO, reason="xccl_rs's statistics")

# (op, bytes by nccl-tests' rule at 2 ranks, busbw factor at 2 ranks)
EXPECTED = [
    ("all_reduce", 4000, 1.0),              # 1000 float32, 2(n-1)/n
    ("all_reduce", 4000, 1.0),
    ("all_gather", 2 * 300 * 2, 0.5),       # 300 bfloat16 per rank gathered: the output; (n-1)/n
    ("reduce_scatter", 2 * 64 * 8, 0.5),    # 64 float64 per rank from an input of 2 x 64
    ("broadcast", 5 * 8, 1.0),              # 5 int64
]


def w_known_ops(rank, world_size):
    import torch
    import torch.distributed as dist

    import xccl_rs

    dist.all_reduce(torch.ones(1000))
    dist.all_reduce(torch.ones(1000), async_op=True).wait()
    dist.all_gather_into_tensor(torch.empty(600, dtype=torch.bfloat16), torch.ones(300, dtype=torch.bfloat16))
    dist.reduce_scatter_tensor(torch.empty(64, dtype=torch.float64), torch.ones(128, dtype=torch.float64))
    dist.broadcast(torch.zeros(5, dtype=torch.int64), src=0)
    return xccl_rs.stats()


def test_sums_and_lines_match_the_ops_that_ran(tmp_path):
    path = str(tmp_path / "stats_%p.jsonl")
    res = run_ranks(2, w_known_ops, env={"XCCL_RS_STATS": path})
    for rank in range(2):
        s = res.value(rank)
        assert s["ops"] == 5, s
        assert s["bytes"] == sum(b for _, b, _ in EXPECTED), s
        assert s["by_op"]["all_reduce"]["ops"] == 2 and s["by_op"]["all_reduce"]["bytes"] == 8000, s
        assert s["by_op"]["all_gather"]["bytes"] == 1200, s
        assert set(s["by_path"]) == {"AllReduceShm", "AllGatherShm", "ReduceScatterShm", "BroadcastShm"}, s
        assert s["seconds"] > 0 and abs(s["seconds"] - sum(r["seconds"] for r in s["rows"])) < 1e-9
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 2 and all(f.startswith("stats_") and f.endswith(".jsonl") for f in files), files
    ranks_seen = set()
    for f in files:
        lines = [json.loads(line) for line in open(tmp_path / f)]
        assert len(lines) == len(EXPECTED), lines
        ranks_seen.add(lines[0]["rank"])
        for seq, (line, (op, nbytes, factor)) in enumerate(zip(lines, EXPECTED)):
            assert (line["op"], line["bytes"], line["seq"], line["fabric"]) == (op, nbytes, seq, "host"), line
            assert line["group"] == "0", line
            algbw = nbytes / (line["duration_us"] * 1e-6) / 1e9
            assert line["algbw_gbps"] == pytest.approx(algbw, rel=1e-3, abs=1e-6), line
            assert line["busbw_gbps"] == pytest.approx(algbw * factor, rel=1e-3, abs=1e-6), line
        starts = [line["start_us"] for line in lines]
        assert starts == sorted(starts), starts
    assert ranks_seen == {0, 1}
