"""Inputs and references for the collective tests.

Every rank can generate every rank's inputs (seeded by (case id, rank, ...)), so the
reference result of a collective is computed locally with plain torch ops: the backend
is never compared with itself.

Reduction semantics (must match NCCL):
  * floats: SUM/AVG/PREMUL_SUM/PRODUCT are compared against a float64 reference with a
    rounding-error bound (fp16/bf16 accumulate in fp32 in the backend; partial results
    may be rounded to the wire dtype on each hop, the bound allows that); MIN/MAX exact.
  * integers: SUM/PRODUCT wrap around (two's complement); AVG = wrapped SUM, then
    division by the world size truncating toward zero; MIN/MAX/BAND/BOR/BXOR exact.
  * bool: SUM/MAX/BOR = any, PRODUCT/MIN/BAND = all, BXOR = parity.
  * PREMUL_SUM = factor * SUM (floating point only).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist

from harness import seed_of

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
FLOATS = [F64, F32, F16, BF16]
INTS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
BOOL = torch.bool
DTYPES = FLOATS + INTS + [BOOL]
FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2]
MOVE_DTYPES = DTYPES + FLOAT8  # data-movement collectives

OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM", "PREMUL_SUM_T"]

# sizes: empty, one element, odd, >= 1 MiB (computed per dtype by large_numel)
SIZES = [0, 1, 1001, "large"]
MODES = ["sync", "wait", "future"]


def dname(dtype) -> str:
    return str(dtype).replace("torch.", "")


def large_numel(dtype) -> int:
    """An odd element count of at least 1 MiB (262147 float32 elements)."""
    item = torch.empty((), dtype=dtype).element_size()
    return max(262147, (1 << 20) // item + 3)


def numel_of(size, dtype) -> int:
    return large_numel(dtype) if size == "large" else int(size)


def valid_op(op: str, dtype) -> bool:
    if dtype == BOOL:
        return op in ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
    if dtype in INTS:
        return not op.startswith("PREMUL")
    if dtype in FLOATS:
        return op not in ("BAND", "BOR", "BXOR")
    if dtype.is_complex:
        return op in ("SUM", "AVG")
    return False  # float8: no reductions


def gloo_gap(dtype=None, op: str | None = None) -> str | None:
    """Why gloo cannot run this case natively (None: it can).

    Only consulted when validating the suite with gloo; never for xccl_rs.
    """
    if dtype == torch.int16:
        return "gloo has no int16 collectives"
    if dtype == BOOL and op == "SUM":
        return "gloo's bool SUM stores non-canonical bool bytes (2, 3, ...)"
    if dtype in FLOAT8:
        return "gloo has no float8 collectives"
    if op is not None and op.startswith("PREMUL"):
        return "gloo has no PREMUL_SUM (emulated as SUM * factor)"
    if op == "AVG" and dtype is not None and (dtype in INTS or dtype == BOOL):
        return "gloo has no integer AVG (emulated as SUM // world_size)"
    return None


def gloo_emulable(dtype, op) -> bool:
    """gloo-validation only: cases run as SUM + local post-processing on gloo."""
    if op is None or dtype in (torch.int16, *FLOAT8):
        return False
    return op.startswith("PREMUL") or (op == "AVG" and (dtype in INTS or dtype == BOOL))


# XCCL_RS_TEST_STRICT_LOWP=1: require fp16/bf16 SUM/AVG/PREMUL_SUM to be rounded once
# from an fp32 accumulation (<= ~1 ulp) instead of the any-order rounding bound.
STRICT_LOWP = os.environ.get("XCCL_RS_TEST_STRICT_LOWP", "0") == "1"

PREMUL_SCALAR = 0.25
PREMUL_TENSOR = 0.5


def make_op(op: str, dtype, factor: float | None = None):
    """(ReduceOp to pass to torch.distributed, exact factor used by the reference)."""
    if op == "PREMUL_SUM":
        f = PREMUL_SCALAR if factor is None else factor
        return dist._make_nccl_premul_sum(f), f
    if op == "PREMUL_SUM_T":
        f = PREMUL_TENSOR if factor is None else factor
        ft = torch.tensor([f], dtype=dtype)
        return dist._make_nccl_premul_sum(ft), float(ft.to(F64).item())
    return getattr(dist.ReduceOp, op), None


def input_kind(op: str | None) -> str:
    if op == "PRODUCT":
        return "prod"
    return "full"


# Large inputs repeat a random block of PERIOD elements (a prime, so chunk offsets of
# any power-of-two or per-rank split do not line up with it): generating them and
# their references is cheap, while any misplaced chunk is still detected.
PERIOD = 4099


def gen(dtype, n: int, *seed_parts, kind: str = "full") -> torch.Tensor:
    """Deterministic input tensor of n elements."""
    if n >= 3 * PERIOD:
        block = gen(dtype, PERIOD, *seed_parts, kind=kind)
        return block.repeat(n // PERIOD + 1)[:n]
    g = torch.Generator().manual_seed(seed_of(*seed_parts))
    if dtype in FLOATS or dtype in FLOAT8:
        base = F64 if dtype == F64 else F32
        if kind == "prod":
            t = torch.rand(n, generator=g, dtype=base) + 0.5  # [0.5, 1.5)
        else:
            t = torch.randn(n, generator=g, dtype=base)
            if dtype in FLOAT8:
                t = t * 4
        return t.to(dtype)
    if dtype.is_complex:
        return torch.randn(n, generator=g, dtype=dtype)
    if dtype == BOOL:
        return torch.rand(n, generator=g) < 0.6
    info = torch.iinfo(dtype)
    if kind == "prod":
        lo, hi = (0, 7) if info.min == 0 else (-6, 7)
    elif dtype == torch.int64:
        lo, hi = -(1 << 40), 1 << 40
    else:
        lo, hi = info.min, info.max + 1
    return torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(dtype)


def garbage(dtype, n: int, *seed_parts) -> torch.Tensor:
    """Pre-fill for output buffers (so a no-op backend cannot pass)."""
    return gen(dtype, n, "garbage", *seed_parts)


# --------------------------------------------------------------------------------------
# reference reductions
# --------------------------------------------------------------------------------------


def _wrap(x: torch.Tensor, dtype) -> torch.Tensor:
    """int64 -> dtype with two's-complement wraparound (explicitly, not via casting)."""
    if dtype == torch.int64:
        return x
    bits = torch.iinfo(dtype).bits
    m = 1 << bits
    if torch.iinfo(dtype).min < 0:
        x = torch.remainder(x + (m >> 1), m) - (m >> 1)
    else:
        x = torch.remainder(x, m)
    return x.to(dtype)


class Ref:
    """Expected result: exact (tol is None) or float64 value with per-element tolerance."""

    def __init__(self, value, tol=None):
        self.value = value
        self.tol = tol

    @classmethod
    def tiled(cls, r, n):
        out = cls.__new__(cls)
        out.value, out.tol = _tile(r.value, n), _tile(r.tol, n)
        return out

    def check(self, ck, actual, what="output") -> bool:
        if self.tol is None:
            return ck.equal(actual, self.value, what)
        return ck.close(actual, self.value, self.tol, what)


def _tile(t, n):
    return None if t is None else t.repeat(n // PERIOD + 1)[:n]


def reduce_ref(xs: list[torch.Tensor], op: str, factor: float | None = None) -> Ref:
    """Reference of reducing the per-rank tensors xs (same dtype/shape) with op."""
    n = xs[0].numel()
    if xs[0].dim() == 1 and not xs[0].is_complex() and n >= 3 * PERIOD and all(
        torch.equal(x[:PERIOD], x[PERIOD : 2 * PERIOD]) for x in xs
    ):
        # periodic inputs from gen(): reduce one block, tile the result
        r = reduce_ref([x[:PERIOD] for x in xs], op, factor)
        return type(r).tiled(r, n)
    w = len(xs)
    dtype = xs[0].dtype
    if dtype.is_complex:
        real = [torch.view_as_real(x) for x in xs]
        r = reduce_ref(real, op, factor)
        return ComplexRef(r)
    if dtype == BOOL:
        X = torch.stack(xs)
        if op in ("SUM", "MAX", "BOR"):
            v = X.any(0)
        elif op in ("PRODUCT", "MIN", "BAND"):
            v = X.all(0)
        elif op == "BXOR":
            v = X.to(torch.int64).sum(0) % 2 == 1
        else:
            raise ValueError(f"{op} on bool")
        return Ref(v)
    if dtype in INTS:
        if op in ("MIN", "MAX"):
            X = torch.stack(xs)
            return Ref(X.amin(0) if op == "MIN" else X.amax(0))
        if op in ("BAND", "BOR", "BXOR"):
            f = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
            return Ref(functools.reduce(f, xs))
        X = torch.stack(xs).to(torch.int64)
        if op == "SUM":
            return Ref(_wrap(X.sum(0), dtype))
        if op == "PRODUCT":
            return Ref(_wrap(X.prod(0), dtype))
        if op == "AVG":
            s = _wrap(X.sum(0), dtype).to(torch.int64)
            return Ref(torch.div(s, w, rounding_mode="trunc").to(dtype))
        raise ValueError(f"{op} on {dtype}")
    # floating point
    X = torch.stack(xs).to(F64)
    if op in ("MIN", "MAX"):
        return Ref((X.amin(0) if op == "MIN" else X.amax(0)).to(dtype))
    eps = torch.finfo(dtype).eps
    if op == "PRODUCT":
        v = X.prod(0)
        return Ref(v, eps * (w + 1) * v.abs())
    S = X.abs().sum(0)
    v = X.sum(0)
    u = eps / 2  # unit roundoff of the dtype
    # Rounding-error bound valid for any summation order: each of the (w-1) partial
    # sums is rounded (<= u * sum|x|), plus the final rounding (<= u * |v|), plus one
    # unit of slack.
    if STRICT_LOWP and dtype in (F16, BF16) and op in ("SUM", "AVG", "PREMUL_SUM", "PREMUL_SUM_T"):
        # fp32 accumulation, a single rounding to the dtype at the end
        f = {"SUM": 1.0, "AVG": 1.0 / w}.get(op, factor)
        v, S = v * f, S * abs(f)
        return Ref(v, u * 2 * v.abs() + 4 * w * torch.finfo(F32).eps * S + torch.finfo(dtype).tiny)
    if op == "SUM":
        tol = u * (2 * v.abs() + w * S)
    elif op in ("AVG", "PREMUL_SUM", "PREMUL_SUM_T"):
        # AVG may be implemented as a pre-multiplication by 1/w: w more roundings of
        # the scaled inputs and one of the factor itself.
        f = 1.0 / w if op == "AVG" else factor
        assert f is not None
        v, S = v * f, S * abs(f)
        tol = u * (3 * v.abs() + 2 * w * S)
    else:
        raise ValueError(f"{op} on {dtype}")
    return Ref(v, tol + torch.finfo(dtype).tiny)


class ComplexRef(Ref):
    def __init__(self, real_ref: Ref):
        super().__init__(real_ref.value, real_ref.tol)

    def check(self, ck, actual, what="output") -> bool:
        return super().check(ck, torch.view_as_real(actual), what)


# --------------------------------------------------------------------------------------
# comparisons (return an error string, or None when equal)
# --------------------------------------------------------------------------------------


def _fmt(t: torch.Tensor, idx: int):
    v = t.reshape(-1)[idx]
    if v.dtype == BOOL:
        return f"bool byte {int(v.view(torch.uint8).item())}"
    return v.item() if v.dtype not in FLOAT8 else v.to(F32).item()


def compare_exact(actual, expected) -> str | None:
    if not isinstance(actual, torch.Tensor):
        return f"expected a tensor, got {type(actual).__name__}"
    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype} != expected {expected.dtype}"
    if tuple(actual.shape) != tuple(expected.shape):
        return f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    if actual.numel() == 0:
        return None
    a = actual.contiguous().reshape(-1)
    e = expected.contiguous().reshape(-1)
    if torch.equal(a.view(torch.uint8), e.view(torch.uint8)):
        return None
    if a.dtype.is_floating_point or a.dtype.is_complex or a.dtype == BOOL:
        # bitwise: also catches -0.0/NaN payload changes in pure data movement
        a8 = a.view(torch.uint8).reshape(a.numel(), -1)
        e8 = e.view(torch.uint8).reshape(e.numel(), -1)
        bad = (a8 != e8).any(1)
    else:
        bad = a != e
    nbad = int(bad.sum())
    if nbad == 0:
        return None
    i = int(bad.nonzero()[0])
    return (
        f"{nbad}/{a.numel()} elements differ; first at flat index {i}: "
        f"got {_fmt(a, i)!r}, expected {_fmt(e, i)!r}"
    )


def compare_close(actual, expected_f64, tol) -> str | None:
    if not isinstance(actual, torch.Tensor):
        return f"expected a tensor, got {type(actual).__name__}"
    if tuple(actual.shape) != tuple(expected_f64.shape):
        return f"shape {tuple(actual.shape)} != expected {tuple(expected_f64.shape)}"
    if actual.numel() == 0:
        return None
    a = actual.detach().to(F64).reshape(-1)
    e = expected_f64.to(F64).reshape(-1)
    t = tol if isinstance(tol, torch.Tensor) else torch.full_like(e, float(tol))
    t = t.reshape(-1)
    diff = (a - e).abs()
    bad = ~(diff <= t)  # NaN counts as bad
    nbad = int(bad.sum())
    if nbad == 0:
        return None
    i = int(bad.nonzero()[0])
    j = int(torch.where(bad, diff - t, torch.zeros_like(diff)).nan_to_num(float("inf")).argmax())
    return (
        f"{nbad}/{a.numel()} elements out of tolerance; first at {i}: got {a[i].item()!r}, "
        f"expected {e[i].item()!r} (tol {t[i].item():.3g}); worst at {j}: got {a[j].item()!r}, "
        f"expected {e[j].item()!r} (tol {t[j].item():.3g})"
    )
