"""The main demo: python -m xccl_rs.demo. RL weight sync, as verl's disaggregated GRPO does it.

Four local processes play two roles:

* trainers (processes 0 and 1) have a default world of their own (xccl_rs) and, every round,
  AVG all_reduce a loss, as verl's engine workers do, then "train" (every weight moves);
* rollouts (processes 2 and 3) only serve: they receive the fresh weights.

Every round, trainer 0 builds a private group with the two rollouts (xccl_rs.new_group over a
PrefixStore("sync/<round>/", TCPStore(port=0)), the master's real port published to the others),
pushes a state dict shaped like Qwen2.5-0.5B (its real layer names and shapes, random values)
with xccl_rs.weight_sync.WeightSender, and destroys the group (verl's rebuild_group). Trainer 1
is not in the sync group and allocates nothing for it. Each rollout loads the tensors into its
"engine" (parameters allocated once, as an inference engine's are) as they arrive, then checks
every one, bit for bit, against the weights it computes itself (zeroing the engine before each
sync, so a tensor that did not arrive cannot pass).

With --device cuda (or xpu) the weights and the engine live on the device, and so do the
buckets (--bucket-device device, the default): the backend stages every bucket through pinned
host memory in its broadcasts, in chunks that overlap the copies each way. --bucket-device cpu
keeps the buckets on the host instead, in the shared window, which every process registers with
the device runtime, so that the trainer's copies into it and each rollout's copies out of it are
DMA (docs/usage.md compares the two).

The same sync then runs over gloo (a ProcessGroupGloo on the same kind of store) in the same
run, and the demo prints the time and speed of each sync in GB and GB/s (10^9 bytes, as its
progress bar) and xccl_rs's speed-up. After every sync, its copy floor: the same copies alone
with the same tensors (copy_floor.py; on a device, through a pinned host bucket).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from xccl_rs import copy_floor
from xccl_rs._processes import free_port, join_all, messages
from xccl_rs.weight_sync._common import synchronize

TRAINERS, ROLLOUTS = 2, 2
SYNC_SIZE = 1 + ROLLOUTS  # trainer 0 + the rollouts
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

# Qwen2.5-0.5B (config.json of Qwen/Qwen2.5-0.5B): tied embeddings, so no lm_head.weight.
HIDDEN, INTERMEDIATE, LAYERS, VOCAB, KV_DIM = 896, 4864, 24, 151936, 128


def qwen25_05b_shapes(layers: int = LAYERS) -> list[tuple[str, tuple[int, ...]]]:
    """The parameter names and shapes of Qwen2.5-0.5B's state dict, in its order."""
    shapes = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
            (p + "self_attn.q_proj.bias", (HIDDEN,)),
            (p + "self_attn.k_proj.weight", (KV_DIM, HIDDEN)),
            (p + "self_attn.k_proj.bias", (KV_DIM,)),
            (p + "self_attn.v_proj.weight", (KV_DIM, HIDDEN)),
            (p + "self_attn.v_proj.bias", (KV_DIM,)),
            (p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
            (p + "mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN)),
            (p + "mlp.up_proj.weight", (INTERMEDIATE, HIDDEN)),
            (p + "mlp.down_proj.weight", (HIDDEN, INTERMEDIATE)),
            (p + "input_layernorm.weight", (HIDDEN,)),
            (p + "post_attention_layernorm.weight", (HIDDEN,)),
        ]
    shapes.append(("model.norm.weight", (HIDDEN,)))
    return shapes


def initial_weights(layers: int, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """Random weights, the same on every process (seeded by name)."""
    out = {}
    for name, shape in qwen25_05b_shapes(layers):
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        out[name] = (torch.randn(shape, generator=g) * 0.02).to(dtype).to(device)
    return out


def train_step(weights: dict[str, torch.Tensor], round_: int) -> None:
    """What a trainer's optimizer step does to the weights here: every value moves, the same way
    on every process (the rollouts replay it to know what they must receive)."""
    for t in weights.values():
        t.mul_(0.99).add_(0.001 * (round_ + 1))


def _same_bits(ref: torch.Tensor, got: torch.Tensor) -> bool:
    return (
        ref.dtype == got.dtype
        and ref.shape == got.shape
        and torch.equal(ref.reshape(-1).view(torch.uint8), got.reshape(-1).view(torch.uint8))
    )


def _rss_mark() -> int | None:
    """Resets this process's peak resident memory and returns the current one, in bytes (Linux;
    None elsewhere): with :func:`_rss_peak` after the sync, the sync's extra memory."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return _status_kb("VmRSS") * 1024
    except OSError:
        return None


def _rss_peak() -> int | None:
    try:
        return _status_kb("VmHWM") * 1024
    except OSError:
        return None


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status")


def device_floor(pg, sending, receiving, bucket_bytes: int, device: torch.device) -> tuple[str, float]:
    """copy_floor.measure for device tensors: the same copies, through a pinned host bucket (what
    a registered window is), each queued without waiting and timed to the last one's end -- the
    trainer's copy of its tensors to the host, then every rollout's copy of them back to the
    device, all rollouts at once (one link: the floor of a sync between ranks of one device)."""
    bucket = torch.empty(bucket_bytes, dtype=torch.uint8, pin_memory=True)

    def copies(tensors, to_host: bool) -> float:
        at = 0
        synchronize(device)
        t0 = time.perf_counter()
        for t in tensors:
            flat = t.detach().reshape(-1).view(torch.uint8)
            done = 0
            while done < flat.numel():
                n = min(flat.numel() - done, bucket_bytes - at)
                if to_host:
                    bucket[at:at + n].copy_(flat[done:done + n], non_blocking=True)
                else:
                    flat[done:done + n].copy_(bucket[at:at + n], non_blocking=True)
                done, at = done + n, (at + n) % bucket_bytes
        synchronize(device)
        return time.perf_counter() - t0

    pg.barrier().wait()
    seconds = copies(sending, True) if sending is not None else 0.0
    pg.barrier().wait()
    if receiving is not None:
        seconds = copies(receiving, False)
    pg.barrier().wait()
    return ("send" if sending is not None else "load"), seconds


def _sync_group(kind: str, round_: int, sync_rank: int, launcher: dist.Store, timeout: timedelta):
    """The private sync group of one round: trainer 0 is its master (TCPStore on port 0, real port
    published through the launcher's store); nothing touches the trainers' default world."""
    key = f"{kind}/{round_}/port"
    if sync_rank == 0:
        master = dist.TCPStore("127.0.0.1", 0, SYNC_SIZE, True, timeout=timeout, wait_for_workers=False)
        launcher.set(key, str(master.port))
    else:
        launcher.wait([key], timeout)
        master = dist.TCPStore("127.0.0.1", int(launcher.get(key)), SYNC_SIZE, False, timeout=timeout)
    store = dist.PrefixStore(f"sync/{round_}/", master)
    if kind == "xccl_rs":
        import xccl_rs

        return xccl_rs.new_group(store, sync_rank, SYNC_SIZE, timeout=timeout), master
    return dist.ProcessGroupGloo(store, sync_rank, SYNC_SIZE, timeout), master


def _destroy(kind: str, pg) -> None:
    if kind == "xccl_rs":
        import xccl_rs

        xccl_rs.destroy_group(pg)


def _worker(proc: int, args, launcher_port: int, queue) -> None:
    import xccl_rs  # noqa: F401  (registers the backend)
    from xccl_rs.weight_sync import WeightReceiver, WeightSender

    torch.set_num_threads(1)
    timeout = timedelta(seconds=args.timeout)
    launcher = dist.TCPStore("127.0.0.1", launcher_port, TRAINERS + ROLLOUTS + 1, False, timeout=timeout)
    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    # Where the buckets live: on the host (the window, registered for the device), or on it.
    bucket_device = device if args.bucket_device == "device" else torch.device("cpu")
    is_trainer = proc < TRAINERS
    if is_trainer:
        world = dist.PrefixStore("trainers/", launcher)
        dist.init_process_group("xccl_rs", store=world, rank=proc, world_size=TRAINERS, timeout=timeout)
    sync_rank = 0 if proc == 0 else (proc - TRAINERS + 1 if not is_trainer else -1)
    # Trainer 1 takes no part in the sync: it holds its shard of the model, nothing for the sync.
    weights = initial_weights(args.layers, dtype, device) if sync_rank >= 0 else None
    # A rollout's inference engine: its parameters exist before any sync, and a sync loads
    # into them (as vLLM's load_weights does), so it keeps no copy of the received tensors.
    engine = {n: torch.zeros_like(t) for n, t in weights.items()} if sync_rank > 0 else None
    kinds = ["xccl_rs"] + ([] if args.no_gloo else ["gloo"])
    for round_ in range(args.rounds):
        if is_trainer:
            loss = torch.tensor([float(proc + 1) * (round_ + 1)], device=device)
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # native AVG: no monkeypatch
            expected = sum(range(1, TRAINERS + 1)) / TRAINERS * (round_ + 1)
            if loss.item() != expected:
                raise AssertionError(f"trainer {proc}: AVG all_reduce gave {loss.item()}, expected {expected}")
        if weights is not None:
            train_step(weights, round_)
        # Alternate which backend goes first: the first sync of a process also pays its
        # warm-up (first touch of the received tensors' memory).
        for kind in kinds if round_ % 2 == 0 else kinds[::-1]:
            if sync_rank < 0:
                continue
            pg, _master = _sync_group(kind, round_, sync_rank, launcher, timeout)  # _master: keeps the store up
            bucket = args.bucket_mb << 20
            if engine is not None:
                for t in engine.values():
                    t.zero_()  # a tensor that does not arrive cannot pass the check
            pg.barrier().wait()  # time the sync alone, not who arrived last
            mark = _rss_mark() if device.type == "cpu" else None
            if sync_rank == 0:
                stats = WeightSender(pg, src=0, bucket_bytes=bucket, device=bucket_device).send(
                    weights, progress=args.progress and kind == "xccl_rs"
                )
                queue.put(("sync", kind, round_, stats.bytes, stats.seconds))
            else:
                receiver = WeightReceiver(pg, src=0, bucket_bytes=bucket, device=device, bucket_device=bucket_device)
                # Load every tensor into the engine as it arrives (views of the receive bucket:
                # no copy besides the load), verify after the sync.
                names = []
                for name, t in receiver.receive(copy=False):
                    if name not in engine or engine[name].shape != t.shape or engine[name].dtype != t.dtype:
                        raise AssertionError(f"rollout {proc - TRAINERS} ({kind}): unexpected tensor {name!r}")
                    engine[name].copy_(t)
                    names.append(name)
                bad = [name for name in weights if not _same_bits(weights[name], engine[name])]
                n = len(names)
                if bad or n != len(weights) or len(set(names)) != n:
                    raise AssertionError(
                        f"rollout {proc - TRAINERS} ({kind}, round {round_}): {len(bad)} of {len(weights)} tensors "
                        f"differ (first: {bad[:3]}), {n} received"
                    )
                queue.put(("verified", kind, round_, proc, n))
            peak = _rss_peak() if mark is not None else None
            if peak is not None and kind == "xccl_rs" and round_ > 0:
                queue.put(("memory", proc, peak - mark))
            # the same copies alone, with the same tensors
            sending = weights.values() if sync_rank == 0 else None
            receiving = engine.values() if engine is not None else None
            if device.type == "cpu":
                part = copy_floor.measure(pg, sending, receiving, bucket)
            else:
                part = device_floor(pg, sending, receiving, bucket, device)
            queue.put(("floor", kind, round_, part))
            pg.barrier().wait()  # every rollout has verified before the group goes
            _destroy(kind, pg)
            del pg
    if is_trainer:
        dist.destroy_process_group()
    queue.put(("done", proc))


def sync_line(round_: int, kind: str, nbytes: int, seconds: float, floor: float | None = None) -> str:
    """One sync's line, in the units of its progress bar (decimal GB and GB/s), with its copy
    floor where it was measured."""
    line = f"round {round_}  {kind:<8} sync {nbytes / 1e9:.2f} GB in {seconds:.3f} s  ({nbytes / seconds / 1e9:.2f} GB/s)"
    if floor:
        line += f", copy floor {floor:.3f} s ({seconds / floor:.2f}x)"
    return line


def _report(args, rows, floors, verified) -> None:
    print()
    print(f"{'sync':<10}{'median':>10}{'first':>10}{'GB/s':>9}{'x floor':>9}   verified")
    med = {}
    for kind, syncs in rows.items():
        if not syncs:
            continue
        secs = [s for _, s in syncs]
        nbytes = syncs[0][0]
        later = slice(1, None) if len(secs) > 1 else slice(None)
        med[kind] = statistics.median(secs[later])
        ratios = [s / floors[(kind, r)] for r, s in enumerate(secs) if floors.get((kind, r))][later]
        shown = f"{statistics.median(ratios):>8.2f}x" if ratios else f"{'-':>9}"
        print(
            f"{kind:<10}{med[kind]:>9.3f}s{secs[0]:>9.3f}s{nbytes / med[kind] / 1e9:>9.2f}{shown}   "
            f"{verified.get(kind, 0)} tensors on {ROLLOUTS} rollouts x {len(syncs)} rounds"
        )
    if floors:
        where = "a bucket" if args.device == "cpu" else "a pinned host bucket"
        print("x floor: the sync's time over its copy floor, the same copies alone with the same tensors in the "
              f"same run (the sender's into {where}, then every rollout's out of one, all at once), medians after "
              "the first round")
    if "gloo" in med and "xccl_rs" in med:
        print(f"xccl_rs is {med['gloo'] / med['xccl_rs']:.2f}x faster than gloo (medians of the rounds after the first)")


def main(argv=None) -> int:
    from xccl_rs.bench import HelpFormatter

    p = argparse.ArgumentParser(prog="python -m xccl_rs.demo", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="the weights' dtype")
    p.add_argument("--rounds", type=int, default=4, help="syncs per backend (the first pays the warm-up)")
    p.add_argument("--layers", type=int, default=LAYERS, help="decoder layers (Qwen2.5-0.5B has 24)")
    p.add_argument("--bucket-mb", type=int, default=256, metavar="MIB", help="bucket size, MiB")
    p.add_argument("--device", default="cpu", help="where the weights live: cpu, cuda or xpu")
    p.add_argument("--bucket-device", choices=["cpu", "device"], default="device",
                   help="where the buckets live with device weights: device (staged through the host by the backend) "
                        "or cpu (the shared window, registered with the device runtime)")
    p.add_argument("--no-gloo", action="store_true", help="skip the gloo comparison")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar (it needs tqdm)")
    p.add_argument("--timeout", type=float, default=300.0, help="group timeout, seconds")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dtype = DTYPES[args.dtype]
    numel = sum(torch.Size(s).numel() for _, s in qwen25_05b_shapes(args.layers))
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    print(
        f"xccl_rs demo: {TRAINERS} trainers + {ROLLOUTS} rollouts on {args.device}, torch {torch.__version__}\n"
        f"model: Qwen2.5-0.5B layout, {args.layers} layers, {numel / 1e6:.1f}M parameters, {args.dtype}, "
        f"{nbytes / 1e9:.2f} GB per sync, buckets of {args.bucket_mb} MiB"
        f"{'' if args.device == 'cpu' else ' on the ' + ('device' if args.bucket_device == 'device' else 'host')}"
        f", {args.rounds} rounds "
        f"(private group rebuilt every round)",
        flush=True,
    )
    t0 = time.perf_counter()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    launcher = dist.TCPStore(
        "127.0.0.1", port, TRAINERS + ROLLOUTS + 1, True, timeout=timedelta(seconds=args.timeout), wait_for_workers=False
    )
    procs = [ctx.Process(target=_worker, args=(i, args, port, queue)) for i in range(TRAINERS + ROLLOUTS)]
    for proc in procs:
        proc.start()
    rows = {"xccl_rs": [], "gloo": []}
    floors: dict[tuple[str, int], float] = {}  # (kind, round) -> the copy floor of that sync
    parts: dict[tuple[str, int], list] = {}
    pending: dict[tuple[str, int], tuple[int, float]] = {}  # syncs waiting for their floor
    verified: dict[str, int] = {}
    extra: dict[int, int] = {}  # process -> the most extra host memory one of its syncs took
    for msg in messages(procs, queue):
        if msg[0] == "sync":
            _, kind, round_, b, sec = msg
            rows[kind].append((b, sec))
            pending[(kind, round_)] = (b, sec)
        elif msg[0] == "floor":
            _, kind, round_, part = msg
            got = parts.setdefault((kind, round_), [])
            got.append(part)
            if len(got) == SYNC_SIZE:
                floors[(kind, round_)] = copy_floor.floor_of(got)
        elif msg[0] == "verified":
            verified[msg[1]] = verified.get(msg[1], 0) + msg[4]
        elif msg[0] == "memory":
            extra[msg[1]] = max(extra.get(msg[1], 0), msg[2])
        for key in [k for k in pending if k in floors]:  # a sync's line once its floor is in
            b, sec = pending.pop(key)
            print(sync_line(key[1], key[0], b, sec, floors[key]), flush=True)
    if not join_all(procs, "demo"):
        return 1
    del launcher
    _report(args, rows, floors, verified)
    if extra:
        shown = ", ".join(
            f"{'trainer 0' if p == 0 else f'rollout {p - TRAINERS}'} {b / 2**20:.0f} MiB" for p, b in sorted(extra.items())
        )
        print(f"peak extra host memory of an xccl_rs sync (after the first): {shown} (2 buckets: {2 * args.bucket_mb} MiB)")
    print(f"all received tensors verified bit for bit; total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
