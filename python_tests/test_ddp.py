"""DistributedDataParallel on the backend under test vs. the same training on gloo vs. a
local (non-distributed) reference that averages the per-rank gradients with plain torch.

One spawn per world size: the default group is the backend under test, a second group is
dist.new_group(backend="gloo").
"""

from __future__ import annotations

import pytest

from harness import Checker, run_ranks, seed_of

STEPS = 5
LR = 0.1
IN, HID, OUT, BATCH = 16, 32, 4, 8


def _model(seed):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HID), torch.nn.ReLU(), torch.nn.Linear(HID, HID), torch.nn.ReLU(),
        torch.nn.Linear(HID, OUT),
    )


def _batch(rank, step):
    import torch

    g = torch.Generator().manual_seed(seed_of("ddp", rank, step))
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def _train_ddp(rank, group, **ddp_kwargs):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    # Different initial weights per rank: DDP must broadcast rank 0's.
    model = DDP(_model(seed_of("init", rank)), process_group=group, **ddp_kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = _batch(rank, step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.module.parameters()]


def _train_reference(w):
    import torch

    model = _model(seed_of("init", 0))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        grads = None
        for r in range(w):
            model.zero_grad()
            x, y = _batch(r, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            g = [p.grad.clone() for p in model.parameters()]
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        for p, g in zip(model.parameters(), grads):
            p.grad = g / w
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def ddp_worker(rank, w):
    import torch
    import torch.distributed as dist

    ck = Checker()
    gloo = dist.new_group(backend="gloo")
    ref = _train_reference(w)
    runs = {}
    configs = {
        "default": {},
        "small_buckets_grad_view": {"bucket_cap_mb": 0.001, "gradient_as_bucket_view": True},
    }
    for name, kw in configs.items():
        with ck.case(f"ddp/backend/{name}"):
            runs[name] = _train_ddp(rank, None, **kw)
    with ck.case("ddp/gloo"):
        runs["gloo"] = _train_ddp(rank, gloo)
    for name, params in runs.items():
        with ck.case(f"ddp/compare/{name}_vs_reference"):
            for i, (p, q) in enumerate(zip(params, ref)):
                if not torch.allclose(p, q, rtol=1e-5, atol=1e-6):
                    ck.fail(f"param {i}: max abs diff {(p - q).abs().max().item():.3g} vs local reference")
    for name in configs:
        with ck.case(f"ddp/compare/{name}_vs_gloo"):
            if name in runs and "gloo" in runs:
                for i, (p, q) in enumerate(zip(runs[name], runs["gloo"])):
                    if not torch.allclose(p, q, rtol=1e-5, atol=1e-6):
                        ck.fail(f"param {i}: max abs diff {(p - q).abs().max().item():.3g} vs gloo DDP")
    out = ck.summary()
    out["params"] = runs.get("default")
    return out


@pytest.mark.parametrize("w", [2, 3], ids=lambda w: f"w{w}")
def test_ddp_matches_gloo_and_reference(w):
    import torch

    res = run_ranks(w, ddp_worker, timeout_s=180)
    # identical parameters on every rank
    p0 = res.value(0)["params"]
    for r in range(1, w):
        pr = res.value(r)["params"]
        for i, (a, b) in enumerate(zip(p0, pr)):
            assert torch.equal(a, b), f"param {i} differs between rank 0 and rank {r}"
