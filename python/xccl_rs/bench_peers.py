"""The benchmark's peers and bounds: DeepSpeed's CPU shared-memory all-reduce, and the memory
bound of the machine (``python -m xccl_rs.bench --peer deepspeed --memory-bound``).

DeepSpeed (``--peer deepspeed``, when ``import deepspeed`` works): its shm op
(``csrc/cpu/comm/shm.cpp``, JIT-built by its ``ShareMemCommBuilder``) is SUM-only, one group per
process, and starts its shared-memory path only when ``LOCAL_SIZE`` equals the world size; its
segments are named after ``MASTER_ADDR``/``MASTER_PORT`` and never unlinked by it. We build it
once in the parent (so that a compiler error shows before any rank starts), then each rank
loads the cached build, calls ``initialize(world, rank)`` and times the raw op
``torch.ops.deepspeed.inference_all_reduce_`` (no DeepSpeed Python wrapper in the timed loop),
in place, as the in-place all_reduce of the bench's table; every rank unlinks its own segment
once all have mapped every segment. Its results are checked as every backend's are (the bench's
#wrong column: one call on the seeded inputs after the timed ones, against the reference).

Memory bound (``--memory-bound``): every rank copies a buffer of the op's size into another at
the same time, with as many threads as an xccl_rs rank uses for its copies (``copier_threads``:
``XCCL_RS_THREADS``, or the cores divided by the ranks, at most 8), so that the copy bandwidth
per rank, B, is what this machine gives that many concurrent copiers at that size. A collective's bus bandwidth
(nccl-tests' formulas, see bench.py) can at best equal B: the bound is ``time = S * factor / B``.
"""

from __future__ import annotations

import glob
import os
import time

import torch
import torch.distributed as dist

DS_SHM_PREFIX = "deepspeed_allreduce_buffer"  # shm.cpp's SHM_BUFFER_NAME
DS_DTYPES = ("float32", "bfloat16", "float16")


def deepspeed_available() -> str | None:
    """None if DeepSpeed can be imported here, else why not."""
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # an install without its deps raises more than ImportError
        return f"{type(e).__name__}: {e}"
    return None


def _ds_env(rank: int, world: int, port: int) -> None:
    os.environ.update({
        "DS_ACCELERATOR": "cpu",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "LOCAL_SIZE": str(world),
        "LOCAL_RANK": str(rank),
    })


def build_deepspeed_op():
    """Builds (or loads the cached) shm op; returns (module, None) or (None, why)."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        import deepspeed.ops
        from deepspeed.accelerator import get_accelerator
        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is None:
            return None, "DeepSpeed's CPU accelerator has no ShareMemCommBuilder"
        if not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
            return None, f"DeepSpeed says {builder.NAME} is not compatible here"
        return builder.load(verbose=False), None
    except Exception as e:
        return None, f"{type(e).__name__}: {str(e)[-400:]}"


class DeepSpeedPeer:
    """DeepSpeed's shm all-reduce on this rank (all ranks construct it together)."""

    def __init__(self, rank: int, world: int, port: int, control):
        _ds_env(rank, world, port)
        self.port = port
        self.module, why = build_deepspeed_op()
        if self.module is None:
            raise RuntimeError(f"DeepSpeed's shm op did not load: {why}")
        self.module.initialize(world, rank)
        # bf16/fp16 need avx512bw (level 2), fp32 avx2 (level 1); below that it faults
        self.level = int(self.module.vector_kernel_level())
        dist.barrier(group=control)  # every rank has mapped every segment: unlink ours
        for path in glob.glob(f"/dev/shm/{DS_SHM_PREFIX}_{os.getuid()}_127.0.0.1_{port}_{rank}"):
            os.unlink(path)

    def supports(self, op: str, dtype_name: str) -> str | None:
        """None if the peer runs this op and dtype, else why not."""
        if op != "all_reduce":
            return "DeepSpeed's shm op is a SUM all-reduce only"
        if dtype_name not in DS_DTYPES:
            return f"no {dtype_name} kernel"
        if self.level < (1 if dtype_name == "float32" else 2):
            return f"vector kernel level {self.level} is too low for {dtype_name}"
        return None

    def all_reduce_(self, t: torch.Tensor) -> None:
        """The raw op, in place, on this rank's tensor (SUM over the ranks)."""
        torch.ops.deepspeed.inference_all_reduce_(t)


def copier_threads(local_ranks: int) -> int:
    """The threads an xccl_rs rank uses for large copies (config.rs, `threads_for`)."""
    explicit = int(os.environ.get("XCCL_RS_THREADS", "0") or 0)
    if explicit > 0:
        return explicit
    return max(1, min(8, len(os.sched_getaffinity(0)) // max(1, local_ranks)))


def copy_bandwidth(nbytes: int, iters: int, control, threads: int = 1, reps: int = 3) -> float:
    """Bytes per second one rank copies, with `threads` threads, while every rank copies
    `nbytes` at once: the slowest rank's mean over `iters` copies, the best of `reps` such loops
    (a bound is the best the machine did, and a shared host's neighbours only ever slow it
    down)."""
    nbytes = max(nbytes, 64)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    ranks_threads = torch.get_num_threads()
    torch.set_num_threads(threads)  # torch's copy_ splits large copies over its threads
    try:
        for _ in range(max(1, iters // 10)):
            dst.copy_(src)
        best = float("inf")
        for _ in range(reps):
            dist.barrier(group=control)
            t0 = time.perf_counter()
            for _ in range(iters):
                dst.copy_(src)
            elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=control)
            best = min(best, elapsed.item())
    finally:
        torch.set_num_threads(ranks_threads)
    return nbytes / best
