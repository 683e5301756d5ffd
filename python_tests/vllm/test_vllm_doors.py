"""The vLLM door (xccl_rs.vllm_engine) in every combination a user can configure: mode x payload x
transport, through vLLM's own classes (python_tests/test_doors.py has the other doors).

* mode: one sender (``senders="rank0"``: trainer rank 0 sends, rank 1 only runs the source's
  gathers), several senders (``senders="all"``: the full tensors of ``iter_full()`` shared out),
  sharded (``senders="all", sharded=True``: each trainer's FSDP2 shards from ``iter_local()``,
  as they are) and node (``senders="node"``, trainer rank 1 reporting another node's address:
  rank 0 sends, rank 1 runs the source and waits for rank 0's word on the round);
* payload: ``full``; ``delta`` and ``fp8`` where the weight sync has payloads;
* transport: the shared window (the default on one host) or sent (``shared_memory=False``).

Two trainer processes (a gloo default group, the transformers Qwen2 ``fully_shard``-ed over it)
and two single-worker replicas. Each combination runs two rounds: every parameter new, then 5 %
of the elements changed (what a delta payload is for). After each round every worker's
parameters are compared bit for bit with torch's ``full_tensor()`` of the trainers' parameters
after sharding and fusing; with ``fp8``, layer 1's ``down_proj`` is selected, and the workers
(whose model holds that layer in fp8 with a per-tensor ``weight_scale``) must hold what torch's
own quantization of the trainer's weight gives.

Run by scripts/test_vllm.sh (a venv with vLLM); elsewhere not collected (conftest.py).
"""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("vllm")
pytest.importorskip("vllm.distributed.weight_transfer")

import torch  # noqa: E402

import _vllm_harness as H  # noqa: E402

TIMEOUT_S = 30.0
N = 2  # trainer ranks
WORKERS = 2  # single-worker replicas
BUCKET = 8 << 10
SHAPE = dict(vocab=257, hidden=64, inter=129)
MODES = {"one": dict(senders="rank0"), "several": dict(senders="all"), "sharded": dict(senders="all", sharded=True),
         "node": dict(senders="node", node={1: "192.0.2.1"})}  # trainer rank 1 on another node (TEST-NET-1)
PAYLOADS = ("full", "delta", "fp8")
TRANSPORTS = ("window", "sent")
FP8_NAME = "model.layers.1.mlp.down_proj.weight"  # what the fp8 payload is told to quantize


def payloads_available() -> tuple[str, ...]:
    from xccl_rs.weight_sync import WeightSender

    return PAYLOADS if "payload" in inspect.signature(WeightSender).parameters else ("full",)


def fp8_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's per-tensor fp8 quantization (vLLM's recipe): the weight as float8_e4m3fn, its scale."""
    amax = w.float().abs().amax().clamp(min=1e-4)
    return (w.float() * (448.0 / amax)).to(torch.float8_e4m3fn), (amax / 448.0).float()


def expected(cfg: H.Cfg, ref: dict, payload: str) -> dict:
    """The workers' parameters after a round of ``ref`` (torch's full tensors of the trainers')."""
    if payload == "fp8":
        ref = dict(ref)
        ref[FP8_NAME], ref[FP8_NAME + "_scale"] = fp8_per_tensor(ref[FP8_NAME])
    return H.expected_params(cfg, ref, 1, 0)


@pytest.fixture(scope="module")
def clusters(ctx, tmp_path_factory):
    """The trainers and workers, made once per worker model (fp8 workers hold layer 1's
    ``down_proj`` in fp8), and reused by every combination."""
    made = {}

    def get(fp8: bool):
        if fp8 not in made:
            client = H.PipeClient([])
            for r in range(WORKERS):
                client.replicas.append(H.start_workers(ctx, H.Cfg(dtype="bfloat16", fp8=fp8, **SHAPE), r, 1, WORKERS))
            path = str(tmp_path_factory.mktemp("doors") / "store")
            made[fp8] = (client, H.Trainers(ctx, H.Cfg(dtype="bfloat16", **SHAPE), N, client, path, shard=True))
        return made[fp8]

    yield get
    for client, trainers in made.values():
        trainers.close()
        H.stop_workers(client.workers)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("mode", list(MODES))
def test_vllm_door(clusters, mode, payload, transport):
    if payload not in payloads_available():
        pytest.skip(f"payload {payload!r}: this weight sync sends the tensors as they are")
    client, trainers = clusters(payload == "fp8")
    options = dict(MODES[mode], num_trainer_ranks=N, bucket_bytes=BUCKET, timeout_s=TIMEOUT_S, payload=payload,
                   shared_memory=None if transport == "window" else False)
    if payload == "fp8":
        options.update(fp8_scale="tensor", fp8_select=FP8_NAME.replace(".", r"\.") + "$")
    trainers.all("init", N + WORKERS, options)
    worker_cfg = H.Cfg(dtype="bfloat16", fp8=payload == "fp8", **SHAPE)
    try:
        for step, (seed, changed) in enumerate(((1, 1.0), (2, 0.05))):
            res = trainers.all("send", seed, "source", changed, errors=True)
            bad = [f"trainer {r}: {o}" for r, o in enumerate(res) if not isinstance(o, dict) or "error" in o]
            assert not bad, "\n".join(bad)
            ref = trainers.all("reference")[0]
            for w in client.workers:
                problems = H.compare(w.call("params"), expected(worker_cfg, ref, payload))
                assert not problems, f"step {step}, {w}: " + "; ".join(problems)
            senders = [0] if mode in ("one", "node") else list(range(N))
            assert [res[r]["shared"] for r in senders] == [transport == "window"] * len(senders), res
            assert all(res[r]["bytes"] > 0 for r in senders), res
            if mode in ("one", "node"):
                assert res[1]["bytes"] == 0 and res[1]["allocated"] == [], res
            if payload == "full":
                assert sum(o["bytes"] for o in res) == sum(t.numel() * t.element_size() for t in ref.values()), res
            assert [o["generation"] for o in res if o["allocated"]] == [1] * len(senders), res  # the group is kept
    finally:
        trainers.all("shutdown")
