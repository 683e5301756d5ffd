"""The fp8 payload (``WeightSender(payload="fp8")``): the trainer quantizes each selected weight to
``float8_e4m3fn`` with float32 scales, and the rollouts receive them in the layout vLLM's fp8
layers load, as the tensors of an fp8 checkpoint would be.

**The quantization** (DeepSeek-V3's and vLLM's ``per_block_cast_to_fp8``, vllm/utils/deep_gemm.py):
for each block of the weight (``W`` as float32), ``amax = max(|W|)`` over the block, clamped
below at ``1e-4``; the weight travels as ``(W * (448.0 / amax)).to(float8_e4m3fn)`` and its
scale as ``amax / 448`` (float32), the number a rollout multiplies the fp8 values by. In torch,
``448.0 / amax`` (a Python number over a tensor) is ``amax.reciprocal() * 448.0``, which rounds
differently from a true division; the values are bit for bit vLLM's only with that. Blocks:

* ``"block"`` (default) -- 128x128 tiles of a 2-D weight ``[out, in]`` (the last ones cut short):
  the scale is ``<name>_scale_inv`` of shape ``[ceil(out/128), ceil(in/128)]``, what vLLM's
  ``Fp8LinearMethod`` loads from a block-fp8 checkpoint (``weight_block_size [128, 128]``, the
  ``weight_scale_inv`` parameter);
* ``"channel"`` -- one block per output row: ``<name>_scale`` of shape ``[out, 1]`` (vLLM's
  per-channel ``weight_scale``);
* ``"tensor"`` -- one block: ``<name>_scale``, a 0-d tensor (vLLM's per-tensor ``weight_scale``).

**Which tensors are quantized** (:func:`default_selects`): the 2-D tensors whose name ends in
``weight`` and contains none of ``embed``, ``lm_head``, ``norm`` (so embeddings, the output
head, norms, biases and every 1-D tensor stay in their dtype). ``fp8_select=callable(name,
tensor) -> bool`` replaces the rule. A selected tensor must be bfloat16, float16 or float32 and
2-D: anything else is refused, naming it.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
AMAX_FLOOR = 1e-4
BLOCK = 128
SCALES = ("block", "channel", "tensor")
#: The dtypes a selected tensor may have.
QUANTIZABLE = (torch.bfloat16, torch.float16, torch.float32)
#: Name parts that keep a 2-D ``...weight`` in full precision under the default rule.
KEEP_FULL = ("embed", "lm_head", "norm")


def default_selects(name: str, t: torch.Tensor) -> bool:
    """The default rule (module docstring): 2-D ``...weight`` tensors, except embeddings, the
    head and norms."""
    return t.dim() == 2 and name.endswith("weight") and not any(k in name for k in KEEP_FULL)


def scale_name(name: str, scale: str) -> str:
    """The name the scale of ``name`` travels under (vLLM's parameter names)."""
    return name + ("_scale_inv" if scale == "block" else "_scale")


def check_scale(scale: str) -> str:
    if scale not in SCALES:
        raise ValueError(f"WeightSender: fp8_scale must be one of {SCALES}, got {scale!r}")
    return scale


def quantize(name: str, w: torch.Tensor, scale: str = "block") -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` (2-D, bf16/fp16/fp32) as float8_e4m3fn values and float32 scales (module docstring),
    on ``w``'s device."""
    if w.dtype not in QUANTIZABLE:
        raise TypeError(
            f"{name!r} has dtype {w.dtype}; the fp8 payload quantizes only bfloat16, float16 and float32 "
            "(leave it out with fp8_select, or send it with payload='full')"
        )
    if w.dim() != 2:
        raise TypeError(f"{name!r} has shape {tuple(w.shape)}; the fp8 payload quantizes only 2-D weights")
    out, inp = w.shape
    x = w.float()
    if scale == "block":
        rows, cols = -(-out // BLOCK), -(-inp // BLOCK)
        if out % BLOCK or inp % BLOCK:
            padded = x.new_zeros(rows * BLOCK, cols * BLOCK)  # whole blocks; the zeros change no max
            padded[:out, :inp] = x
        else:
            padded = x  # whole blocks already (read only: nothing below writes into it)
        blocks = padded.contiguous().view(rows, BLOCK, cols, BLOCK)
        amax = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=AMAX_FLOOR)
        q = (blocks * (amax.reciprocal() * FP8_MAX)).view(rows * BLOCK, cols * BLOCK)[:out, :inp].to(torch.float8_e4m3fn)
        return q.contiguous(), (amax / FP8_MAX).view(rows, cols).to(torch.float32)
    elif scale == "channel":
        amax = x.abs().amax(dim=1, keepdim=True).clamp(min=AMAX_FLOOR) if inp else x.new_full((out, 1), AMAX_FLOOR)
        factor = amax.reciprocal() * FP8_MAX
    else:
        amax = (x.abs().amax() if x.numel() else x.new_zeros(())).clamp(min=AMAX_FLOOR)
        factor = amax.reciprocal() * FP8_MAX
    q = (x * factor).to(torch.float8_e4m3fn)
    return q, (amax / FP8_MAX).to(torch.float32)


class Fp8Rule:
    """Which tensors a sender quantizes and how (module docstring)."""

    def __init__(self, scale: str = "block", select: Optional[Callable[[str, torch.Tensor], bool]] = None):
        self.scale = check_scale(scale)
        self.select = select if select is not None else default_selects

    def split(self, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """What travels for ``(name, t)``: itself, or its fp8 values and its scales."""
        if not self.select(name, t):
            return [(name, t)]
        q, s = quantize(name, t, self.scale)
        return [(name, q), (scale_name(name, self.scale), s)]
