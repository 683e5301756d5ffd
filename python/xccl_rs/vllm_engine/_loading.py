"""The worker side's model loading (no vLLM types): each tensor loaded by the model's
``load_weights`` under a dtype guard, and vLLM's layerwise reload."""

from __future__ import annotations

from typing import Optional

import torch


def _storage_ptr(t: torch.Tensor) -> Optional[int]:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def _dtype_guard():
    """A dispatch mode that refuses, while one tensor loads, any copy of its bytes into a tensor
    of another dtype (a model that would convert what the trainer sent)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten

    class DtypeGuard(TorchDispatchMode):
        def __init__(self, tensor: torch.Tensor):
            super().__init__()
            self.ptr = _storage_ptr(tensor)
            self.device = tensor.device

        def _ours(self, t) -> bool:
            return (
                isinstance(t, torch.Tensor) and t.device == self.device and self.ptr and _storage_ptr(t) == self.ptr
            )

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is aten.copy_.default and len(args) >= 2 and self._ours(args[1]):
                if args[0].dtype != args[1].dtype:
                    raise TypeError(f"the model stores it as {args[0].dtype}, the trainer sent {args[1].dtype}")
            elif func is aten._to_copy.default and args and self._ours(args[0]):
                dtype = kwargs.get("dtype")
                if dtype is not None and dtype != args[0].dtype:
                    raise TypeError(f"the model converts it to {dtype}, the trainer sent {args[0].dtype}")
            return func(*args, **kwargs)

    return DtypeGuard


def _load_one(model: torch.nn.Module, guard, name: str, tensor: torch.Tensor) -> None:
    """``model.load_weights([(name, tensor)])`` under the dtype guard."""
    with torch.no_grad(), guard(tensor):
        model.load_weights([(name, tensor)])


def _layerwise():
    """vLLM's layerwise reload (``vllm.model_executor.model_loader.reload``)."""
    try:
        from vllm.model_executor.model_loader import reload
        from vllm.model_executor.model_loader.reload import layerwise
    except ImportError as e:
        raise ImportError(f"xccl_rs.vllm_engine: vLLM's layerwise reload does not import: {e}") from e
    return reload, layerwise


def _cancel_layerwise_reload(model: torch.nn.Module) -> None:
    """Ends vLLM's layerwise reload after a failed round without processing half-loaded layers:
    each layer whose reload is still open gets its kernel tensors (the weights it held) back.
    Layers already complete keep the new weights. (vLLM's ``finalize_layerwise_reload`` would
    process a half-loaded layer with uninitialised memory for what did not arrive.)"""
    _, layerwise = _layerwise()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    for layer in model.modules():
        info = layerwise.LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load():
            continue
        if info.kernel_tensors is not None:
            layerwise._place_kernel_tensors(layer, info)
        info.reset()
    layerwise.LOADING_LAYERS.clear()
