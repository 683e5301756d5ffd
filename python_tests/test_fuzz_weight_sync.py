"""Property tests of the weight-sync wire format (xccl_rs/weight_sync/format.py) with hypothesis.

1. Round trip: metadata laid out by the sender's own packer, for arbitrary names (unicode
   included), shapes (scalars, zero-size, huge-but-empty) and every supported dtype, decodes to
   exactly what was encoded.
2. Hostile input: arbitrary bytes, and valid encodings with bytes flipped, cut off, extended,
   or with a JSON value replaced by an arbitrary one, either decode to metadata that satisfies
   the invariants below, checked here independently of format.py, and that the receiver can
   unpack, or raise WeightSyncError. Any other exception, or a slow decode, fails.

Single process, no group: runs in a few seconds (budgets in _FAST / _HOSTILE).
"""

from __future__ import annotations

import json
import math
import struct

import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from xccl_rs.weight_sync import WeightSyncError  # noqa: E402
from xccl_rs.weight_sync import format as fmt  # noqa: E402
from xccl_rs.weight_sync.plan import Packer  # noqa: E402
from xccl_rs.weight_sync.receiver import WeightReceiver  # noqa: E402
from xccl_rs.weight_sync._common import SyncStats  # noqa: E402

# deadline: a decode of a few KB takes well under a millisecond; 300 ms leaves room for a
# loaded 2-core machine while still catching anything quadratic or a hang.
_FAST = settings(max_examples=150, deadline=300, suppress_health_check=[HealthCheck.too_slow])
_HOSTILE = settings(max_examples=300, deadline=300, suppress_health_check=[HealthCheck.too_slow])

# The dtypes the receiver can build from bytes, by probing torch here (not from format.DTYPES):
# a dtype the decoder accepts but this list lacks is a finding, and vice versa.
def _usable(dt: torch.dtype) -> bool:
    try:
        raw = torch.zeros(4 * dt.itemsize, dtype=torch.uint8)
        raw[dt.itemsize : 3 * dt.itemsize].view(dt).view(2).clone()
        torch.empty((0, 3), dtype=dt)
        return True
    except Exception:
        return False


_ALL_DTYPES = sorted({getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}, key=str)
_USABLE = [dt for dt in _ALL_DTYPES if _usable(dt)]
_INT64_MAX = (1 << 63) - 1


def test_supported_dtypes_are_the_usable_ones():
    """The decoder's known set is exactly what works (no quantized or sub-byte dtypes)."""
    assert set(fmt.DTYPES.values()) == set(_USABLE)
    for dt in _ALL_DTYPES:
        name = str(dt).removeprefix("torch.")
        if dt in fmt.DTYPES.values():
            assert fmt.dtype_of(name) is dt
        else:
            with pytest.raises(WeightSyncError, match="field 'dtype'"):
                fmt.dtype_of(name, "t")
    for alias in ("float", "half", "long", "__class__", "Tensor", ""):
        with pytest.raises(WeightSyncError, match="field 'dtype'"):
            fmt.dtype_of(alias, "t")


# --------------------------------------------------------------------------------------
# the invariants a decoded bucket must satisfy (written from the format's docstring)
# --------------------------------------------------------------------------------------


def check_invariants(h: fmt.Header, meta: fmt.BucketMeta) -> None:
    assert fmt.MIN_BUCKET_BYTES <= h.bucket_bytes <= fmt.MAX_BUCKET_BYTES
    assert 0 <= h.used_bytes <= h.bucket_bytes and 2 <= h.meta_nbytes <= fmt.MAX_META_BYTES
    assert meta.index == h.index
    if h.aborted:
        assert isinstance(meta.abort, str) and len(meta.abort) <= fmt.MAX_ABORT_CHARS
        meta.abort.encode("utf-8")
        return
    names = [e.name for e in meta.entries]
    assert len(set(names)) == len(names), "duplicate names"
    spans = []
    for e in meta.entries:
        assert isinstance(e.name, str) and len(e.name) <= fmt.MAX_NAME_CHARS
        e.name.encode("utf-8")  # valid unicode
        assert e.dtype in _USABLE
        assert len(e.shape) <= fmt.MAX_DIMS and all(type(s) is int and s >= 0 for s in e.shape)
        isz = e.dtype.itemsize
        assert e.total == math.prod(e.shape) * isz <= fmt.MAX_TENSOR_BYTES
        torch.empty(e.shape, dtype=e.dtype, device="meta")  # torch can make it (strides fit)
        assert 0 <= e.offset and e.offset + e.nbytes <= h.used_bytes
        assert 0 <= e.chunk_offset and e.chunk_offset + e.nbytes <= e.total
        assert e.nbytes > 0 or e.total == 0
        assert e.offset % isz == 0 and e.nbytes % isz == 0 and e.chunk_offset % isz == 0
        assert meta.total < 0 or e.total <= meta.total
        if e.nbytes:
            spans.append((e.offset, e.offset + e.nbytes))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "overlapping or unordered entries"
    assert max((end for _, end in spans), default=0) == h.used_bytes
    if meta.window is not None:
        assert h.index == 0 and meta.window.nbytes == 2 * h.bucket_bytes


class _Group:
    """Enough of a group for WeightReceiver's constructor: this is rank 1 of 2, the sender rank 0."""

    def rank(self):
        return 1

    def size(self):
        return 2


def unpack(buckets: list[tuple[fmt.Header, fmt.BucketMeta]]) -> list[tuple[str, torch.Tensor]]:
    """What the receiver yields for decoded buckets whose bytes are zeros: exercises its own
    checks (split tensors, names across buckets) and every torch call it makes on the entries.
    Buckets are kept small by the callers (used_bytes is allocated here)."""
    r = WeightReceiver(_Group())
    r._names = set()
    out, pending = [], None
    for h, meta in buckets:
        buf = torch.zeros(h.used_bytes, dtype=torch.uint8)
        pending = yield_all(r._unpack(True, (buf, meta.entries, h.index), pending, SyncStats(), None), out)
    return out


def yield_all(gen, out):
    while True:
        try:
            out.append(next(gen))
        except StopIteration as stop:
            return stop.value


# --------------------------------------------------------------------------------------
# 1. round trip of valid metadata
# --------------------------------------------------------------------------------------

_names = st.text(min_size=0, max_size=40)  # hypothesis' text has no lone surrogates
_shape = st.one_of(
    st.lists(st.integers(0, 9), min_size=0, max_size=3),  # scalars ([]) and zero-size included
    st.sampled_from([[1000], [3, 257]]),  # larger than the smallest buckets: split
    st.just([0, 1 << 40, 1 << 20]),  # empty, but with dimensions a stride must still hold
)
_tensors = st.lists(
    st.tuples(_names, st.sampled_from(sorted(fmt.DTYPES)), _shape), max_size=12, unique_by=lambda t: t[0]
)


def layout(tensors, bucket_bytes: int) -> list[list[fmt.Entry]]:
    """The sender's own packer lays the tensors out (so the entries are what a sender sends)."""
    packer, buckets = Packer(bucket_bytes), [[]]
    for name, dname, shape in tensors:
        dt = fmt.DTYPES[dname]
        for e in packer.add(name, dt, tuple(shape), dt.itemsize):
            if e is None:
                buckets.append([])
            else:
                buckets[-1].append(e)
    return buckets


def encoded(tensors, bucket_bytes: int, window: bool = False, known_total: bool = True):
    """(header, metadata, raw metadata) of each bucket, as a sender makes them."""
    buckets = layout(tensors, bucket_bytes)
    total = sum(math.prod(s) * fmt.DTYPES[d].itemsize for _, d, s in tensors) if known_total else -1
    out = []
    for i, entries in enumerate(buckets):
        ann = fmt.Announcement("xccl_rs-ws-" + "0" * 32, "host|1", 2 * bucket_bytes) if window and i == 0 else None
        meta = fmt.BucketMeta(i, entries, total, ann)
        raw = meta.encode()
        used = max((e.end for e in entries), default=0)
        out.append((fmt.Header(i, len(raw), used, bucket_bytes, last=i == len(buckets) - 1), meta, raw))
    return out


@_FAST
@given(_tensors, st.sampled_from([256, 512, 4096, 1 << 33]), st.booleans(), st.booleans())
def test_round_trip(tensors, bucket_bytes, window, known_total):
    # at most a few dozen buckets per example (tiny buckets of large tensors make thousands)
    assume(sum(math.prod(s) * fmt.DTYPES[d].itemsize for _, d, s in tensors) <= 32 * bucket_bytes)
    decoded = []
    for h, meta, raw in encoded(tensors, bucket_bytes, window, known_total):
        h2 = fmt.Header.decode(h.encode(), "t", h.index, None if h.index == 0 else bucket_bytes)
        assert h2 == h
        got = fmt.BucketMeta.decode(raw, h2, "t")
        assert got == meta
        check_invariants(h2, got)
        decoded.append((h2, got))
    if bucket_bytes <= 4096:  # small enough to allocate the buckets
        out = unpack(decoded)
        assert [(n, t.dtype, tuple(t.shape)) for n, t in out] == [
            (n, fmt.DTYPES[d], tuple(s)) for n, d, s in tensors
        ]


@_FAST
@given(st.text(max_size=3000))
def test_abort_round_trip(reason):
    h = fmt.Header(2, 1, 0, 4096, aborted=True)
    got = fmt.BucketMeta.decode(fmt.BucketMeta(2, abort=reason).encode(), h, "t")
    assert got.abort == reason[: fmt.MAX_ABORT_CHARS]


# --------------------------------------------------------------------------------------
# 2. hostile input: decodes to something valid, or raises WeightSyncError
# --------------------------------------------------------------------------------------

_BUCKET = 4096
_GOOD = encoded([("a", "float32", [2, 3]), ("b", "bfloat16", [100]), ("é", "int64", [0, 5]),
                 ("s", "float64", [])], _BUCKET, window=True)
_GOOD_RAW = _GOOD[0][2]
_GOOD_HEADER = _GOOD[0][0]


def decode_or_refuse(raw: bytes, h: fmt.Header = _GOOD_HEADER) -> None:
    try:
        meta = fmt.BucketMeta.decode(raw, h, "bucket 0 from rank 1")
    except WeightSyncError as e:
        assert "bucket 0 from rank 1" in str(e)  # the message says where
        return
    check_invariants(h, meta)
    if h.used_bytes <= 1 << 16:
        try:
            unpack([(h, meta)])
        except WeightSyncError:
            pass  # e.g. a split tensor left incomplete is the receiver's to refuse


# Regressions: each crashed, or decoded into something the receiver could not use, before the
# bounds of issue 14 (found by these tests or by reading the decoder).
_E = b'{"i":0,"total":-1,"e":'  # the metadata's start, before the entries
_REGRESSIONS = [  # (metadata, the field the error must name)
    (b"[" * 100_000, "metadata"),  # RecursionError out of json
    (_E + b'[["\\ud800","float32",[1],0,4,0,4]]}', "name"),  # a lone surrogate
    (_E + b'[["' + b"n" * 5000 + b'","uint8",[300],0,300,0,300]]}', "name"),  # 5000 characters
    (_E + b'[["a","float32",[1],0,4,0,4],["a","float32",[1],256,4,0,4]]}', "name"),  # same name twice
    (_E + b'[["q","qint8",[4],0,4,0,4]]}', "dtype"),  # quantized: torch.empty fails
    (_E + b'[["u","uint4",[4],0,4,0,4]]}', "dtype"),  # sub-byte: copy fails
    (_E + b'[["f","float",[1],0,4,0,4]]}', "dtype"),  # an alias, not the canonical name
    (_E + b'[["z","float32",[0,4611686018427387904,4611686018427387904],0,0,0,0]]}', "shape"),  # strides overflow
    (_E + b'[["a","uint8",[300],0,300,0,300],["b","uint8",[100],0,100,0,100]]}', "offset"),  # overlap
    (_E + b'[["h","uint8",[4398046511104],0,300,0,4398046511104]]}', "total_nbytes"),  # 4 TiB split tensor
    (b'{"i":0,"total":8,"e":[["t","uint8",[300],0,300,0,300]]}', "total_nbytes"),  # more than the sync
    (b'{"i":0,"i":0,"total":-1,"e":[]}', "metadata"),  # a duplicate key
    (b'{"i":0,"total":-1,"e":[],"extra":1}', "metadata"),  # a key no sender writes
]


def _used(raw: bytes) -> int:
    """Where the entries end (so that the header agrees and only the intended bound can trip)."""
    try:
        return max((e[3] + e[4] for e in json.loads(raw)["e"]), default=0)
    except Exception:
        return 300


@pytest.mark.parametrize("raw, field", _REGRESSIONS, ids=[f for _, f in _REGRESSIONS])
def test_regressions_are_refused(raw, field):
    h = fmt.Header(0, len(raw), _used(raw), _BUCKET)
    with pytest.raises(WeightSyncError, match=f"bucket 0 from rank 1.*: field '{field}'"):
        fmt.BucketMeta.decode(raw, h, "bucket 0 from rank 1")


@_HOSTILE
@given(st.binary(max_size=600))
@example(b"[" * 100_000)
@example(b"{}")
@example(b'{"i":0,"total":-1,"e":[]}')
def test_arbitrary_bytes(raw):
    decode_or_refuse(raw)


def _mutations():
    """A valid encoding with bytes flipped, cut, extended, or spliced in."""
    n = len(_GOOD_RAW)
    flip = st.tuples(st.just("flip"), st.integers(0, n - 1), st.integers(1, 255))
    cut = st.tuples(st.just("cut"), st.integers(0, n - 1), st.just(0))
    extend = st.tuples(st.just("extend"), st.binary(min_size=1, max_size=40), st.just(0))
    splice = st.tuples(st.just("splice"), st.integers(0, n), st.sampled_from(
        [b"9", b"-", b"0", b"\\ud800", b"[", b"]", b",", b'"', b"e9", b"99999999999999999999", b"null", b"\x80"]))
    return st.lists(st.one_of(flip, cut, extend, splice), min_size=1, max_size=4)


def mutate(raw: bytes, ops) -> bytes:
    b = bytearray(raw)
    for op, a, c in ops:
        if op == "flip" and a < len(b):
            b[a] ^= c
        elif op == "cut":
            del b[min(a, len(b)):]
        elif op == "extend":
            b += a
        elif op == "splice":
            b[a:a] = c
    return bytes(b)


@_HOSTILE
@given(_mutations())
def test_mutated_bytes(ops):
    decode_or_refuse(mutate(_GOOD_RAW, ops))


_json_values = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=True) | st.text(max_size=8)
    | st.integers(-(1 << 70), 1 << 70) | st.sampled_from([0, 1, -1, 255, 256, 4096, 8192, _INT64_MAX, 1 << 63])
    | st.sampled_from(["float32", "qint8", "uint4", "bool", "\ud800", "a", "b"]),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=4), kids, max_size=3),
    max_leaves=8,
)


def _paths(obj, prefix=()):
    """Every place in a JSON value: (path, value)."""
    yield prefix, obj
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))


def _replace(obj, path, value):
    if not path:
        return value
    obj[path[0]] = _replace(obj[path[0]], path[1:], value)
    return obj


_GOOD_OBJ = json.loads(_GOOD_RAW)
_GOOD_PATHS = [p for p, _ in _paths(_GOOD_OBJ)]
# Half the replacements are a number or string of the message itself (another entry's offset,
# another tensor's name): what makes entries overlap or repeat, which random values rarely do.
_GOOD_LEAVES = sorted({v for _, v in _paths(_GOOD_OBJ) if isinstance(v, (int, str)) and not isinstance(v, bool)}, key=repr)
_field_values = st.one_of(st.sampled_from(_GOOD_LEAVES), _json_values)


@_HOSTILE
@given(st.lists(st.tuples(st.sampled_from(_GOOD_PATHS), _field_values), min_size=1, max_size=3))
def test_mutated_fields(changes):
    """A field of a valid message replaced by an arbitrary JSON value (hits the deep checks that
    random bytes rarely reach)."""
    obj = json.loads(_GOOD_RAW)
    for path, value in changes:
        try:
            obj = _replace(obj, path, value)
        except (KeyError, IndexError, TypeError):
            pass  # an earlier change removed the place
    decode_or_refuse(json.dumps(obj, ensure_ascii=False, allow_nan=True).encode("utf-8", "surrogatepass"))


_int64 = st.one_of(st.integers(-(1 << 63), _INT64_MAX), st.sampled_from([0, 1, -1, 2, 256, _BUCKET, fmt.MAGIC, fmt.VERSION]))


@_HOSTILE
@given(st.binary(min_size=64, max_size=64), st.lists(st.tuples(st.integers(0, 7), _int64), max_size=3))
@example(struct.pack("<8q", *_GOOD_HEADER.encode()), [])
def test_header_from_arbitrary_int64s(raw, changes):
    """The header arrives as int64[8]: any values either decode within the bounds or are refused."""
    values = list(struct.unpack("<8q", raw))
    if changes:  # start from a valid header so that the later fields' checks are reached
        values = _GOOD_HEADER.encode()
        for i, v in changes:
            values[i] = v
    try:
        h = fmt.Header.decode(values, "bucket 0 from rank 1", 0)
    except WeightSyncError as e:
        assert "bucket 0 from rank 1: field" in str(e)
        return
    assert fmt.MIN_BUCKET_BYTES <= h.bucket_bytes <= fmt.MAX_BUCKET_BYTES
    assert 2 <= h.meta_nbytes <= fmt.MAX_META_BYTES and 0 <= h.used_bytes <= h.bucket_bytes
    assert not (h.aborted and h.used_bytes)


@_HOSTILE
@given(st.one_of(st.binary(max_size=300), _mutations().map(lambda ops: mutate(fmt.encode_offer(_GOOD[0][1].window), ops))))
def test_offer_bytes(raw):
    try:
        offer = fmt.decode_offer(raw, "the window offer", 2 * _BUCKET)
    except WeightSyncError as e:
        assert "the window offer: field" in str(e)
        return
    if offer is not None:
        assert len(offer.name) <= 255 and len(offer.host) <= 4096 and offer.nbytes == 2 * _BUCKET
        offer.name.encode("utf-8"), offer.host.encode("utf-8")


# --------------------------------------------------------------------------------------
# across buckets: what only the receiver can see
# --------------------------------------------------------------------------------------


def _bucket(index: int, entries: list[list], last: bool = False):
    raw = json.dumps({"i": index, "total": -1, "e": entries}).encode()
    h = fmt.Header(index, len(raw), max((e[3] + e[4] for e in entries), default=0), _BUCKET, last=last)
    return h, fmt.BucketMeta.decode(raw, h, f"bucket {index}")


@pytest.mark.parametrize("second, match", [
    (["a", "uint8", [8], 0, 8, 0, 8], "'a' was already received"),  # a whole tensor twice
    (["s", "float32", [5], 0, 12, 8, 20], "unexpected chunk of 's'"),  # chunk of another dtype
    (["s", "uint8", [4, 5], 0, 12, 8, 20], "unexpected chunk of 's'"),  # chunk of another shape
    (["s", "uint8", [20], 0, 4, 16, 20], "unexpected chunk of 's'"),  # a gap in the chunks
])
def test_receiver_refuses_inconsistent_buckets(second, match):
    first = _bucket(0, [["a", "uint8", [8], 0, 8, 0, 8], ["s", "uint8", [20], 256, 8, 0, 20]])
    with pytest.raises(WeightSyncError, match=match):
        unpack([first, _bucket(1, [second], last=True)])
    # and the consistent continuation is accepted (so the cases above fail for their reason)
    out = unpack([first, _bucket(1, [["s", "uint8", [20], 0, 12, 8, 20]], last=True)])
    assert [(n, tuple(t.shape)) for n, t in out] == [("a", (8,)), ("s", (20,))]
