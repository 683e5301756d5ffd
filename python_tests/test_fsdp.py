"""FSDP2 (fully_shard) on CPU with a tiny transformer-like model: default reduce ops (AVG /
PREMUL_SUM chosen by FSDP, i.e. set_force_sum_reduction_for_comms is NOT called) on the
backend under test, vs. the same training on gloo with set_force_sum_reduction_for_comms(True),
vs. a local un-sharded reference.
"""

from __future__ import annotations

import pytest

from harness import Checker, run_ranks, seed_of

VOCAB, DIM, SEQ, BATCH, STEPS, LR = 64, 32, 8, 4, 3, 0.1


def _build(seed):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(DIM)
            self.qkv = nn.Linear(DIM, 3 * DIM)
            self.proj = nn.Linear(DIM, DIM)
            self.ln2 = nn.LayerNorm(DIM)
            self.fc1 = nn.Linear(DIM, 2 * DIM)
            self.fc2 = nn.Linear(2 * DIM, DIM)

        def forward(self, x):
            b, s, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, 2, d // 2).unbind(2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, DIM)
            self.blocks = nn.ModuleList([Block(), Block()])
            self.head = nn.Linear(DIM, VOCAB, bias=False)

        def forward(self, tok):
            x = self.emb(tok)
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    torch.manual_seed(seed)
    return Tiny()


def _batch(rank, step):
    import torch

    g = torch.Generator().manual_seed(seed_of("fsdp", rank, step))
    tok = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tok[:, :-1], tok[:, 1:]


def _loss(model, rank, step):
    import torch.nn.functional as F

    x, y = _batch(rank, step)
    return F.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1))


def _train_fsdp(rank, group, mp_dtype, force_sum):
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _build(seed_of("fsdp-init"))
    mesh = DeviceMesh.from_group(group, "cpu")
    mp = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=mp_dtype) if mp_dtype else MixedPrecisionPolicy()
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if force_sum:
        for m in model.modules():
            if hasattr(m, "set_force_sum_reduction_for_comms"):
                m.set_force_sum_reduction_for_comms(True)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, rank, step).backward()
        opt.step()
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _train_reference(w):
    import torch

    model = _build(seed_of("fsdp-init"))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum(_loss(model, r, step) for r in range(w)) / w
        loss.backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def fsdp_worker(rank, w):
    import torch
    import torch.distributed as dist

    ck = Checker()
    gloo = dist.new_group(backend="gloo")
    world = dist.group.WORLD
    ref = _train_reference(w)
    for label, mp_dtype, tol in [("fp32", None, 1e-5), ("bf16", torch.bfloat16, 2e-2)]:
        runs = {}
        with ck.case(f"fsdp/{label}/backend_default_ops"):
            runs["backend"] = _train_fsdp(rank, world, mp_dtype, force_sum=False)
        with ck.case(f"fsdp/{label}/gloo_force_sum"):
            runs["gloo"] = _train_fsdp(rank, gloo, mp_dtype, force_sum=True)
        if len(runs) < 2:
            continue
        with ck.case(f"fsdp/{label}/backend_vs_gloo"):
            for n, p in runs["backend"].items():
                q = runs["gloo"][n]
                if not torch.allclose(p, q, rtol=tol, atol=tol):
                    ck.fail(f"{n}: max abs diff {(p - q).abs().max().item():.3g} (tol {tol})")
        with ck.case(f"fsdp/{label}/backend_vs_reference"):
            for n, p in runs["backend"].items():
                q = ref[n]
                if not torch.allclose(p, q, rtol=tol, atol=tol):
                    ck.fail(f"{n}: max abs diff {(p - q).abs().max().item():.3g} (tol {tol})")
            moved = max((runs["backend"][n] - _build(seed_of("fsdp-init")).state_dict()[n]).abs().max().item() for n in ref)
            ck.check(moved > 1e-4, f"parameters did not change during training (max change {moved})")
    return ck.summary()


@pytest.mark.parametrize("w", [2, 3], ids=lambda w: f"w{w}")
def test_fsdp2_matches_gloo_force_sum(w):
    res = run_ranks(w, fsdp_worker, timeout_s=240)
    for r in range(w):
        assert res.value(r)["cases"] >= 6
