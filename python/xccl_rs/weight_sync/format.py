"""The weight-sync wire format: each message as a value that encodes itself, and a decoder that
checks every field it reads from the peer (type, range, length) and raises
:class:`WeightSyncError` naming the field.

The messages (the package docstring gives their order):

* **header** (:class:`Header`) -- ``int64[8]``, broadcast before every bucket:
  ``[MAGIC, VERSION, meta_nbytes, used_bytes, last, bucket_bytes, index, 0]``. ``last`` is 1
  on the sync's last bucket, 0 before it, and ``ABORTED`` (-1) on an abort notice;
  ``bucket_bytes`` is the sender's bucket size, the same in every header of a sync.
* **metadata** (:class:`BucketMeta`) -- ``meta_nbytes`` bytes of UTF-8 JSON after the header:
  ``{"i": index, "total": payload bytes of the sync or -1, "e": [entry, ...]}``, with
  ``"w": announcement`` in a sender's first bucket (index below the number of senders) when it
  offers a shared window; after an abort header, ``{"i": index, "abort": reason}``.
* **entry** (:class:`Entry`) -- one tensor, or one piece of a tensor, in a bucket:
  ``[name, dtype, shape, offset, nbytes, chunk_offset, total_nbytes]`` or, for a piece of a
  shard that is not a run of the tensor's flat bytes, the same and ``box``. ``offset`` is where
  its bytes start in the bucket, ``total_nbytes`` the whole tensor's size. Without a box,
  ``chunk_offset`` is where its bytes start in the tensor's flat (row-major) bytes: a tensor
  that is not split has ``chunk_offset`` 0 and ``nbytes == total_nbytes``. With a box,
  ``[[start, length], ...]`` (one pair per dimension: the shard is
  ``tensor[start_0:start_0 + length_0, ...]``), ``chunk_offset`` is where its bytes start in the
  shard's flat bytes. A ninth field (the eighth, ``box``, is then ``null`` for no box) is the
  entry's *encoding* (:class:`Encoding`), in syncs from a ``payload="delta"`` sender (delta.py):
  ``{"k": kind, "v": version, "b": base, "n": count, "d": dense_nbytes}``. It brings bytes
  ``[chunk_offset, chunk_offset + dense_nbytes)`` of the tensor (or shard) to version ``v``, and
  ``nbytes`` is then what the bucket holds of it: kind ``"full"`` the bytes themselves
  (``nbytes == dense_nbytes``, ``b`` 0); ``"idx"`` the ``n`` changed elements' new values, then
  (at the next multiple of 4 bytes) their ``n`` indices in the range as int32, strictly
  increasing; ``"bits"`` the ``n`` values, then a bitmap of the range's elements (bit ``j % 8``
  of byte ``j // 8``; the bits past the range are 0; ``n`` bits set). Both apply to the tensor
  the receiver holds at version ``b``, and to no other.
* **base list** (:class:`BaseList`) -- in a delta sync, right after the hello, each sender in
  turn broadcasts the versions of the tensors it can send as deltas: its length (``int64[1]``),
  then ``{"n": [name, ...], "v": [version, ...]}``. Every rank then gives, per listed tensor
  (the senders' lists one after another), 1 if it holds that version (a sender: 1), and a MIN
  all-reduce of these ``int32`` flags says which bases every receiver holds.
* **confirmation** -- at the end of a delta sync, every rank's ``int64[2]`` (all-gather):
  ``[status, tensors]``; ``status`` 0, or 1 when the rank could not apply ``tensors`` of the
  tensors it received (its error names them). Every rank raises when one did not.
* **announcement** (:class:`Announcement`) -- a shared window:
  ``{"name": file in /dev/shm, "host": host identity, "bytes": 2 * bucket_bytes, "reused": bool}``.
  Its second offer (window.py) travels as its length (``int64[1]``, 0 for no offer), then
  its JSON.
* **hello** (:class:`Hello`) -- ``int64[6]`` from every rank (all-gather), once per sync before
  anything else: ``[MAGIC, VERSION, senders, host, payload, sync]``; ``senders`` is a hash of
  the senders' group ranks, which every rank must give alike; ``host`` a hash of the host
  identity, or -1 for a rank that will not share memory (window.py, step 1); ``payload`` the
  sender's payload code (:data:`PAYLOADS`: 0 full, 1 delta, 2 fp8; -1 on a receiver), the
  same on every sender; ``sync`` the version a delta sync brings its tensors to (the first
  sender's is the sync's; 0 otherwise).
* **round record** (:class:`RoundRecord`) -- ``int64[6]`` from every rank (all-gather) before
  each round when there are several senders: ``[MAGIC, VERSION, round, status, plan, 0]``.
  ``status`` is ``RECEIVING`` on a receiver, and on a sender ``SENDING``, ``FINAL`` (its last
  round) or ``ABORTED`` (its producer failed: the first such sender then sends an abort
  notice); ``plan`` is a hash of every tensor planned so far (names, dtypes, shapes,
  placements), 0 on a receiver.
* The votes (``int32[1]``, MIN all-reduce) of window.py carry no structure.

All sizes are Python ints or int64: buckets and tensors of 2 GiB and more work. Both sides are
always the same version of xccl_rs (``VERSION`` changes whenever any of this does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ._common import WeightSyncError

MAGIC = 0x58434C5753594E43  # "XCLWSYNC"
#: 2: the second window offer is not voted on when the sender offered nothing.
#: 3: several senders (the hello, round records, boxes, a window in each sender's first bucket).
#: 4: payloads (the hello's payload and sync fields, entry encodings, the base list, the confirmation).
VERSION = 4
HEADER_LEN = 8
ABORTED = -1  # a header's `last` field on an abort notice
MIN_BUCKET_BYTES = 256
DEFAULT_BUCKET_BYTES = 512 << 20
MAX_BUCKET_BYTES = 1 << 40
MAX_META_BYTES = 1 << 30
MAX_OFFER_BYTES = 1 << 16
MAX_ABORT_CHARS = 2000
#: A tensor name's length, in characters (state_dict keys are far shorter).
MAX_NAME_CHARS = 4096
#: One tensor's bytes: a split tensor is allocated whole on the receiver before its chunks arrive.
MAX_TENSOR_BYTES = 1 << 40
MAX_DIMS = 64
#: The payloads a sender can send (``WeightSender(payload=...)``), by their code in the hello.
PAYLOADS = {"full": 0, "delta": 1, "fp8": 2}
PAYLOAD_NAMES = {v: k for k, v in PAYLOADS.items()}
NO_PAYLOAD = -1  # a receiver's hello
#: Entry encodings (module docstring) of a delta sync.
ENCODINGS = ("full", "idx", "bits")
#: A base list's bytes (a few dozen per tensor).
MAX_BASE_LIST_BYTES = 1 << 30
_MAX_INT64 = (1 << 63) - 1

#: The dtypes that travel: every one can be allocated, viewed from bytes and copied on CPU.
#: Not the quantized ones (no strided allocation) nor the sub-byte int1..7/uint1..7 (no copy).
_DTYPE_NAMES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2", "bcomplex32", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2",
)
#: canonical name -> dtype, for the dtypes this torch has (older ones lack some float8s).
DTYPES: dict[str, torch.dtype] = {
    n: getattr(torch, n) for n in _DTYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)
}


# --------------------------------------------------------------------------------------
# field checks (every value read from the peer goes through one of these)
# --------------------------------------------------------------------------------------


def _bad(where: str, name: str, value: Any, expected: str) -> WeightSyncError:
    shown = f"{value:#x}" if name == "magic" and type(value) is int else repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return WeightSyncError(f"weight sync: {where}: field {name!r} is {shown}, expected {expected}")


def _int(where: str, name: str, value: Any, lo: int, hi: int, expected: Optional[str] = None) -> int:
    """``value`` as an int in [lo, hi] (JSON's true/false and floats are not ints here)."""
    if type(value) is not int:
        raise _bad(where, name, value, "an integer")
    if not lo <= value <= hi:
        raise _bad(where, name, value, expected or (f"{lo}" if lo == hi else f"in [{lo}, {hi}]"))
    return value


def _str(where: str, name: str, value: Any, max_len: int) -> str:
    if not isinstance(value, str):
        raise _bad(where, name, value, "a string")
    if len(value) > max_len:
        raise _bad(where, name, value, f"at most {max_len} characters")
    try:
        # JSON's "\ud800" escapes decode to lone surrogates, which no UTF-8 string holds (and
        # which fail later, wherever the name is encoded again).
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(where, name, value, "valid Unicode (it has a lone surrogate)") from None
    return value


def _no_duplicate_keys(pairs: list) -> dict:
    obj: dict = {}
    for k, v in pairs:
        if k in obj:
            raise ValueError(f"duplicate key {k[:80]!r}")  # else the last one would silently win
        obj[k] = v
    return obj


def _json(raw: bytes, where: str, name: str) -> dict:
    try:
        obj = json.loads(bytes(raw).decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        # RecursionError: "[[[[..." nested past the interpreter's limit (the scanner stops there).
        raise WeightSyncError(f"weight sync: {where}: field {name!r} is not UTF-8 JSON ({e})") from None
    if not isinstance(obj, dict):
        raise _bad(where, name, obj, "a JSON object")
    return obj


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: Any, where: str = "metadata") -> torch.dtype:
    """The dtype a name in the metadata stands for (``"bfloat16"`` -> ``torch.bfloat16``): only
    the canonical names of :data:`DTYPES` (no aliases such as ``"float"``)."""
    dt = DTYPES.get(name) if isinstance(name, str) else None
    if dt is None:
        raise _bad(where, "dtype", name, "the name of a supported torch dtype (" + ", ".join(DTYPES) + ")")
    return dt


def check_dtype(dtype: torch.dtype, name: str) -> None:
    """The sender's check that ``dtype`` can travel (the receiver would refuse it)."""
    if dtype_name(dtype) not in DTYPES:
        raise TypeError(f"{name!r} has dtype {dtype}, which weight sync does not support")


def check_length(n: Any, where: str, name: str, limit: int) -> int:
    """A byte count read from the peer (a tensor length to allocate): an int in [0, limit]."""
    return _int(where, name, n, 0, limit)


# --------------------------------------------------------------------------------------
# the messages
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Header:
    """The ``int64[8]`` before every bucket (module docstring)."""

    index: int
    meta_nbytes: int
    used_bytes: int
    bucket_bytes: int
    last: bool = False
    aborted: bool = False

    def encode(self) -> list[int]:
        last = ABORTED if self.aborted else int(self.last)
        return [MAGIC, VERSION, self.meta_nbytes, self.used_bytes, last, self.bucket_bytes, self.index, 0]

    @classmethod
    def decode(cls, values: Any, where: str, index: int, bucket_bytes: Optional[int] = None) -> "Header":
        """The header of bucket ``index``; ``bucket_bytes`` is bucket 0's (every header must agree)."""
        if not isinstance(values, (list, tuple)) or len(values) != HEADER_LEN:
            raise _bad(where, "header", values, f"{HEADER_LEN} integers")
        magic, version, meta_nbytes, used, last, bucket, got_index, reserved = values
        if magic != MAGIC or type(magic) is not int:
            raise _bad(
                where, "magic", magic,
                f"{MAGIC:#x} (not a weight-sync header: every rank of the group must call send/receive "
                "in the same order)",
            )
        _int(where, "version", version, VERSION, VERSION, f"{VERSION} (every rank must run the same xccl_rs)")
        if bucket_bytes is None:
            _int(where, "bucket_bytes", bucket, MIN_BUCKET_BYTES, MAX_BUCKET_BYTES)
        else:
            _int(where, "bucket_bytes", bucket, bucket_bytes, bucket_bytes, f"{bucket_bytes}, as in bucket 0")
        _int(where, "index", got_index, index, index, f"{index} (the next bucket)")
        _int(where, "last", last, ABORTED, 1, f"0, 1 or {ABORTED} (aborted)")
        aborted = last == ABORTED
        _int(where, "used_bytes", used, 0, 0 if aborted else bucket)
        _int(where, "meta_nbytes", meta_nbytes, 2, MAX_META_BYTES)  # "{}" at least
        _int(where, "reserved", reserved, 0, 0)
        return cls(got_index, meta_nbytes, used, bucket, last=last == 1, aborted=aborted)


def _align4(n: int) -> int:
    return (n + 3) // 4 * 4


@dataclass(frozen=True)
class Encoding:
    """How an entry's bytes bring a range of a tensor to a version (module docstring)."""

    kind: str  # one of ENCODINGS
    version: int
    base: int  # 0 for "full"
    count: int  # changed elements ("idx", "bits"); the range's elements for "full"
    dense: int  # the range's bytes in the tensor

    def wire_nbytes(self, elsize: int) -> int:
        """What the bucket holds of it."""
        if self.kind == "full":
            return self.dense
        if self.kind == "idx":
            return _align4(self.count * elsize) + 4 * self.count
        return self.count * elsize + (self.dense // elsize + 7) // 8

    def encode(self) -> dict:
        return {"k": self.kind, "v": self.version, "b": self.base, "n": self.count, "d": self.dense}

    @classmethod
    def decode(cls, raw: Any, where: str, elsize: int, dense_limit: int) -> "Encoding":
        if not isinstance(raw, dict) or set(raw) != {"k", "v", "b", "n", "d"}:
            raise _bad(where, "encoding", raw, 'a JSON object of exactly "k", "v", "b", "n" and "d"')
        kind = raw["k"]
        if kind not in ENCODINGS:
            raise _bad(where, "encoding.k", kind, " or ".join(map(repr, ENCODINGS)))
        version = _int(where, "encoding.v", raw["v"], 1, _MAX_INT64)
        if kind == "full":
            base = _int(where, "encoding.b", raw["b"], 0, 0, "0 (a full range has no base)")
        else:
            base = _int(where, "encoding.b", raw["b"], 1, _MAX_INT64)
            if base == version:
                raise _bad(where, "encoding.b", base, f"a version other than the one it brings ({version})")
        dense = _int(where, "encoding.d", raw["d"], 0, dense_limit)
        if dense % elsize:
            raise _bad(where, "encoding.d", dense, f"a multiple of the element size {elsize}")
        elements = dense // elsize
        if kind == "full":
            count = _int(where, "encoding.n", raw["n"], elements, elements, f"{elements} (the range's elements)")
        else:
            count = _int(where, "encoding.n", raw["n"], 0, elements, f"in [0, {elements}] (the range's elements)")
        return cls(kind, version, base, count, dense)


@dataclass(frozen=True)
class Entry:
    """One tensor, or one piece of a tensor, in a bucket (module docstring)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    chunk_offset: int
    total: int
    #: The shard this piece belongs to, ``((start, length), ...)`` per dimension, when it is not
    #: a run of the tensor's flat bytes (``chunk_offset`` then counts in the shard's bytes).
    box: Optional[tuple[tuple[int, int], ...]] = None
    #: How the bytes encode the range (a delta sync), or None: they are the range itself.
    enc: Optional[Encoding] = None

    @property
    def end(self) -> int:
        """Where its bytes end in the bucket."""
        return self.offset + self.nbytes

    @property
    def dense(self) -> int:
        """The bytes of the tensor (or shard) it covers, from ``chunk_offset``."""
        return self.nbytes if self.enc is None else self.enc.dense

    @property
    def whole(self) -> bool:
        """The whole tensor (not a piece of one)."""
        return self.chunk_offset == 0 and self.dense == self.total and self.box is None

    def encode(self) -> list:
        out = [self.name, dtype_name(self.dtype), list(self.shape), self.offset, self.nbytes, self.chunk_offset, self.total]
        if self.box is not None or self.enc is not None:
            out.append(None if self.box is None else [list(b) for b in self.box])
        if self.enc is not None:
            out.append(self.enc.encode())
        return out

    @classmethod
    def decode(cls, raw: Any, where: str, used_bytes: int) -> "Entry":
        """An entry of a bucket whose first ``used_bytes`` bytes are sent."""
        if not isinstance(raw, list) or len(raw) not in (7, 8, 9):
            raise _bad(
                where, "entry", raw, "[name, dtype, shape, offset, nbytes, chunk_offset, total_nbytes(, box(, encoding))]"
            )
        name, dname, shape, offset, nbytes, chunk_offset, total = raw[:7]
        where = f"{where} ({_str(where, 'name', name, MAX_NAME_CHARS)[:100]!r})"
        dtype = dtype_of(dname, where)
        if not isinstance(shape, list) or len(shape) > MAX_DIMS:
            raise _bad(where, "shape", shape, f"a list of at most {MAX_DIMS} dimensions")
        numel, span = 1, 1
        for s in shape:
            s = _int(where, "shape", s, 0, _MAX_INT64)
            numel *= s
            span *= max(s, 1)  # torch computes contiguous strides with zero sizes as 1
        elsize = dtype.itemsize
        if span > _MAX_INT64:  # the strides (in elements), even of a zero-size tensor, must fit
            raise _bad(where, "shape", shape, "sizes whose product (zeros as ones) fits in int64")
        _int(where, "total_nbytes", total, numel * elsize, numel * elsize, f"{numel * elsize} ({shape} of {dname})")
        _int(where, "total_nbytes", total, 0, MAX_TENSOR_BYTES)
        box = None
        span_bytes = total  # the bytes chunk_offset counts in: the tensor's, or its shard's
        if len(raw) >= 8 and (raw[7] is not None or len(raw) == 8):
            box, span_bytes = _decode_box(raw[7], where, shape, elsize)
        _int(where, "offset", offset, 0, used_bytes, f"in [0, {used_bytes}] (the bucket's used bytes)")
        _int(where, "chunk_offset", chunk_offset, 0, span_bytes)
        if len(raw) == 9:
            return cls._decode_encoded(raw[8], where, name, dtype, tuple(shape), offset, nbytes, chunk_offset, total,
                                       box, span_bytes, used_bytes)
        _int(where, "nbytes", nbytes, 1 if span_bytes else 0, min(span_bytes - chunk_offset, used_bytes - offset),
             f"in [{1 if span_bytes else 0}, {min(span_bytes - chunk_offset, used_bytes - offset)}] (within the "
             f"{'shard' if box else 'tensor'} from chunk_offset {chunk_offset}, and within the bucket's {used_bytes} "
             f"used bytes from offset {offset})")
        for what, v in (("offset", offset), ("nbytes", nbytes), ("chunk_offset", chunk_offset)):
            if v % elsize:
                raise _bad(where, what, v, f"a multiple of {dname}'s {elsize} bytes")
        return cls(name, dtype, tuple(shape), offset, nbytes, chunk_offset, total, box)

    @classmethod
    def _decode_encoded(cls, raw, where, name, dtype, shape, offset, nbytes, chunk_offset, total, box, span_bytes,
                        used_bytes) -> "Entry":
        """An entry with an encoding: its range within the tensor (or shard), its bytes within the
        bucket, exactly as many as the encoding says, aligned for its values and indices."""
        elsize = dtype.itemsize
        enc = Encoding.decode(raw, where, elsize, span_bytes - chunk_offset)
        if span_bytes and enc.dense == 0:
            raise _bad(where, "encoding.d", 0, "at least one element")
        want = enc.wire_nbytes(elsize)
        _int(where, "nbytes", nbytes, want, want, f"{want} (what its encoding {enc.encode()} takes)")
        _int(where, "nbytes", nbytes, 0, used_bytes - offset, f"within the bucket's {used_bytes} used bytes from {offset}")
        align = max(elsize, 4) if enc.kind == "idx" else elsize
        for what, v, a in (("offset", offset, align), ("chunk_offset", chunk_offset, elsize)):
            if v % a:
                raise _bad(where, what, v, f"a multiple of {a}")
        return cls(name, dtype, shape, offset, nbytes, chunk_offset, total, box, enc)


def _decode_box(raw: Any, where: str, shape: list, elsize: int) -> tuple[tuple[tuple[int, int], ...], int]:
    """A shard's box within ``shape`` (one ``[start, length]`` per dimension, not empty), and its bytes."""
    if not isinstance(raw, list) or len(raw) != len(shape) or not shape:
        raise _bad(where, "box", raw, f"a list of {len(shape)} [start, length] pairs (one per dimension)")
    box, nbytes = [], elsize
    for d, (pair, size) in enumerate(zip(raw, shape)):
        if not isinstance(pair, list) or len(pair) != 2:
            raise _bad(where, "box", raw, f"[start, length] for dimension {d}")
        start = _int(where, "box", pair[0], 0, size, f"a start in [0, {size}] for dimension {d}")
        length = _int(where, "box", pair[1], 1, size - start,
                      f"a length in [1, {size - start}] for dimension {d} (from start {start})")
        box.append((start, length))
        nbytes *= length
    return tuple(box), nbytes


@dataclass(frozen=True)
class Announcement:
    """A shared window, as receivers need it to map it (module docstring)."""

    name: str
    host: str
    nbytes: int
    reused: bool = False

    def encode(self) -> dict:
        return {"name": self.name, "host": self.host, "bytes": self.nbytes, "reused": self.reused}

    @classmethod
    def decode(cls, obj: Any, where: str, nbytes: int, prefix: str = "w") -> "Announcement":
        """A window of two buckets, ``nbytes`` in all (the header's bucket size says how many)."""
        if not isinstance(obj, dict) or set(obj) - {"name", "host", "bytes", "reused"}:
            raise _bad(where, prefix, obj, "a JSON object of name, host, bytes and reused")
        name = _str(where, f"{prefix}.name", obj.get("name"), 255)
        host = _str(where, f"{prefix}.host", obj.get("host"), 4096)
        _int(where, f"{prefix}.bytes", obj.get("bytes"), nbytes, nbytes, f"{nbytes} (two buckets)")
        reused = obj.get("reused")
        if not isinstance(reused, bool):
            raise _bad(where, f"{prefix}.reused", reused, "true or false")
        return cls(name, host, nbytes, reused)


@dataclass(frozen=True)
class BucketMeta:
    """A bucket's metadata (module docstring); ``abort`` is set on an abort notice."""

    index: int
    entries: list[Entry] = field(default_factory=list)
    total: int = -1
    window: Optional[Announcement] = None
    abort: Optional[str] = None

    def encode(self) -> bytes:
        if self.abort is not None:
            obj: dict = {"i": self.index, "abort": self.abort[:MAX_ABORT_CHARS]}
        else:
            obj = {"i": self.index, "total": self.total, "e": [e.encode() for e in self.entries]}
            if self.window is not None:
                obj["w"] = self.window.encode()
        raw = _dumps(obj)
        if len(raw) > MAX_META_BYTES:
            raise WeightSyncError(
                f"weight sync: bucket {self.index}: metadata of {len(raw)} bytes for {len(self.entries)} "
                f"entries, above the limit of {MAX_META_BYTES}"
            )
        return raw

    @classmethod
    def decode(cls, raw: bytes, header: Header, where: str, senders: int = 1) -> "BucketMeta":
        """The metadata that followed ``header``, in a sync of ``senders`` senders."""
        obj = _json(raw, where, "metadata")
        # Both sides run the same version: a key it does not know is not from a sender.
        keys = {"i", "abort"} if header.aborted else {"i", "total", "e", "w"}
        if set(obj) - keys:
            raise _bad(where, "metadata", sorted(obj), f"only the keys {sorted(keys)}")
        _int(where, "i", obj.get("i"), header.index, header.index)
        if header.aborted:
            return cls(header.index, abort=_str(where, "abort", obj.get("abort"), MAX_ABORT_CHARS))
        total = _int(where, "total", obj.get("total"), -1, _MAX_INT64)
        raw_entries = obj.get("e")
        if not isinstance(raw_entries, list):
            raise _bad(where, "e", raw_entries, "a list of entries")
        entries = [Entry.decode(e, f"{where}, entry {k}", header.used_bytes) for k, e in enumerate(raw_entries)]
        seen: set[str] = set()
        prev_end = 0
        for k, e in enumerate(entries):
            ew = f"{where}, entry {k} ({e.name[:100]!r})"
            # A bucket holds at most one piece of a tensor: a repeated name would hand the
            # receiver two tensors of one name (or two chunks to reassemble out of order).
            if e.name in seen:
                raise _bad(ew, "name", e.name, "a name not already in this bucket")
            seen.add(e.name)
            # The sender packs entries in order without overlap: overlapping ones would read the
            # same bytes twice.
            if e.nbytes:
                if e.offset < prev_end:
                    raise _bad(ew, "offset", e.offset, f"at least {prev_end} (where the previous entry ends)")
                prev_end = e.end
            if total >= 0 and e.total > total:
                raise _bad(ew, "total_nbytes", e.total, f"at most the sync's total of {total} bytes")
        used = max((e.end for e in entries), default=0)
        if used != header.used_bytes:
            raise _bad(where, "used_bytes", header.used_bytes, f"{used} (where the entries end)")
        window = None
        if "w" in obj:
            if header.index >= senders:
                first = "only in bucket 0" if senders == 1 else f"only in a sender's first bucket (index below {senders})"
                raise _bad(where, "w", obj["w"], first)
            window = Announcement.decode(obj["w"], where, 2 * header.bucket_bytes)
        return cls(header.index, entries, total, window)


def encode_offer(offer: Optional[Announcement]) -> bytes:
    """The second offer of a window (window.py): its JSON, empty for no offer."""
    return b"" if offer is None else _dumps(offer.encode())


def decode_offer(raw: bytes, where: str, nbytes: int) -> Optional[Announcement]:
    if not raw:
        return None
    return Announcement.decode(_json(raw, where, "offer"), where, nbytes, prefix="offer")


def _record(values: Any, where: str, length: int, what: str) -> list:
    if not isinstance(values, (list, tuple)) or len(values) != length:
        raise _bad(where, what, values, f"{length} integers")
    magic, version = values[0], values[1]
    if magic != MAGIC or type(magic) is not int:
        raise _bad(where, "magic", magic, f"{MAGIC:#x} (every rank of the group must call send/receive in the same order)")
    _int(where, "version", version, VERSION, VERSION, f"{VERSION} (every rank must run the same xccl_rs)")
    return list(values[2:])


@dataclass(frozen=True)
class Hello:
    """One rank's ``int64[6]`` at the start of a sync (module docstring)."""

    senders: int
    host: int
    payload: int = NO_PAYLOAD
    sync: int = 0

    def encode(self) -> list[int]:
        return [MAGIC, VERSION, self.senders, self.host, self.payload, self.sync]

    @classmethod
    def decode(cls, values: Any, where: str) -> "Hello":
        senders, host, payload, sync = _record(values, where, 6, "hello")
        _int(where, "senders", senders, 0, _MAX_INT64)
        _int(where, "host", host, -1, _MAX_INT64)
        _int(where, "payload", payload, NO_PAYLOAD, max(PAYLOAD_NAMES))
        _int(where, "sync", sync, 0, _MAX_INT64)
        return cls(senders, host, payload, sync)


@dataclass(frozen=True)
class BaseList:
    """The tensors a sender of a delta sync can send as deltas, and the version of each (module
    docstring)."""

    names: tuple[str, ...]
    versions: tuple[int, ...]

    def encode(self) -> bytes:
        return _dumps({"n": list(self.names), "v": list(self.versions)})

    @classmethod
    def decode(cls, raw: bytes, where: str) -> "BaseList":
        obj = _json(raw, where, "base list")
        if set(obj) != {"n", "v"}:
            raise _bad(where, "base list", sorted(obj), 'exactly the keys "n" and "v"')
        names, versions = obj["n"], obj["v"]
        if not isinstance(names, list) or not isinstance(versions, list) or len(names) != len(versions):
            raise _bad(where, "base list", obj, "two lists of the same length")
        names = [_str(where, "n", n, MAX_NAME_CHARS) for n in names]
        if len(set(names)) != len(names):
            raise _bad(where, "n", names, "names listed once each")
        versions = [_int(where, "v", v, 1, _MAX_INT64) for v in versions]
        return cls(tuple(names), tuple(versions))


#: A round record's ``status`` (module docstring).
RECEIVING, SENDING, FINAL, ABORTED_ROUND = 0, 1, 2, 3
STATUS_NAMES = {RECEIVING: "receiving", SENDING: "sending", FINAL: "sending its last round", ABORTED_ROUND: "aborted"}


@dataclass(frozen=True)
class RoundRecord:
    """One rank's ``int64[6]`` before a round of a sync with several senders (module docstring)."""

    round: int
    status: int
    plan: int = 0

    def encode(self) -> list[int]:
        return [MAGIC, VERSION, self.round, self.status, self.plan, 0]

    @classmethod
    def decode(cls, values: Any, where: str, round: int) -> "RoundRecord":
        got_round, status, plan, reserved = _record(values, where, 6, "round record")
        _int(where, "round", got_round, round, round, f"{round} (the next round)")
        _int(where, "status", status, RECEIVING, ABORTED_ROUND)
        _int(where, "plan", plan, 0, _MAX_INT64)
        _int(where, "reserved", reserved, 0, 0)
        return cls(got_round, status, plan)
