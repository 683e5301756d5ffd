"""Every collective x dtype x reduce op x size x completion mode, against references
computed locally from every rank's (deterministically generated) inputs.

One spawn per world size runs the whole sweep; each (theme, world size) test reports
the failing cases of its theme (plus any crash/hang of the run).
"""

from __future__ import annotations

import time

import pytest

import harness
from harness import IS_GLOO, Checker, ctx, run_ranks

WORLD_SIZES = [1, 2, 3, 4]

THEMES = [
    "all_reduce",
    "all_reduce_complex",
    "all_reduce_coalesced",
    "coalescing_manager",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "p2p",
    "barrier",
]


# --------------------------------------------------------------------------------------
# worker side
# --------------------------------------------------------------------------------------


class Sweep:
    def __init__(self, rank, w):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.rank, self.w = rank, w
        self.ck = Checker()
        self.i = 0  # running case counter, identical on every rank

    def mode(self):
        from refs import MODES

        self.i += 1
        return MODES[self.i % len(MODES)]

    def rot(self, k=1):
        """A rotating root, identical on every rank."""
        self.i += 1
        return (self.i * k) % self.w

    # ---------------------------------------------------------------- reductions
    def reduction_cases(self):
        from refs import DTYPES, OPS, SIZES, valid_op

        for dtype in DTYPES:
            for op in OPS:
                if not valid_op(op, dtype):
                    continue
                for size in SIZES:
                    yield dtype, op, size

    def theme_all_reduce(self):
        from refs import dname, gen, input_kind, make_op, numel_of, reduce_ref
        from xcoll import reduce_issue

        torch, dist, ck, w, me = self.torch, self.dist, self.ck, self.w, self.rank
        for dtype, op, size in self.reduction_cases():
            n = numel_of(size, dtype)
            for mode in ["sync", "wait", "future"] if size in (1, 1001) else [self.mode()]:
                case = f"all_reduce/{dname(dtype)}/{op}/n{n}/{mode}"
                with ck.case(case):
                    kind = input_kind(op)
                    xs = [gen(dtype, n, case, r, kind=kind) for r in range(w)]
                    redop, f = make_op(op, dtype)
                    t = xs[me].clone()
                    st = reduce_issue(
                        ck, mode, op, dtype, redop, f,
                        lambda ro, a: dist.all_reduce(t, op=ro, async_op=a), [t], w,
                    )
                    if st != "skipped":
                        reduce_ref(xs, op, f).check(ck, t)

    def theme_all_reduce_complex(self):
        from refs import SIZES, gen, numel_of, reduce_ref
        from xcoll import issue

        torch, dist, ck, w, me = self.torch, self.dist, self.ck, self.w, self.rank
        dtype = torch.complex64
        for op in ["SUM", "AVG"]:
            for size in SIZES:
                n = numel_of(size, torch.float32)
                for mode in ["sync", "wait", "future"]:
                    case = f"all_reduce_complex/complex64/{op}/n{n}/{mode}"
                    with ck.case(case):
                        xs = [gen(dtype, n, case, r) for r in range(w)]
                        t = xs[me].clone()
                        redop = getattr(dist.ReduceOp, op)
                        issue(ck, mode, lambda a: dist.all_reduce(t, op=redop, async_op=a))
                        reduce_ref(xs, op).check(ck, t)

    def theme_reduce(self):
        from refs import dname, gen, input_kind, make_op, numel_of
        from xcoll import reduce_and_check

        ck, w, me = self.ck, self.w, self.rank
        for dtype, op, size in self.reduction_cases():
            n = numel_of(size, dtype)
            roots = range(w) if size == 1001 else [self.rot()]
            for root in roots:
                mode = self.mode()
                case = f"reduce/{dname(dtype)}/{op}/n{n}/root{root}/{mode}"
                with ck.case(case):
                    kind = input_kind(op)
                    xs = [gen(dtype, n, case, r, kind=kind) for r in range(w)]
                    redop, f = make_op(op, dtype)
                    reduce_and_check(ck, mode, op, dtype, redop, f, xs, me, root, w)

    def theme_reduce_scatter(self):
        self._reduce_scatter(tensor_api=False)

    def theme_reduce_scatter_tensor(self):
        self._reduce_scatter(tensor_api=True)

    def _reduce_scatter(self, tensor_api):
        from refs import dname, garbage, gen, input_kind, make_op, numel_of, reduce_ref
        from xcoll import reduce_issue

        torch, dist, ck, w, me = self.torch, self.dist, self.ck, self.w, self.rank
        name = "reduce_scatter_tensor" if tensor_api else "reduce_scatter"
        for dtype, op, size in self.reduction_cases():
            n = numel_of(size, dtype)
            if size == "large":
                n = n // w + (1 - (n // w) % 2)  # per-rank chunk; whole input ~1 MiB
            mode = self.mode()
            case = f"{name}/{dname(dtype)}/{op}/n{n}/{mode}"
            with ck.case(case):
                kind = input_kind(op)
                chunks = [gen(dtype, n, case, me, c, kind=kind) for c in range(w)]
                redop, f = make_op(op, dtype)
                out = garbage(dtype, n, case, me)
                if tensor_api:
                    inp = torch.cat(chunks)

                    def call(ro, a):
                        return dist.reduce_scatter_tensor(out, inp, op=ro, async_op=a)
                else:
                    inp_list = [c.clone() for c in chunks]

                    def call(ro, a):
                        return dist.reduce_scatter(out, inp_list, op=ro, async_op=a)

                st = reduce_issue(ck, mode, op, dtype, redop, f, call, [out], w)
                if st == "skipped":
                    continue
                xs = [gen(dtype, n, case, r, me, kind=kind) for r in range(w)]
                reduce_ref(xs, op, f).check(ck, out)
                if tensor_api:
                    ck.equal(inp, torch.cat(chunks), "input changed")

    def theme_all_reduce_coalesced(self):
        import warnings

        from refs import DTYPES, OPS, dname, gen, input_kind, make_op, reduce_ref, valid_op
        from xcoll import reduce_issue

        dist, ck, w, me = self.dist, self.ck, self.w, self.rank
        for dtype in DTYPES:
            for op in OPS:
                if not valid_op(op, dtype):
                    continue
                for lead in [1001, "large"]:
                    from refs import numel_of

                    shapes = [numel_of(lead, dtype), 1, 0, 7]
                    mode = self.mode()
                    case = f"all_reduce_coalesced/{dname(dtype)}/{op}/n{shapes}/{mode}"
                    with ck.case(case):
                        kind = input_kind(op)
                        xs = [
                            [gen(dtype, n, case, r, j, kind=kind) for r in range(w)]
                            for j, n in enumerate(shapes)
                        ]
                        ts = [x[me].clone() for x in xs]
                        redop, f = make_op(op, dtype)

                        def call(ro, a):
                            with warnings.catch_warnings():
                                warnings.simplefilter("ignore", FutureWarning)
                                return dist.all_reduce_coalesced(ts, op=ro, async_op=a)

                        st = reduce_issue(ck, mode, op, dtype, redop, f, call, ts, w)
                        if st == "skipped":
                            continue
                        for j, t in enumerate(ts):
                            reduce_ref(xs[j], op, f).check(ck, t, f"tensor {j}")

    def theme_coalescing_manager(self):
        from refs import F32, BF16, dname, gen, make_op, reduce_ref

        torch, dist, ck, w, me = self.torch, self.dist, self.ck, self.w, self.rank
        combos = [
            (F32, "SUM"), (F32, "AVG"), (F32, "MAX"), (F32, "PREMUL_SUM"),
            (BF16, "SUM"), (BF16, "AVG"), (torch.int64, "SUM"), (torch.int32, "MIN"),
            (torch.float64, "PRODUCT"),
        ]
        for dtype, op in combos:
            for async_ops in [False, True]:
                for n in [1001, 65537]:
                    base = f"coalescing_manager/{dname(dtype)}/{op}/n{n}/async_ops={async_ops}"
                    redop, f = make_op(op, dtype)
                    skip = IS_GLOO and op.startswith("PREMUL")
                    kind = "prod" if op == "PRODUCT" else "full"
                    # all_reduce x3
                    case = base + "/all_reduce"
                    with ck.case(case):
                        if skip:
                            ck.skip("gloo: no PREMUL_SUM")
                        else:
                            shapes = [n, 7, 1]
                            xs = [[gen(dtype, s, case, r, j, kind=kind) for r in range(w)]
                                  for j, s in enumerate(shapes)]
                            ts = [x[me].clone() for x in xs]
                            with dist._coalescing_manager(async_ops=async_ops) as cm:
                                for t in ts:
                                    dist.all_reduce(t, op=redop)
                            if async_ops:
                                cm.wait()
                            for j, t in enumerate(ts):
                                reduce_ref(xs[j], op, f).check(ck, t, f"tensor {j}")
                    # all_gather_into_tensor x2 (op irrelevant: only once per dtype)
                    if op in ("SUM", "MIN"):
                        case = base + "/all_gather_into_tensor"
                        with ck.case(case):
                            # stacked [w, 3] second output (gloo only takes [w*n])
                            outs = [torch.empty(w * n, dtype=dtype), torch.empty(w, 3, dtype=dtype)]
                            if IS_GLOO:
                                outs[1] = outs[1].view(-1)
                            ins = [gen(dtype, n, case, me, 0), gen(dtype, 3, case, me, 1)]
                            with dist._coalescing_manager(async_ops=async_ops) as cm:
                                dist.all_gather_into_tensor(outs[0], ins[0])
                                dist.all_gather_into_tensor(outs[1], ins[1])
                            if async_ops:
                                cm.wait()
                            ck.equal(outs[0], torch.cat([gen(dtype, n, case, r, 0) for r in range(w)]), "out 0")
                            ref1 = torch.stack([gen(dtype, 3, case, r, 1) for r in range(w)])
                            ck.equal(outs[1], ref1.view(outs[1].shape), "out 1")
                    # reduce_scatter_tensor x2
                    case = base + "/reduce_scatter_tensor"
                    with ck.case(case):
                        if skip:
                            ck.skip("gloo: no PREMUL_SUM")
                        else:
                            m = max(1, n // w)
                            chunks = [[gen(dtype, m, case, me, j, c, kind=kind) for c in range(w)] for j in range(2)]
                            outs = [torch.empty(m, dtype=dtype) for _ in range(2)]
                            with dist._coalescing_manager(async_ops=async_ops) as cm:
                                for j in range(2):
                                    dist.reduce_scatter_tensor(outs[j], torch.cat(chunks[j]), op=redop)
                            if async_ops:
                                cm.wait()
                            for j in range(2):
                                xs = [gen(dtype, m, case, r, j, me, kind=kind) for r in range(w)]
                                reduce_ref(xs, op, f).check(ck, outs[j], f"out {j}")

    # ---------------------------------------------------------------- data movement
    def movement_cases(self):
        from refs import MOVE_DTYPES, SIZES

        for dtype in MOVE_DTYPES:
            for size in SIZES:
                yield dtype, size

    def roots(self, *every_root_at):
        """The roots of a rooted collective's cases at one size: every rank at the sizes
        ``every_root_at``, else one rotating root."""

        def at(size):
            roots = range(self.w) if size in every_root_at else [self.rot()]
            return [(f"root{root}", root) for root in roots]

        return at

    def movement_sweep(self, name, run, variants=lambda size: [(None, None)], per_rank_large=False):
        """Runs ``run(dtype, n, case, mode, variant)`` in its case for each dtype x size of
        :meth:`movement_cases` and each ``(label, variant)`` of ``variants(size)`` (the label goes
        into the case's name), once the cases gloo cannot run are counted as skips.
        ``per_rank_large``: the large size is split among the ranks."""
        from refs import dname, numel_of
        from xcoll import gloo_skip

        for dtype, size in self.movement_cases():
            n = numel_of(size, dtype)
            if per_rank_large and size == "large":
                n //= self.w
            for label, variant in variants(size):
                mode = self.mode()
                case = "/".join([name, dname(dtype), f"n{n}"] + ([label] if label else []) + [mode])
                with self.ck.case(case):
                    if gloo_skip(self.ck, dtype):
                        continue
                    run(dtype, n, case, mode, variant)

    def theme_broadcast(self):
        from refs import garbage, gen
        from xcoll import issue

        dist, ck, me = self.dist, self.ck, self.rank

        def run(dtype, n, case, mode, root):
            src = gen(dtype, n, case, root)
            t = src.clone() if me == root else garbage(dtype, n, case, me)
            issue(ck, mode, lambda a: dist.broadcast(t, src=root, async_op=a))
            ck.equal(t, src)

        self.movement_sweep("broadcast", run, self.roots(1, 1001))

    def theme_gather(self):
        from refs import garbage, gen
        from xcoll import issue

        dist, ck, w, me = self.dist, self.ck, self.w, self.rank

        def run(dtype, n, case, mode, root):
            x = gen(dtype, n, case, me)
            inp = x.clone()
            outs = [garbage(dtype, n, case, me, r) for r in range(w)] if me == root else None
            issue(ck, mode, lambda a: dist.gather(inp, outs, dst=root, async_op=a))
            if me == root:
                for r in range(w):
                    ck.equal(outs[r], gen(dtype, n, case, r), f"gather_list[{r}]")
            ck.equal(inp, x, "input changed")

        self.movement_sweep("gather", run, self.roots(1001))

    def theme_scatter(self):
        from refs import garbage, gen
        from xcoll import issue

        dist, ck, w, me = self.dist, self.ck, self.w, self.rank

        def run(dtype, n, case, mode, root):
            ins = [gen(dtype, n, case, root, p) for p in range(w)] if me == root else None
            out = garbage(dtype, n, case, me)
            issue(ck, mode, lambda a: dist.scatter(out, ins, src=root, async_op=a))
            ck.equal(out, gen(dtype, n, case, root, me))

        self.movement_sweep("scatter", run, self.roots(1001))

    def theme_all_gather(self):
        from refs import garbage, gen
        from xcoll import issue

        dist, ck, w, me = self.dist, self.ck, self.w, self.rank

        def run(dtype, n, case, mode, _):
            x = gen(dtype, n, case, me)
            outs = [garbage(dtype, n, case, me, r) for r in range(w)]
            issue(ck, mode, lambda a: dist.all_gather(outs, x, async_op=a))
            for r in range(w):
                ck.equal(outs[r], gen(dtype, n, case, r), f"tensor_list[{r}]")

        self.movement_sweep("all_gather", run)

    def theme_all_gather_into_tensor(self):
        from refs import garbage, gen
        from xcoll import issue

        torch, dist, ck, w, me = self.torch, self.dist, self.ck, self.w, self.rank

        def run(dtype, n, case, mode, shape):
            if IS_GLOO and shape == "stacked":
                ck.skip("gloo: all_gather_into_tensor needs a [w*n] output")
                return
            x = gen(dtype, n, case, me)
            out = garbage(dtype, w * n, case, me)
            if shape == "stacked":
                out = out.view(w, n)
            issue(ck, mode, lambda a: dist.all_gather_into_tensor(out, x, async_op=a))
            ref = [gen(dtype, n, case, r) for r in range(w)]
            ck.equal(out, torch.stack(ref) if shape == "stacked" else torch.cat(ref))

        self.movement_sweep("all_gather_into_tensor", run, lambda size: [(s, s) for s in ("concat", "stacked")])

    @staticmethod
    def split(base: int, src: int, dst: int) -> int:
        """Unequal per-peer sizes, some of them zero."""
        if (src * 3 + dst) % 4 == 1:
            return 0
        return base + src + 2 * dst

    def theme_all_to_all(self):
        from refs import garbage, gen
        from xcoll import issue

        dist, ck, w, me = self.dist, self.ck, self.w, self.rank

        def run(dtype, base, case, mode, unequal):
            if IS_GLOO and unequal:
                ck.skip("gloo: all_to_all (list) needs equal sizes")
                return

            def sz(src, dst):
                return self.split(base, src, dst) if unequal else base

            ins = [gen(dtype, sz(me, p), case, me, p) for p in range(w)]
            outs = [garbage(dtype, sz(p, me), case, me, p) for p in range(w)]
            issue(ck, mode, lambda a: dist.all_to_all(outs, ins, async_op=a))
            for p in range(w):
                ck.equal(outs[p], gen(dtype, sz(p, me), case, p, me), f"from rank {p}")

        unequal = [(f"unequal={u}", u) for u in (False, True)]
        self.movement_sweep("all_to_all", run, lambda size: unequal, per_rank_large=True)

    def theme_all_to_all_single(self):
        from refs import garbage, gen
        from xcoll import issue

        torch, dist, ck, w, me = self.torch, self.dist, self.ck, self.w, self.rank

        def run(dtype, base, case, mode, splits):
            if splits:
                in_sizes = [self.split(base, me, p) for p in range(w)]
                out_sizes = [self.split(base, p, me) for p in range(w)]
            else:
                in_sizes = out_sizes = [base] * w
            inp = torch.cat([gen(dtype, in_sizes[p], case, me, p) for p in range(w)])
            out = garbage(dtype, sum(out_sizes), case, me)
            kw = dict(output_split_sizes=out_sizes, input_split_sizes=in_sizes) if splits else {}
            issue(ck, mode, lambda a: dist.all_to_all_single(out, inp, async_op=a, **kw))
            ref = torch.cat([gen(dtype, out_sizes[p], case, p, me) for p in range(w)])
            ck.equal(out, ref)

        splits = [(f"splits={s}", s) for s in (False, True)]
        self.movement_sweep("all_to_all_single", run, lambda size: splits, per_rank_large=True)

    # ---------------------------------------------------------------- p2p / barrier
    def theme_p2p(self):
        from refs import dname, garbage, gen, numel_of
        from xcoll import complete

        torch, dist, ck, w, me = self.torch, self.dist, self.ck, self.w, self.rank
        if w == 1:
            ck.skip("p2p needs world_size >= 2")
            return
        nxt, prv = (me + 1) % w, (me - 1) % w
        for dtype, size in self.movement_cases():
            n = numel_of(size, dtype)
            dn = dname(dtype)
            # blocking send/recv along a chain 0->1, 1->2, ..., (w-1)->0
            case = f"p2p/send_recv/{dn}/n{n}"
            with ck.case(case):
                for s in range(w):
                    d = (s + 1) % w
                    if me == s:
                        x = gen(dtype, n, case, s)
                        dist.send(x, dst=d)
                        ck.equal(x, gen(dtype, n, case, s), "send buffer changed")
                    elif me == d:
                        t = garbage(dtype, n, case, me)
                        got = dist.recv(t, src=s)
                        ck.check(got == s, f"recv returned {got}, expected {s}")
                        ck.equal(t, gen(dtype, n, case, s), f"received from {s}")
            # isend/irecv ring
            for mode in ["wait", "future"]:
                case = f"p2p/isend_irecv/{dn}/n{n}/{mode}"
                with ck.case(case):
                    x = gen(dtype, n, case, me)
                    t = garbage(dtype, n, case, me)
                    ws_ = [dist.isend(x, dst=nxt), dist.irecv(t, src=prv)]
                    for wk in ws_:
                        complete(ck, wk, mode)
                    ck.equal(t, gen(dtype, n, case, prv), f"received from {prv}")
            # batch_isend_irecv ring (>= 1 MiB needs real batching to not deadlock)
            if size in (1, "large"):
                for order in ["send_first", "recv_first"]:
                    case = f"p2p/batch_isend_irecv/{dn}/n{n}/{order}"
                    with ck.case(case):
                        x = gen(dtype, n, case, me)
                        t = garbage(dtype, n, case, me)
                        ops = [dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, t, prv)]
                        if order == "recv_first":
                            ops.reverse()
                        for wk in dist.batch_isend_irecv(ops):
                            wk.wait()
                        ck.equal(t, gen(dtype, n, case, prv), f"received from {prv}")
        # bidirectional batch with two tensors per peer, large
        for dtype in [torch.float32, torch.bfloat16]:
            n = numel_of("large", dtype)
            case = f"p2p/batch_isend_irecv/bidirectional/{dname(dtype)}/n{n}"
            with ck.case(case):
                xa, xb = gen(dtype, n, case, me, "a"), gen(dtype, n, case, me, "b")
                ta, tb = garbage(dtype, n, case, me, "a"), garbage(dtype, n, case, me, "b")
                ops = [
                    dist.P2POp(dist.isend, xa, nxt),
                    dist.P2POp(dist.isend, xb, prv),
                    dist.P2POp(dist.irecv, ta, prv),
                    dist.P2POp(dist.irecv, tb, nxt),
                ]
                for wk in dist.batch_isend_irecv(ops):
                    wk.wait()
                ck.equal(ta, gen(dtype, n, case, prv, "a"), f"a from {prv}")
                ck.equal(tb, gen(dtype, n, case, nxt, "b"), f"b from {nxt}")
        # recv without src: rank 0 receives from everyone, any order
        for n in [1, 1001]:
            case = f"p2p/recv_any_source/n{n}"
            with ck.case(case):
                if me == 0:
                    seen = set()
                    for _ in range(w - 1):
                        t = torch.zeros(n + 1, dtype=torch.float32)
                        got = dist.recv(t)
                        sender = int(t[0].item())
                        ck.check(got == sender, f"recv() returned sender {got}, payload says {sender}")
                        ck.equal(t[1:], gen(torch.float32, n, case, sender), f"payload of {sender}")
                        seen.add(got)
                    ck.check(seen == set(range(1, w)), f"senders seen {sorted(seen)}")
                else:
                    time.sleep(0.002 * (w - me))
                    x = torch.cat([torch.tensor([float(me)]), gen(torch.float32, n, case, me)])
                    dist.send(x, dst=0)
                # keep the next case from racing with any-source receives
                dist.barrier()

    def theme_barrier(self):
        dist, ck, w, me = self.dist, self.ck, self.w, self.rank
        store = ctx().connect_store()
        for rnd in range(3):
            for mode in ["sync", "wait"]:
                case = f"barrier/round{rnd}/{mode}"
                with ck.case(case):
                    time.sleep(0.01 * me)
                    store.set(f"barrier/{rnd}/{mode}/{me}", "1")
                    if mode == "sync":
                        ck.check(dist.barrier() is None, "barrier() returned non-None")
                    else:
                        dist.barrier(async_op=True).wait()
                    keys = [f"barrier/{rnd}/{mode}/{r}" for r in range(w)]
                    ck.check(store.check(keys), "barrier returned before every rank arrived")


def collectives_sweep(rank, w, themes):
    sw = Sweep(rank, w)
    counts = {}
    for theme in themes:
        before = sw.ck.cases
        t0 = time.monotonic()
        try:
            getattr(sw, f"theme_{theme}")()
        except harness.SweepAborted as e:
            sw.ck.c.fail(f"{theme}/<aborted>", str(e))
        counts[theme] = (sw.ck.cases - before, round(time.monotonic() - t0, 2))
    out = sw.ck.summary()
    out["themes"] = counts
    return out


# --------------------------------------------------------------------------------------
# pytest side
# --------------------------------------------------------------------------------------

_RUNS: dict[object, harness.RunResult] = {}


def sweep_once(key, world_size: int, **run_kwargs) -> harness.RunResult:
    """The collectives sweep on `world_size` ranks, run once per `key` and shared by the
    per-theme tests (run_kwargs go to run_ranks)."""
    if key not in _RUNS:
        res = run_ranks(world_size, collectives_sweep, THEMES, check=False, **run_kwargs)
        _RUNS[key] = res
        r0 = res.value(0)
        if r0:
            print(f"\n[{key}] {res.elapsed:.1f}s, per theme (cases, s): {r0['themes']}")
    return _RUNS[key]


def check_theme(res: harness.RunResult, world_size: int, theme: str) -> None:
    """Fails with the sweep's report for `theme`, or if a rank ran no case of it."""
    rep = res.report(prefix=theme + "/")
    if rep:
        raise AssertionError(rep)
    for r in range(world_size):
        counts = res.value(r)["themes"]
        assert counts[theme][0] > 0, f"rank {r} ran no {theme} case"


@pytest.mark.parametrize("theme", THEMES)
@pytest.mark.parametrize("w", WORLD_SIZES, ids=lambda w: f"w{w}")
def test_collective(w, theme):
    if theme == "p2p" and w == 1:
        pytest.skip("p2p needs world_size >= 2")
    check_theme(sweep_once(f"w={w}", w, timeout_s=420), w, theme)
