"""What test_vllm_engine.py runs: a small Qwen2 on both sides, vLLM worker processes, and a client.

* The trainer's model is transformers' ``Qwen2ForCausalLM`` made from a small config (no hub),
  sent with vLLM's ``ModuleSource``: Hugging Face names (``q_proj``, ``gate_proj``, ...).
* Each vLLM worker holds :class:`VllmQwen2`, built like vLLM's Qwen2: fused ``qkv_proj`` and
  ``gate_up_proj``, tensor-parallel shards (vocabulary and column-parallel layers split along
  dim 0, row-parallel ones along dim 1), parameters carrying a ``weight_loader``, and a
  ``load_weights`` that maps checkpoint names through ``stacked_params_mapping``, raises
  ``KeyError`` on a name the model does not have, and asserts shapes. Its reload metadata is
  recorded at construction, as vLLM's model loader does, so the engine's layerwise reload runs.
  Optionally layer 1's ``down_proj`` is fp8 (``float8_e4m3fn`` weight, fp32 ``weight_scale``).
* A worker process (:func:`worker_main`) makes its engine with vLLM's factory after
  ``vllm.plugins.load_general_plugins()`` (the entry point registers ``xccl_rs``), and answers
  the four calls in the order vLLM's ``gpu_worker`` makes them, with its session checks.
* :class:`PipeClient` is the trainer's ``VLLMWeightSyncClient``: each call goes to every worker
  of every replica at once and waits for all (as vLLM's Ray client does), raising an error that
  names the replica when one fails or died.
* Several trainer ranks (``senders="all"``): each is a process (:func:`trainer_main`) in a gloo
  default group of the trainers, holding the transformers Qwen2, optionally ``fully_shard``-ed
  (FSDP2) over that group. Trainer rank 0's client is a :class:`ProxyClient`, whose calls the
  test process serves with its ``PipeClient`` (:func:`serve_client`); the other ranks get a
  client that fails the test if called (vLLM's contract: only rank 0 drives the workers).
"""

from __future__ import annotations

import os
import threading
import traceback
from dataclasses import dataclass

import torch
from torch import nn

from peak_rss import PeakRss
from xccl_rs._processes import answer_calls

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Cfg:
    vocab: int = 256
    hidden: int = 64
    inter: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    dtype: str = "bfloat16"
    fp8: bool = False  # layer 1's down_proj in fp8 with a weight_scale

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


# --------------------------------------------------------------------------------------
# the trainer's model (Hugging Face)
# --------------------------------------------------------------------------------------


def hf_model(cfg: Cfg, extra: str | None = None, fp32_name: str | None = None) -> nn.Module:
    """transformers' Qwen2ForCausalLM of ``cfg``. ``extra``: also a parameter of that name (which
    the vLLM model does not have); ``fp32_name``: that parameter kept in float32."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    c = Qwen2Config(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.inter,
                    num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                    num_key_value_heads=cfg.kv_heads, tie_word_embeddings=False)
    m = Qwen2ForCausalLM(c).to(cfg.torch_dtype)
    m.requires_grad_(False)
    if cfg.fp8:
        down = m.model.layers[1].mlp.down_proj
        down.weight = nn.Parameter(down.weight.data.to(FP8), requires_grad=False)
        down.register_parameter("weight_scale", nn.Parameter(torch.tensor(0.5), requires_grad=False))
    if extra is not None:
        owner, _, leaf = extra.rpartition(".")
        m.get_submodule(owner).register_parameter(leaf, nn.Parameter(torch.zeros(4, dtype=cfg.torch_dtype),
                                                                     requires_grad=False))
    if fp32_name is not None:
        owner, _, leaf = fp32_name.rpartition(".")
        mod = m.get_submodule(owner)
        setattr(mod, leaf, nn.Parameter(getattr(mod, leaf).data.float(), requires_grad=False))
    return m


@torch.no_grad()
def train_step(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """New values in every parameter (deterministic from ``seed``); returns a copy of them."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():
        p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))
        out[name] = p.detach().clone()
    return out


# --------------------------------------------------------------------------------------
# the vLLM worker's model
# --------------------------------------------------------------------------------------


def _param(shape, dtype, loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader
    return p


def _loader(part_of=lambda w: w):
    """A parameter's ``weight_loader``: copies ``part_of(loaded_weight)`` (this rank's slice;
    default: all of it, a replicated parameter) after vLLM's shape check."""

    def loader(param, loaded_weight):
        part = part_of(loaded_weight)
        assert param.shape == part.shape, f"Attempted to load weight ({part.shape}) into parameter ({param.shape})"
        param.data.copy_(part)

    return loader


_replicated_loader = _loader()


class Shard:
    """The tensor-parallel slicing of each kind of parameter (vLLM's linear layers)."""

    def __init__(self, tp: int, rank: int):
        self.tp, self.rank = tp, rank

    def rows(self, w: torch.Tensor) -> torch.Tensor:  # column-parallel, vocab-parallel
        n = w.shape[0] // self.tp
        return w.narrow(0, self.rank * n, n)

    def cols(self, w: torch.Tensor) -> torch.Tensor:  # row-parallel
        n = w.shape[1] // self.tp
        return w.narrow(1, self.rank * n, n)

    def rows_loader(self):
        return _loader(self.rows)

    def cols_loader(self):
        return _loader(self.cols)

    def stacked_loader(self, sizes: dict):
        """A fused parameter's loader: ``sizes`` maps shard id to its full size along dim 0."""
        offsets, off = {}, 0
        for sid, n in sizes.items():
            offsets[sid] = (off, n // self.tp)
            off += n // self.tp

        def loader(param, loaded_weight, loaded_shard_id):
            start, n = offsets[loaded_shard_id]
            part = self.rows(loaded_weight)
            assert part.shape[0] == n, f"shard {loaded_shard_id!r}: {part.shape[0]} rows, expected {n}"
            param.data.narrow(0, start, n).copy_(part)
        return loader


class _Module(nn.Module):
    def __init__(self, **params):
        super().__init__()
        for k, v in params.items():
            self.register_parameter(k, v)


class VllmQwen2(nn.Module):
    """vLLM's Qwen2ForCausalLM's parameters and loading, for tensor-parallel rank ``rank`` of ``tp``."""

    stacked_params_mapping = [
        ("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(self, cfg: Cfg, tp: int = 1, rank: int = 0):
        super().__init__()
        self.cfg = cfg
        s = self.shard = Shard(tp, rank)
        dt, H, I, V = cfg.torch_dtype, cfg.hidden, cfg.inter, cfg.vocab
        q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.model = nn.Module()
        self.model.embed_tokens = _Module(weight=_param((V // tp, H), dt, s.rows_loader()))
        self.model.layers = nn.ModuleList()
        for i in range(cfg.layers):
            layer = nn.Module()
            layer.input_layernorm = _Module(weight=_param((H,), dt, _replicated_loader))
            layer.post_attention_layernorm = _Module(weight=_param((H,), dt, _replicated_loader))
            attn = layer.self_attn = nn.Module()
            qkv = {"q": q, "k": kv, "v": kv}
            attn.qkv_proj = _Module(weight=_param(((q + 2 * kv) // tp, H), dt, s.stacked_loader(qkv)),
                                    bias=_param(((q + 2 * kv) // tp,), dt, s.stacked_loader(qkv)))
            attn.o_proj = _Module(weight=_param((H, q // tp), dt, s.cols_loader()))
            mlp = layer.mlp = nn.Module()
            mlp.gate_up_proj = _Module(weight=_param((2 * I // tp, H), dt, s.stacked_loader({0: I, 1: I})))
            if cfg.fp8 and i == 1:
                mlp.down_proj = _Module(weight=_param((H, I // tp), FP8, s.cols_loader()),
                                        weight_scale=_param((), torch.float32, _replicated_loader))
            else:
                mlp.down_proj = _Module(weight=_param((H, I // tp), dt, s.cols_loader()))
            self.model.layers.append(layer)
        self.model.norm = _Module(weight=_param((H,), dt, _replicated_loader))
        self.lm_head = _Module(weight=_param((V // tp, H), dt, s.rows_loader()))
        with torch.no_grad():
            for p in self.parameters():
                p.zero_() if p.dtype != FP8 else p.copy_(torch.zeros(p.shape).to(FP8))
        # vLLM's model loader records this right after making a model (model_loader/utils.py).
        from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

        record_metadata_for_reloading(self)

    def load_weights(self, weights) -> set[str]:
        params_dict = dict(self.named_parameters())
        loaded = set()
        for name, loaded_weight in weights:
            for param_name, weight_name, shard_id in self.stacked_params_mapping:
                if weight_name not in name:
                    continue
                name = name.replace(weight_name, param_name)
                param = params_dict[name]
                param.weight_loader(param, loaded_weight, shard_id)
                break
            else:
                param = params_dict[name]
                param.weight_loader(param, loaded_weight)
            loaded.add(name)
        return loaded


def expected_params(cfg: Cfg, sent: dict[str, torch.Tensor], tp: int, rank: int) -> dict[str, torch.Tensor]:
    """What a worker's parameters must hold after receiving ``sent`` (the trainer's tensors)."""
    s = Shard(tp, rank)
    out = {}
    for name, w in sent.items():
        if ".self_attn.q_proj." in name:
            base = name.replace("q_proj", "qkv_proj")
            parts = [s.rows(sent[name.replace("q_proj", x)]) for x in ("q_proj", "k_proj", "v_proj")]
            out[base] = torch.cat(parts)
        elif ".mlp.gate_proj." in name:
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat(
                [s.rows(w), s.rows(sent[name.replace("gate_proj", "up_proj")])])
        elif any(k in name for k in (".k_proj.", ".v_proj.", ".up_proj.")):
            continue
        elif "embed_tokens" in name or name.startswith("lm_head"):
            out[name] = s.rows(w).clone()
        elif ".o_proj." in name or (".down_proj.weight" in name and not name.endswith("weight_scale")):
            out[name] = s.cols(w).clone()
        else:
            out[name] = w.clone()
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers of its element size (NaN-safe, fp8 included)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Every difference, bit for bit, dtype and shape included."""
    bad = []
    for name in sorted(set(got) | set(want)):
        if name not in got or name not in want:
            bad.append(f"{name}: only in {'the worker' if name in got else 'the expectation'}")
            continue
        a, b = got[name], want[name]
        if a.dtype != b.dtype or a.shape != b.shape:
            bad.append(f"{name}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}")
        elif not torch.equal(bits(a), bits(b)):
            n = int((bits(a) != bits(b)).sum())
            bad.append(f"{name}: {n} of {a.numel()} elements differ")
    return bad


# --------------------------------------------------------------------------------------
# a vLLM worker process
# --------------------------------------------------------------------------------------


class MiniWorker:
    """vLLM's gpu_worker's weight-transfer methods (vllm/v1/worker/gpu_worker.py), with its
    session checks: what calls the engine, and in which order."""

    def __init__(self, engine, model):
        self.engine, self.model = engine, model
        self.active = False
        self.meta_at_start = 0

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def start_weight_update(self) -> None:
        if self.active:
            raise RuntimeError("start_weight_update called while a weight update is already active")
        self.engine.start_weight_update()
        self.active = True
        self.meta_at_start = len(self.meta_params())  # vLLM's layerwise reload put layers on meta

    def update_weights(self, update_info: dict) -> None:
        if not self.active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        try:
            self.engine.update_weights(update_info)
        except BaseException:
            self.active = False
            raise

    def finish_weight_update(self) -> None:
        if not self.active:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
        self.engine.finish_weight_update()
        self.active = False

    def shutdown_weight_transfer_engine(self) -> None:
        self.engine.shutdown()

    # ---- for the tests -------------------------------------------------------------

    def params(self) -> dict:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def meta_params(self) -> list[str]:
        return [n for n, p in self.model.named_parameters() if p.is_meta]

    def die_after_loading(self, n: int) -> None:
        """Exit (as a crashed replica) in the middle of the next round, after ``n`` tensors."""
        inner = self.model.load_weights
        count = [0]

        def load_weights(weights):
            count[0] += 1
            if count[0] > n:
                os._exit(17)
            return inner(weights)

        self.model.load_weights = load_weights

    def layers_on_meta_at_start(self) -> int:
        return self.meta_at_start

    def pid(self) -> int:
        return os.getpid()


def worker_main(conn, cfg: Cfg, tp: int, rank: int, dp_size: int, dp_index: int) -> None:
    """A vLLM worker: makes its model and engine as vLLM does, then answers ``(method, args)``."""
    try:
        import types

        import vllm.plugins
        from vllm.config import ParallelConfig
        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.distributed.weight_transfer import WeightTransferEngineFactory

        vllm.plugins.load_general_plugins()  # as every vLLM process does: our entry point registers
        model = VllmQwen2(cfg, tp, rank)
        pc = ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp_size, data_parallel_rank=dp_index)
        pc.rank = rank  # gpu_worker sets it
        vllm_config = types.SimpleNamespace(parallel_config=pc, model_config=None)
        engine = WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(backend="xccl_rs"), vllm_config, torch.device("cpu"), model)
        worker = MiniWorker(engine, model)
        conn.send(("ok", type(engine).__name__))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    answer_calls(conn, lambda method: getattr(worker, method), engine.shutdown)


# --------------------------------------------------------------------------------------
# the trainer's client
# --------------------------------------------------------------------------------------


class WorkerHandle:
    def __init__(self, proc, conn, replica: int, rank: int):
        self.proc, self.conn, self.replica, self.rank = proc, conn, replica, rank
        self.lock = threading.Lock()

    def __repr__(self) -> str:
        return f"replica {self.replica} worker {self.rank} (pid {self.proc.pid})"

    def call(self, method: str, *args, timeout: float = 120.0):
        with self.lock:
            try:
                self.conn.send((method, args))
                if not self.conn.poll(timeout):
                    raise TimeoutError(f"{self}: {method} did not answer within {timeout} s")
                status, value = self.conn.recv()
            except (EOFError, BrokenPipeError, ConnectionResetError, OSError) as e:
                raise RuntimeError(f"{self} died (exit code {self.proc.exitcode}): {type(e).__name__}") from None
        if status != "ok":
            raise RuntimeError(f"{method} raised {value}")
        return value


def start_workers(ctx, cfg: Cfg, replica: int, tp: int = 1, dp_size: int = 1) -> list[WorkerHandle]:
    """The ``tp`` worker processes of data-parallel replica ``replica``."""
    handles = []
    for rank in range(tp):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=worker_main, args=(child, cfg, tp, rank, dp_size, replica), daemon=True)
        p.start()
        child.close()
        handles.append(WorkerHandle(p, parent, replica, rank))
    for h in handles:
        if not h.conn.poll(300):
            raise TimeoutError(f"{h} did not start")
        status, value = h.conn.recv()
        assert status == "ok", f"{h} failed to start:\n{value}"
        assert value == "XcclRsWeightTransferEngine", value
    return handles


def stop_workers(workers: list[WorkerHandle]) -> None:
    """Asks each worker still alive to exit, then makes sure it did."""
    for w in workers:
        if w.proc.is_alive():
            try:
                w.call("exit", timeout=30)
            except Exception:  # noqa: BLE001
                pass
        w.proc.join(10)
        if w.proc.is_alive():
            w.proc.kill()


class SyncClient:
    """vLLM's ``VLLMWeightSyncClient``: its four calls, each passed on by :meth:`forward` (the
    worker's ``finish_weight_update`` takes no weight version)."""

    def forward(self, method: str, *args) -> None:
        raise NotImplementedError

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.forward("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self.forward("start_weight_update")

    def update_weights(self, update_info) -> None:
        self.forward("update_weights", update_info)

    def finish_weight_update(self, weight_version=None) -> None:
        self.forward("finish_weight_update")


class PipeClient(SyncClient):
    """The trainer's ``VLLMWeightSyncClient`` over the replicas' workers (a list per replica)."""

    def __init__(self, replicas: list[list[WorkerHandle]], timeout: float = 120.0):
        self.replicas = list(replicas)
        self.timeout = timeout
        self.calls: list[str] = []

    @property
    def workers(self) -> list[WorkerHandle]:
        return [w for r in self.replicas for w in r]

    def fan_out(self, method: str, *args):
        self.calls.append(method)
        results, errors = {}, []
        workers = self.workers

        def run(w):
            try:
                results[w] = w.call(method, *args, timeout=self.timeout)
            except BaseException as e:  # noqa: BLE001
                errors.append(f"{w}: {e}")

        threads = [threading.Thread(target=run, args=(w,)) for w in workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError(f"{method} failed on {len(errors)} of {len(workers)} workers: " + " | ".join(errors))
        return [results[w] for w in workers]

    def forward(self, method: str, *args) -> None:
        self.fan_out(method, *args)


# --------------------------------------------------------------------------------------
# trainer processes (several trainer ranks)
# --------------------------------------------------------------------------------------


@torch.no_grad()
def set_weights(model: nn.Module, seed: int, changed: float = 1.0) -> None:
    """New values in every parameter (deterministic from ``seed``), also when they are FSDP2's
    DTensor shards: each rank writes its own piece of the same full values, with no collective.
    ``changed`` below 1: only that fraction of the elements (chosen from ``seed``) get new values,
    as after a training step at a small learning rate."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    g = torch.Generator().manual_seed(seed)
    for _, p in model.named_parameters():
        full = torch.randn(p.shape, generator=g).to(p.dtype)
        mask = torch.rand(p.shape, generator=g) < changed
        if isinstance(p, DTensor):
            full, mask = (distribute_tensor(x, p.device_mesh, p.placements, src_data_rank=None).to_local()
                          for x in (full, mask))
        local = p.to_local() if isinstance(p, DTensor) else p
        local.copy_(torch.where(mask, full, local))


class ProxyClient(SyncClient):
    """Trainer rank 0's ``VLLMWeightSyncClient``: each call is served by the test process."""

    def __init__(self, conn):
        self.conn = conn
        self.lock = threading.Lock()

    def forward(self, method: str, *args) -> None:
        with self.lock:  # an update_weights still in flight after a failed round finishes first
            self.conn.send((method, args))
            status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(value)


class NoClient:
    """The client of a trainer rank other than 0: vLLM's contract is that it is never called."""

    def __init__(self, rank: int):
        self.rank = rank

    def __getattr__(self, method):
        if method.startswith("_"):
            raise AttributeError(method)

        def call(*args, **kwargs):
            raise AssertionError(f"trainer rank {self.rank} called the client's {method}")

        return call


def serve_client(conn, client: "PipeClient") -> threading.Thread:
    """Serves trainer rank 0's :class:`ProxyClient` with ``client`` (a thread of the test process)."""

    def run():
        while True:
            try:
                method, args = conn.recv()
            except (EOFError, OSError):
                return
            try:
                conn.send(("ok", getattr(client, method)(*args)))
            except BaseException as e:  # noqa: BLE001
                try:
                    conn.send(("error", str(e)))
                except OSError:
                    return

    t = threading.Thread(target=run, daemon=True, name="proxy-client")
    t.start()
    return t


def fsdp2(model: nn.Module) -> None:
    """FSDP2's ``fully_shard`` of each decoder layer and of the model, over the default group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def trainer_main(conn, client_conn, rank: int, n: int, store_path: str, cfg: Cfg, shard: bool,
                 group: bool = True) -> None:
    """Trainer rank ``rank`` of ``n``: a gloo default group of the trainers (unless ``group`` is
    false), the transformers Qwen2 of ``cfg`` (FSDP2-sharded over that group when ``shard``),
    then answers ``(method, args)`` like a worker does."""
    import time
    from datetime import timedelta

    try:
        import torch.distributed as dist
        import vllm.plugins
        from torch.distributed.tensor import DTensor
        from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

        from xccl_rs.vllm_engine import XcclRsTrainerInitInfo

        vllm.plugins.load_general_plugins()
        if group:
            dist.init_process_group("gloo", store=dist.FileStore(store_path, n), rank=rank, world_size=n,
                                    timeout=timedelta(seconds=60))
        torch.manual_seed(0)  # the same initial weights on every trainer
        model = hf_model(cfg)
        if shard:
            fsdp2(model)
        gathers = [0]
        full_tensor = DTensor.full_tensor

        def counted(self, *args, **kwargs):  # every gather of a full tensor, on this rank
            gathers[0] += 1
            return full_tensor(self, *args, **kwargs)

        DTensor.full_tensor = counted
        state = {"engine": None, "die_after": None}
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return

    def init(world_size: int, options: dict):
        """The engine, made as vLLM's trainer makes it; ``options``: the init info's fields (``rank``
        too, to give a wrong one), ``source`` (False: made without a WeightSource) and ``node``
        ({trainer rank: the node address it reports}, for ``senders="node"``)."""
        options = dict(options)
        source = options.pop("source", True)
        node = options.pop("node", {}).get(rank)  # senders="node": the node address this rank reports
        import xccl_rs.door
        import xccl_rs.vllm_engine._trainer as trainer_side

        trainer_side.node_address = (lambda: node) if node is not None else xccl_rs.door.node_address
        options.setdefault("rank", rank)
        info = XcclRsTrainerInitInfo(master_address="127.0.0.1", master_port=0, world_size=world_size, **options)
        client = ProxyClient(client_conn) if rank == 0 else NoClient(rank)
        src = ModuleSource(model) if source else None
        state["engine"] = WeightTransferTrainerFactory.trainer_init(info, client=client, source=src)

    def weights(how: str):
        """What ``send_weights(weights=...)`` is given: the parameters as they are (DTensors
        when sharded), the full norm weight alone (one plain tensor: one trainer's share), or
        that and a tensor the workers' model does not have."""
        params = dict(model.named_parameters())
        if how == "params":
            return [(name, p.detach()) for name, p in params.items()]
        if how == "unknown":
            return weights("norm") + [("model.layers.0.mlp.extra_bias", torch.zeros(4, dtype=cfg.torch_dtype))]
        p = params["model.norm.weight"]
        return [("model.norm.weight", p.full_tensor() if isinstance(p, DTensor) else p.detach().clone())]

    def send(seed: int, how: str = "source", changed: float = 1.0):
        engine = state["engine"]
        set_weights(model, seed, changed)
        source = engine.source
        if state["die_after"] is not None:  # this trainer dies mid-round, after that many tensors
            count, inner = [0], (source.iter_local if engine.info.sharded else source.iter_full)

            def dying():
                for item in inner():
                    count[0] += 1
                    if count[0] > state["die_after"]:
                        os._exit(17)
                    yield item

            setattr(source, "iter_local" if engine.info.sharded else "iter_full", dying)
        items = None if how == "source" else weights(how)
        gathers[0] = 0
        t0 = time.monotonic()
        try:
            with PeakRss() as mem:
                engine.send_weights(items) if items is not None else engine.send_weights()
        except BaseException as e:  # noqa: BLE001
            return {"error": f"{type(e).__name__}: {e}", "elapsed": time.monotonic() - t0}
        sender = engine._sync.role  # None on a trainer rank that does not send
        st = engine.last_stats if sender is not None else None
        return {"bytes": st.bytes if st else 0, "tensors": st.tensors if st else 0, "buckets": st.buckets if st else 0,
                "shared": st.shared_window if st else None, "full_tensor_calls": gathers[0], "rss": mem.extra,
                "generation": engine._generation,
                "allocated": [slot.buf is not None for slot in sender._slots] if sender is not None else []}

    def reference():
        """torch's own full tensors of every parameter (``full_tensor()``: its all-gather),
        returned by rank 0."""
        ref = {name: (p.full_tensor() if isinstance(p, DTensor) else p.detach().clone())
               for name, p in model.named_parameters()}
        return ref if rank == 0 else None

    def die_in_next_round(after: int):
        state["die_after"] = after

    def shutdown():
        if state["engine"] is not None:
            state["engine"].shutdown()
            state["engine"] = None

    def model_info():
        params = dict(model.named_parameters())
        return {"placements": sorted({str(tuple(p.placements)) for p in params.values() if isinstance(p, DTensor)}),
                "bytes": sum(p.numel() * p.element_size() for p in params.values()),
                "largest": max(p.numel() * p.element_size() for p in params.values()),
                "uneven": sorted(name for name, p in params.items()
                                 if isinstance(p, DTensor) and p.shape[0] % n)}

    calls = {f.__name__: f for f in (init, send, reference, die_in_next_round, shutdown, model_info)}
    answer_calls(conn, calls.__getitem__, shutdown)


class Trainers:
    """``n`` trainer processes and the thread serving rank 0's client with ``client``."""

    def __init__(self, ctx, cfg: Cfg, n: int, client: "PipeClient", store_path: str, shard: bool = True,
                 group: bool = True):
        self.n = n
        self.procs, self.conns = [], []
        parent_client, child_client = ctx.Pipe()
        for rank in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=trainer_main, args=(child, child_client if rank == 0 else None, rank, n,
                                                       store_path, cfg, shard, group), daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        child_client.close()
        self.server = serve_client(parent_client, client)
        for rank, conn in enumerate(self.conns):
            if not conn.poll(300):
                raise TimeoutError(f"trainer {rank} did not start")
            status, value = conn.recv()
            assert status == "ok", f"trainer {rank} failed to start:\n{value}"

    def all(self, method: str, *args, timeout: float = 180.0, ranks=None, errors: bool = False) -> list:
        """``method(*args)`` on every trainer (``ranks``) at once; their answers, in rank order. A
        trainer that died answers ``("died", exit code)``; one that raised ``("error", text)``
        with ``errors``, else that is raised here."""
        ranks = list(range(self.n)) if ranks is None else ranks
        for r in ranks:
            self.conns[r].send((method, args))
        out = []
        for r in ranks:
            try:
                if not self.conns[r].poll(timeout):
                    raise TimeoutError(f"trainer {r}: {method} did not answer within {timeout} s")
                status, value = self.conns[r].recv()
            except (EOFError, ConnectionResetError, BrokenPipeError):
                self.procs[r].join(10)
                out.append(("died", self.procs[r].exitcode))
                continue
            if status != "ok" and not errors:
                raise RuntimeError(f"trainer {r}: {method} raised {value}")
            out.append(value if status == "ok" else ("error", value))
        return out

    def close(self) -> None:
        for r, p in enumerate(self.procs):
            if p.is_alive():
                try:
                    self.conns[r].send(("exit", ()))
                    self.conns[r].poll(30)
                except (OSError, EOFError):
                    pass
            p.join(10)
            if p.is_alive():
                p.kill()
