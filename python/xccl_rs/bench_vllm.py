"""Weight sync through vLLM's weight-transfer API: ``python -m xccl_rs.bench_vllm`` (needs vLLM).

One trainer (this process) updates 2 vLLM workers (``--workers``, each a process) with a state
dict shaped like Qwen2.5-0.5B (its names and shapes, random bf16 values: 494M parameters,
0.99 GB), in one run, three ways:

* ``xccl_rs``: vLLM's API with the ``"xccl_rs"`` engine (``WeightTransferTrainerFactory`` on
  the trainer, ``WeightTransferEngineFactory`` in each worker, the calls in vLLM's order:
  ``start_weight_update``, ``update_weights``, ``finish_weight_update``), on an xccl_rs group
  (one host: the shared window);
* ``gloo``: the same engine and API on a gloo group (``group_backend="gloo"``: the buckets are
  broadcast by gloo);
* ``verl``: the same transfer through xccl_rs's verl checkpoint engine
  (:mod:`xccl_rs.verl_engine`; verl itself is not needed): trainer ``send_weights``, workers
  ``receive_weights``, each tensor loaded as it arrives.

Each worker's model holds the parameters once (as vLLM's does) and loads every tensor with
``load_weights`` by name; through vLLM's API, vLLM's layerwise reload runs around each update,
as the engine does in vLLM (``--no-reload`` skips it). Every worker checks every parameter bit
for bit after each update. The time of an update is the trainer's, from the first call to
the workers to the last answer; the first update of each way (groups, windows and buffers made,
pages faulted in) is shown apart from the median of the others.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
import traceback
import types
from functools import cached_property

import torch
import torch.multiprocessing as mp

from ._processes import answer_calls
from .demo import initial_weights, qwen25_05b_shapes, train_step

WAYS = ["xccl_rs", "gloo", "verl"]


def _model(layers: int, dtype: torch.dtype, reload: bool) -> torch.nn.Module:
    """A module whose parameters have the state dict's names (zeros), and a vLLM-style
    ``load_weights`` (copies by name through each parameter's ``weight_loader``, KeyError on a
    name it does not have)."""
    root = torch.nn.Module()
    for name, shape in qwen25_05b_shapes(layers):
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)

        def loader(param, loaded_weight):
            assert param.shape == loaded_weight.shape, (param.shape, loaded_weight.shape)
            param.data.copy_(loaded_weight)

        p.weight_loader = loader
        mod.register_parameter(leaf, p)

    def load_weights(weights):
        params = dict(root.named_parameters())
        done = set()
        for name, w in weights:
            param = params[name]
            param.weight_loader(param, w)
            done.add(name)
        return done

    root.load_weights = load_weights
    if reload:
        try:
            from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
        except ImportError as e:
            raise SystemExit(f"bench_vllm: vLLM's layerwise reload does not import ({e}); try --no-reload") from e
        record_metadata_for_reloading(root)
    return root


class _NoReload:
    """What the engine's start/finish do without vLLM's layerwise reload (``--no-reload``)."""

    @staticmethod
    def initialize_layerwise_reload(model):
        pass

    @staticmethod
    def finalize_layerwise_reload(model, model_config):
        pass


def _worker(conn, index: int, workers: int, args) -> None:
    """A vLLM worker: its model and engine, then ``(method, args)`` calls until ``exit``."""
    try:
        torch.set_num_threads(max(1, args.threads))
        dtype = getattr(torch, args.dtype)
        try:
            import vllm.plugins
            from vllm.config import ParallelConfig
            from vllm.config.weight_transfer import WeightTransferConfig
            from vllm.distributed.weight_transfer import WeightTransferEngineFactory
        except ImportError as e:
            raise SystemExit(f"bench_vllm needs vLLM: {e}") from e
        from .vllm_engine import _loading

        if not args.reload:
            _loading._layerwise = lambda: (_NoReload, None)
        vllm.plugins.load_general_plugins()
        model = _model(args.layers, dtype, args.reload)
        pc = ParallelConfig(data_parallel_size=workers, data_parallel_rank=index)
        config = types.SimpleNamespace(parallel_config=pc, model_config=None)
        engine = WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(backend="xccl_rs"), config, torch.device("cpu"), model)
        verl = {}
        expected = initial_weights(args.layers, dtype, "cpu")
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return

    def check(round_: int) -> int:
        """Every parameter against the trainer's weights after ``round_`` updates (replayed)."""
        while check.replayed < round_:
            train_step(expected, check.replayed)
            check.replayed += 1
        bad = 0
        for name, p in model.named_parameters():
            want = expected[name]
            if p.is_meta or not torch.equal(p.detach().reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
                bad += 1
            p.data.zero_()  # a tensor that does not arrive next time cannot pass
        return bad

    check.replayed = 0

    def verl_init(kwargs: dict) -> None:
        _verl_engine(verl, args).init_process_group(**kwargs)

    def verl_receive() -> None:
        async def run():
            async for name, tensor in verl["engine"].receive_weights():
                model.load_weights([(name, tensor)])
        asyncio.run(run())

    calls = {
        "init_weight_transfer_engine": lambda info: engine.init_transfer_engine(engine.parse_init_info(info)),
        "start_weight_update": engine.start_weight_update,
        "update_weights": engine.update_weights,
        "finish_weight_update": engine.finish_weight_update,
        "shutdown": engine.shutdown,
        "check": check,
        "verl_prepare": lambda: _verl_engine(verl, args).prepare(),
        "verl_init": verl_init,
        "verl_receive": verl_receive,
        "verl_finalize": lambda: verl["engine"].finalize(),
        "rss_peak": lambda: _rss_peak(),
    }
    answer_calls(conn, calls.__getitem__)


def _verl_engine(verl: dict, args):
    """A worker's verl checkpoint engine (rollout side), made once."""
    from .verl_engine import _EngineImpl

    if "engine" not in verl:
        verl["engine"] = _EngineImpl(bucket_size=args.bucket_mb << 20, device="cpu", timeout_s=args.timeout)
    return verl["engine"]


def _rss_peak() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10


class _Client:
    """vLLM's ``VLLMWeightSyncClient`` over the worker processes: every call goes to all of them
    at once and returns when all have answered (as vLLM's Ray client does)."""

    def __init__(self, conns):
        self.conns = conns

    def call(self, method: str, *a):
        out, errors = [None] * len(self.conns), []

        def one(i, c):
            c.send((method, a))
            status, value = c.recv()
            if status != "ok":
                errors.append(f"worker {i}: {method}: {value}")
            out[i] = value

        threads = [threading.Thread(target=one, args=(i, c)) for i, c in enumerate(self.conns)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError("\n".join(errors))
        return out

    def init_weight_transfer_engine(self, init_info):
        self.call("init_weight_transfer_engine", init_info)

    def start_weight_update(self):
        self.call("start_weight_update")

    def update_weights(self, update_info):
        self.call("update_weights", update_info)

    def finish_weight_update(self, weight_version=None):
        self.call("finish_weight_update")


def _vllm_trainer_api():
    try:
        from vllm.distributed.weight_transfer import ParamMeta, WeightSource, WeightTransferTrainerFactory
    except ImportError as e:
        raise SystemExit(f"bench_vllm needs vLLM: {e}") from e
    return ParamMeta, WeightSource, WeightTransferTrainerFactory


def _source(weights: dict):
    """vLLM's WeightSource over a state dict (full tensors, every one owned by rank 0)."""
    ParamMeta, WeightSource, _ = _vllm_trainer_api()

    class DictSource(WeightSource):
        @cached_property
        def metadata(self):
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in weights.items()]

        def iter_full(self):
            yield from weights.items()

    return DictSource()


def _run_vllm_api(way: str, client: _Client, weights: dict, args, round0: int) -> list[float]:
    WeightTransferTrainerFactory = _vllm_trainer_api()[2]
    from .vllm_engine import XcclRsTrainerInitInfo

    info = XcclRsTrainerInitInfo(master_address="127.0.0.1", world_size=1 + len(client.conns), rank=0,
                                 bucket_bytes=args.bucket_mb << 20, timeout_s=args.timeout, group_backend=way)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=_source(weights))
    times = []
    try:
        for r in range(args.rounds):
            train_step(weights, round0 + r)
            t0 = time.perf_counter()
            engine.send_weights()
            times.append(time.perf_counter() - t0)
            _verify(client, round0 + r + 1, way, r)
    finally:
        engine.shutdown()
        client.call("shutdown")
    return times


def _run_verl(client: _Client, weights: dict, args, round0: int) -> list[float]:
    from .verl_engine import _EngineImpl

    master = _EngineImpl(bucket_size=args.bucket_mb << 20, is_master=True, master_addr="127.0.0.1",
                         timeout_s=args.timeout)
    times = []
    try:
        for r in range(args.rounds):
            train_step(weights, round0 + r)
            t0 = time.perf_counter()
            metas = [master.prepare()] + client.call("verl_prepare")
            actor, rollout = _EngineImpl.build_topology(1, len(client.conns), metas)
            kw = [{k: v[i] for k, v in rollout.items()} for i in range(len(client.conns))]
            done = threading.Event()
            errors = []

            def init_receive():
                try:
                    threads = [threading.Thread(target=_one_call, args=(c, "verl_init", (kw[i],), errors))
                               for i, c in enumerate(client.conns)]
                    for t in threads:
                        t.start()
                    master.init_process_group(**{k: v[0] for k, v in actor.items()})
                    for t in threads:
                        t.join()
                    client.call("verl_receive")
                except BaseException as e:  # noqa: BLE001
                    errors.append(repr(e))
                finally:
                    done.set()

            th = threading.Thread(target=init_receive)
            th.start()
            while master.group is None and th.is_alive():
                time.sleep(0.001)
            if master.group is not None:
                asyncio.run(master.send_weights(iter(weights.items())))
            th.join()
            if errors:
                raise RuntimeError("; ".join(errors))
            client.call("verl_finalize")
            master.finalize()
            times.append(time.perf_counter() - t0)
            _verify(client, round0 + r + 1, "verl", r)
    finally:
        master._drop_group()
    return times


def _one_call(conn, method, a, errors):
    conn.send((method, a))
    status, value = conn.recv()
    if status != "ok":
        errors.append(value)


def _verify(client: _Client, rounds_done: int, way: str, r: int) -> None:
    bad = client.call("check", rounds_done)
    if any(bad):
        raise SystemExit(f"bench_vllm: {way} round {r}: {bad} parameters differ on the workers")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--ways", nargs="+", default=WAYS, choices=WAYS)
    p.add_argument("--layers", type=int, default=24, help="Qwen2.5-0.5B has 24 (fewer for a quick run)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--bucket-mb", type=int, default=512, help="bucket size (MiB), every way")
    p.add_argument("--rounds", type=int, default=4, help="updates per way (the first is shown apart)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--no-reload", dest="reload", action="store_false",
                   help="skip vLLM's layerwise reload around each update (vLLM's API ways)")
    p.add_argument("--json", help="write the results to this file")
    args = p.parse_args(argv)

    dtype = getattr(torch, args.dtype)
    weights = initial_weights(args.layers, dtype, "cpu")
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    nparams = sum(t.numel() for t in weights.values())
    print(f"{len(weights)} tensors, {nparams / 1e6:.0f}M parameters, {nbytes / 1e9:.2f} GB of {args.dtype}; "
          f"{args.workers} vLLM workers; buckets of {args.bucket_mb} MiB; layerwise reload "
          f"{'on' if args.reload else 'off'}; torch {torch.__version__}, {os.cpu_count()} CPUs", flush=True)

    ctx = mp.get_context("spawn")
    conns, procs = [], []
    for i in range(args.workers):
        a, b = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(b, i, args.workers, args), daemon=True)
        proc.start()
        conns.append(a)
        procs.append(proc)
    for c in conns:
        status, value = c.recv()
        if status != "ok":
            raise SystemExit(f"bench_vllm: a worker failed to start:\n{value}")
    client = _Client(conns)
    results, round0 = {}, 0
    try:
        for way in args.ways:
            if way == "verl":
                times = _run_verl(client, weights, args, round0)
            else:
                times = _run_vllm_api(way, client, weights, args, round0)
            round0 += args.rounds
            rest = times[1:] or times
            med = statistics.median(rest)
            results[way] = {"first_s": times[0], "median_s": med, "times_s": times, "gbps": nbytes / med / 1e9}
            print(f"{way:>8}: first update {times[0]:.3f} s, then median {med:.3f} s "
                  f"({nbytes / med / 1e9:.2f} GB/s) over {len(rest)}; all parameters verified bit for bit", flush=True)
        peaks = client.call("rss_peak")
    finally:
        for c in conns:
            try:
                c.send(("exit", ()))
                c.recv()
            except (EOFError, OSError):
                pass
        for proc in procs:
            proc.join(30)
    if "xccl_rs" in results:
        for other in ("gloo", "verl"):
            if other in results:
                print(f"xccl_rs through vLLM's API is {results[other]['median_s'] / results['xccl_rs']['median_s']:.2f}x "
                      f"the speed of {other}")
    print("workers' peak RSS: " + ", ".join(f"{pk / 1e9:.2f} GB" for pk in peaks))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "bytes": nbytes, "results": results, "worker_rss_peak": peaks}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
