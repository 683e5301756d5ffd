"""The copy floor that the demo and bench_weight_sync print beside each sync (copy_floor.py):
its copies move exactly the bytes a sync moves (checked against torch's own byte views), a
sender's share stops at its byte count, and the floor is the slowest sender plus the slowest
rollout."""

import torch

from xccl_rs import copy_floor
from xccl_rs.demo import sync_line


def test_rollout_copy_fills_every_engine_tensor_from_the_bucket_in_turn():
    bucket = torch.arange(10, dtype=torch.uint8)
    engine = [torch.zeros(7, dtype=torch.uint8), torch.zeros(4, dtype=torch.bfloat16)]  # 7 + 8 bytes
    assert copy_floor.rollout_copy(engine, bucket) >= 0
    want = torch.arange(15, dtype=torch.int64).remainder(10).to(torch.uint8)
    got = torch.cat([t.reshape(-1).view(torch.uint8) for t in engine])
    assert torch.equal(got, want), got


def test_sender_copy_packs_the_tensors_bytes_and_stops_at_its_share():
    tensors = [torch.arange(6, dtype=torch.uint8) + 1, torch.full((3,), 9, dtype=torch.uint8)]
    bucket = torch.zeros(16, dtype=torch.uint8)
    copy_floor.sender_copy(tensors, bucket)
    assert bucket[:9].tolist() == [1, 2, 3, 4, 5, 6, 9, 9, 9] and bucket[9:].eq(0).all()
    bucket.zero_()
    copy_floor.sender_copy(tensors, bucket, limit=4)
    assert bucket[:4].tolist() == [1, 2, 3, 4] and bucket[4:].eq(0).all()
    small = torch.zeros(4, dtype=torch.uint8)  # wraps around a bucket smaller than the tensors
    copy_floor.sender_copy(tensors, small)
    assert small.tolist() == [9, 6, 9, 9]


def test_the_floor_is_the_slowest_sender_plus_the_slowest_rollout():
    parts = [("send", 0.10), ("send", 0.12), ("load", 0.20), ("load", 0.25)]
    assert abs(copy_floor.floor_of(parts) - 0.37) < 1e-12
    line = sync_line(1, "xccl_rs", 990_000_000, 0.5, copy_floor.floor_of(parts))
    assert line.endswith("copy floor 0.370 s (1.35x)"), line
