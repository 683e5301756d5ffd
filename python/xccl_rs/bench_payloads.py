"""Weight-sync payloads side by side on real optimizer steps: ``python -m xccl_rs.bench_weight_sync --payloads``.

One trainer process trains a small decoder-only transformer (plain ``torch.nn``, no download:
token embedding, ``--layers`` pre-norm blocks of attention and MLP, a final norm, an untied
head), its parameters in bf16 (``--master bf16``, AdamW updating the bf16 weights) or fp32
master weights sent as bf16 (``--master fp32``, a mixed-precision trainer), AdamW at ``--lr``
(default 1e-6, an RL learning rate), on random tokens. After every step it syncs the weights to
``--rollouts`` rollout processes three times over one xccl_rs group, one sender object per payload:

* ``full``  -- every tensor in bf16;
* ``delta`` -- the elements changed since the previous step's delta sync (its first sync is full);
* ``fp8``   -- the 2-D weights as block-fp8 (128x128), the rest in bf16.

Each rollout checks the delta sync's tensors, bit for bit, against the full sync's of the same
step (received just before), and the fp8 sync's against the fp8 quantization of them. The report
gives, per payload, the sync time (the slowest rank's, from a barrier to its end; the median of
the steps after the first), the bytes sent, and for delta the changed fraction of the elements,
the bytes of the changed elements plus their int32 indices, and how the encoding compares; and
the fraction of blocks of 64, 256 and 4096 elements that hold a changed element (what a sender
keeping a hash per block, instead of a copy, would have to send).
"""

from __future__ import annotations

import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from xccl_rs._processes import free_port, join_all, messages

PAYLOADS = ("full", "delta", "fp8")
BLOCKS = (64, 256, 4096)


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(d)
        self.self_attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.post_attention_layernorm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.input_layernorm(x)
        x = x + self.self_attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        n = tokens.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf")), 1)
        x = self.embed_tokens(tokens)
        for block in self.layers:
            x = block(x, mask)
        return self.lm_head(self.norm(x))


def _step(model, opt, g, vocab: int, batch: int, seq: int) -> None:
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def _bf16_state(model) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach().to(torch.bfloat16, copy=True)) for n, p in model.named_parameters()]


def _changes(prev, cur) -> tuple[int, int, dict]:
    """Elements, changed elements (bitwise), and per block size the blocks with a change / all."""
    elements = changed = 0
    blocks = {b: [0, 0] for b in BLOCKS}
    for (_, a), (_, b) in zip(prev, cur):
        diff = a.reshape(-1).view(torch.int16) != b.reshape(-1).view(torch.int16)
        elements += diff.numel()
        changed += int(diff.count_nonzero())
        for size in BLOCKS:
            pad = (-diff.numel()) % size
            per = torch.nn.functional.pad(diff, (0, pad)).view(-1, size).any(1)
            blocks[size][0] += int(per.count_nonzero())
            blocks[size][1] += per.numel()
    return elements, changed, blocks


def _worker(proc: int, args, port: int, queue) -> None:
    import xccl_rs
    from xccl_rs.weight_sync import WeightReceiver, WeightSender
    from xccl_rs.weight_sync.fp8 import Fp8Rule

    torch.set_num_threads(args.threads)
    timeout = timedelta(seconds=args.timeout)
    world = 1 + args.rollouts
    store = dist.TCPStore("127.0.0.1", port, world + 1, False, timeout=timeout)
    pg = xccl_rs.new_group(dist.PrefixStore("payloads/", store), proc, world, timeout=timeout)
    bucket = args.bucket_mb << 20
    if proc == 0:
        torch.manual_seed(0)
        model = TinyLM(args.vocab, args.hidden, args.layers, args.heads)
        if args.master == "bf16":
            model = model.to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        g = torch.Generator().manual_seed(1)
        shared = None if args.shared_memory else False
        roles = {p: WeightSender(pg, bucket_bytes=bucket, payload=p, shared_memory=shared) for p in PAYLOADS}
        prev = _bf16_state(model)
        quantized = sum(t.numel() for n, t in prev if Fp8Rule().select(n, t))
        queue.put(("model", sum(t.numel() for _, t in prev), quantized))
        for _ in range(args.warmup):  # the optimizer's first steps move every weight alike
            _step(model, opt, g, args.vocab, args.batch, args.seq)
    else:
        roles = {p: WeightReceiver(pg) for p in PAYLOADS}
    rule = Fp8Rule()
    for step in range(args.steps + 1):
        if proc == 0:
            if step:
                _step(model, opt, g, args.vocab, args.batch, args.seq)
            cur = _bf16_state(model)
            if step:
                queue.put(("changes", step, *_changes(prev, cur)))
            prev = cur
        reference = None
        for payload in PAYLOADS:
            pg.barrier().wait()
            t0 = time.perf_counter()
            if proc == 0:
                st = roles[payload].send(cur)
                info = (st.bytes, st.tensor_bytes, st.changed, st.elements, st.full_ranges)
            else:
                got = {n: t.clone() for n, t in roles[payload].receive()}
                info = None
            seconds = time.perf_counter() - t0
            if proc:
                if payload == "full":
                    reference = got
                else:
                    expected = reference if payload == "delta" else dict(
                        kv for n, t in reference.items() for kv in rule.split(n, t))
                    bad = [n for n, t in expected.items()
                           if n not in got or not torch.equal(got[n].reshape(-1).view(torch.uint8),
                                                              t.reshape(-1).view(torch.uint8))]
                    if bad or len(got) != len(expected):
                        raise AssertionError(f"step {step}, {payload}: {len(bad)} tensors differ (first: {bad[:3]})")
            queue.put(("sync", step, payload, proc, seconds, info))
    if proc == 0:
        queue.put(("base", roles["delta"].delta_base_bytes))
    pg.barrier().wait()
    xccl_rs.destroy_group(pg)
    queue.put(("done", proc))


def run(args) -> int:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    world = 1 + args.rollouts
    launcher = dist.TCPStore("127.0.0.1", port, world + 1, True, timeout=timedelta(seconds=args.timeout),
                             wait_for_workers=False)
    procs = [ctx.Process(target=_worker, args=(i, args, port, queue)) for i in range(world)]
    for p in procs:
        p.start()
    syncs: dict[tuple[int, str], list] = {}
    changes: dict[int, tuple] = {}
    params = quantized = base_bytes = 0
    for msg in messages(procs, queue):
        if msg[0] == "model":
            params, quantized = msg[1], msg[2]
            print(f"payloads: 1 trainer -> {args.rollouts} rollouts, a {args.layers}-layer transformer of "
                  f"{params / 1e6:.1f}M parameters (d={args.hidden}, vocab {args.vocab}), {args.master} master "
                  f"weights sent as bf16 ({2 * params / 1e6:.1f} MB), AdamW lr {args.lr:g}, {args.warmup} warm-up "
                  f"steps, then {args.steps} measured, buckets of {args.bucket_mb} MiB, "
                  f"{'shared window' if args.shared_memory else 'buckets sent'}, "
                  f"torch {torch.__version__}; fp8 quantizes {quantized / params:.1%} of the parameters (the "
                  "2-D weights of the blocks; the embedding, the head and the norms stay bf16)", flush=True)
        elif msg[0] == "changes":
            changes[msg[1]] = msg[2:]
        elif msg[0] == "base":
            base_bytes = msg[1]
        elif msg[0] == "sync":
            _, step, payload, proc, seconds, info = msg
            syncs.setdefault((step, payload), []).append((proc, seconds, info))
    for p in procs:  # a trainer that ran autograd can take a while to exit on a loaded machine
        p.join(timeout=args.timeout)
    if not join_all(procs, "bench_payloads"):
        return 1
    del launcher
    later = range(2, args.steps + 1) if args.steps > 1 else range(1, args.steps + 1)

    def sender(step, payload):
        return next(info for proc, _, info in syncs[(step, payload)] if proc == 0)

    def seconds(step, payload):
        return max(s for _, s, _ in syncs[(step, payload)])

    print(f"\n{'payload':<8}{'median s':>10}{'vs full':>9}{'MB sent':>10}{'vs full':>9}   (steps {later.start}..{later.stop - 1})")
    full_t = statistics.median(seconds(s, "full") for s in later)
    full_b = statistics.median(sender(s, "full")[0] for s in later)
    for payload in PAYLOADS:
        t = statistics.median(seconds(s, payload) for s in later)
        b = statistics.median(sender(s, payload)[0] for s in later)
        print(f"{payload:<8}{t:>10.4f}{t / full_t:>8.2f}x{b / 1e6:>10.3f}{b / full_b:>8.3f}x")
    fp8_b = statistics.median(sender(s, "fp8")[0] for s in later)
    kept = 2 * (params - quantized)
    print(f"fp8 of the quantized weights alone: {(fp8_b - kept) / 1e6:.3f} MB for {2 * quantized / 1e6:.3f} MB of "
          f"bf16, {(fp8_b - kept) / (2 * quantized):.4f}x (values and scales)")
    print(f"\n{'step':>4}{'changed':>10}{'delta MB':>10}{'changed+idx MB':>16}{'ratio':>7}{'full ranges':>13}"
          + "".join(f"{'blocks/' + str(b):>13}" for b in BLOCKS))
    for step in range(1, args.steps + 1):
        elements, changed, blocks = changes[step]
        wire, _, _, _, full_ranges = sender(step, "delta")
        ideal = changed * (2 + 4)  # every changed element's bf16 value and an int32 index
        print(f"{step:>4}{changed / elements:>9.3%} {wire / 1e6:>9.3f}{ideal / 1e6:>16.3f}"
              f"{(wire / ideal if ideal else 0):>7.3f}{full_ranges:>13}"
              + "".join(f"{c / n:>12.1%} " for c, n in (blocks[b] for b in BLOCKS)))
    print(f"\nthe delta sender's copies: {base_bytes / 1e6:.1f} MB (the bf16 tensors it sent); every delta sync "
          "equal, bit for bit, to the full sync of its step on every rollout, every fp8 sync to its quantization")
    return 0


def add_arguments(p) -> None:
    g = p.add_argument_group("--payloads (bench_payloads.py)")
    g.add_argument("--payloads", action="store_true", help="compare the payloads full, delta and fp8 on real AdamW steps")
    g.add_argument("--master", choices=("bf16", "fp32"), default="bf16", help="the trainer's parameters")
    g.add_argument("--lr", type=float, default=1e-6, help="AdamW's learning rate")
    g.add_argument("--hidden", type=int, default=512, help="model width")
    g.add_argument("--heads", type=int, default=8, help="attention heads")
    g.add_argument("--vocab", type=int, default=8192, help="vocabulary")
    g.add_argument("--batch", type=int, default=4, help="sequences per step")
    g.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    g.add_argument("--warmup", type=int, default=2, help="optimizer steps before the first sync")
    g.add_argument("--steps", type=int, default=4, help="measured optimizer steps (each followed by the three syncs)")
    g.add_argument("--threads", type=int, default=1, help="torch threads per process")
