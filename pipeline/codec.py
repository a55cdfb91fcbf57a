"""Wire codec for tensors crossing a pipeline-stage boundary.

What travels: forward, the subspace coordinates `c` (batch, seq, k) plus the token ids;
backward, `dL/dc` of the same shape. Dense mode sends the full hidden state the same way.

Frame layout (little-endian, no padding):

    offset 0  3 bytes   magic b"AGW"
           3  uint8     version (1)
           4  uint8     kind: 1 = float, 2 = tokens
           5  uint8     dtype code (see `_FLOAT_CODES` / `_TOKEN_CODES`)
           6  uint8     ndim, 1..4
           7  uint32 x ndim   dims, each > 0
           then the payload, exactly as long as the header implies.

Design choices:
- The header is fixed and tiny (7 + 4 * ndim bytes) so that a frame's exact size is a pure
  function of (shape, dtype): `float_frame_bytes` / `token_frame_bytes` let callers size gRPC
  limits and benchmarks check the codec against the formula.
- The sender picks the dtype; `decode` reads it from the header, so peers configured with
  different codecs still interoperate. `WireCodec.dtype` only governs what we send.
- int8 is per-row absmax: a row is one token's vector (all dims but the last), one float32
  scale per row precedes the int8 values. Rows are quantized independently because token
  norms differ by orders of magnitude; one scale per tensor would flush small rows to zero.
  Values are symmetric in [-127, 127] so that zero is exact and -128 is never produced.
- Frames come from other peers and are untrusted. Decoding checks every header field and
  computes the payload size from the header with Python integers (no overflow) and compares
  it with `max_bytes` and with the bytes actually present *before* anything is allocated. Every
  failure is a `WireFormatError` whose message says what was expected and what was found;
  no struct.error, IndexError or MemoryError escapes. Non-finite values are refused on both
  sides: a NaN crossing a boundary would silently poison every replica's average.
- Decoded tensors are fresh, writable float32 (or int64 for tokens): the conversion out of
  the wire dtype is itself the copy, so no tensor aliases the caller's read-only bytes. A caller
  may hand `decode` the tensor to write into (a pinned host buffer on a GPU worker), so the frame
  is widened straight into memory a device copies from.
- Everything is vectorized (numpy on the payload view, torch for quantization); bf16 is
  widened to float32 by a 16-bit shift, which is exact.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "WireFormatError",
    "FrameHeader",
    "peek_header",
    "WireCodec",
    "CheckedFrame",
    "encode_tokens",
    "decode_tokens",
    "token_width",
    "float_frame_bytes",
    "token_frame_bytes",
    "all_finite",
    "wire_bytes_per_token",
    "FLOAT_DTYPES",
    "MAGIC",
    "VERSION",
]

MAGIC = b"AGW"
VERSION = 1
MAX_NDIM = 4

_KIND_FLOAT = 1
_KIND_TOKENS = 2
_KIND_NAMES = {_KIND_FLOAT: "float", _KIND_TOKENS: "token"}

# dtype name -> wire code; float and token codes are disjoint so a confused kind is detectable.
_FLOAT_CODES = {"fp32": 1, "bf16": 2, "fp16": 3, "int8": 4}
_TOKEN_CODES = {"uint8": 16, "uint16": 17, "uint32": 18}
_FLOAT_NAMES = {code: name for name, code in _FLOAT_CODES.items()}
_TOKEN_NAMES = {code: name for name, code in _TOKEN_CODES.items()}
FLOAT_DTYPES = tuple(_FLOAT_CODES)

# Bytes per element of each wire dtype (int8 adds one float32 scale per row on top).
_ITEM_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "uint8": 1, "uint16": 2, "uint32": 4}
_TOKEN_NUMPY = {"uint8": "<u1", "uint16": "<u2", "uint32": "<u4"}
_SCALE_BYTES = 4

_PREFIX = struct.Struct("<3sBBBB")  # magic, version, kind, dtype, ndim


class WireFormatError(ValueError):
    """A frame (or a tensor to be framed) is malformed; the message says what and why."""


# ----------------------------------------------------------------------------- sizes


def _header_bytes(ndim: int) -> int:
    return _PREFIX.size + 4 * ndim


def _float_payload_bytes(shape: Sequence[int], dtype: str) -> int:
    elements = math.prod(shape)
    if dtype == "int8":
        return _SCALE_BYTES * (elements // shape[-1]) + elements
    return _ITEM_BYTES[dtype] * elements


def token_width(vocab_size: int) -> str:
    """The smallest unsigned wire dtype that holds every id in [0, vocab_size)."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 1 <= vocab_size <= 2**32:
        raise WireFormatError(f"vocab_size must be an integer in 1..2**32, got {vocab_size!r}")
    if vocab_size <= 2**8:
        return "uint8"
    if vocab_size <= 2**16:
        return "uint16"
    return "uint32"


def float_frame_bytes(shape: Sequence[int], dtype: str) -> int:
    """Exact length of `WireCodec(dtype).encode(t)` for a tensor of this shape."""
    _check_shape(tuple(shape), "tensor")
    if dtype not in _FLOAT_CODES:
        raise WireFormatError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype!r}")
    return _header_bytes(len(shape)) + _float_payload_bytes(shape, dtype)


def token_frame_bytes(shape: Sequence[int], vocab_size: int) -> int:
    """Exact length of `encode_tokens(t, vocab_size)` for ids of this shape."""
    _check_shape(tuple(shape), "tokens")
    return _header_bytes(len(shape)) + _ITEM_BYTES[token_width(vocab_size)] * math.prod(shape)


def wire_bytes_per_token(batch: int, seq: int, width: int, dtype: str, vocab_size: int | None = None) -> float:
    """Codec bytes per token of one (batch, seq, width) frame, plus its token-id frame if
    `vocab_size` is given (forward); transport framing is the caller's to add."""
    total = float_frame_bytes((batch, seq, width), dtype)
    if vocab_size is not None:
        total += token_frame_bytes((batch, seq), vocab_size)
    return total / (batch * seq)


# ----------------------------------------------------------------------------- helpers


def _check_shape(shape: tuple[int, ...], what: str) -> None:
    if not 1 <= len(shape) <= MAX_NDIM:
        raise WireFormatError(f"{what} must have 1..{MAX_NDIM} dims, got shape {list(shape)} (ndim {len(shape)})")
    for dim in shape:
        if not 0 < dim < 2**32:
            raise WireFormatError(f"{what} dims must be in 1..2**32-1, got shape {list(shape)}")


def _pack_header(kind: int, code: int, shape: tuple[int, ...]) -> bytes:
    return _PREFIX.pack(MAGIC, VERSION, kind, code, len(shape)) + struct.pack(f"<{len(shape)}I", *shape)


def _as_buffer(data: object) -> memoryview:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireFormatError(f"a frame must be bytes, got {type(data).__name__}")
    view = memoryview(data)
    if not view.c_contiguous:
        raise WireFormatError("a frame must be a contiguous bytes-like object")
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")  # a multi-byte memoryview would make len() count items, not bytes
    return view


@dataclass(frozen=True)
class FrameHeader:
    """What a frame's header declares, read without touching its payload (`peek_header`)."""

    kind: str  # "float" or "token"
    dtype: str
    shape: tuple[int, ...]
    frame_bytes: int  # header plus the payload the header implies


def peek_header(data: object, kind: str) -> FrameHeader | None:
    """The header of a `kind` ("float" or "token") frame, checked field by field as `decode` checks
    it, without reading the payload or comparing its length: what a server needs to refuse a
    declared shape before it builds (or even receives) the tensor. None when `data` stops before
    the header does (a stream's first part may carry only the beginning of a frame); a field that
    is present and wrong raises WireFormatError all the same."""
    codes = {name: code for code, name in _KIND_NAMES.items()}
    if kind not in codes:
        raise ValueError(f"kind must be one of {', '.join(codes)}, got {kind!r}")
    view = _as_buffer(data)
    if len(view) < _PREFIX.size:
        return None
    parsed = _check_prefix(view, codes[kind], partial=True)
    if parsed is None:
        return None
    dtype, shape = parsed
    return FrameHeader(kind, dtype, shape, _header_bytes(len(shape)) + _payload_bytes(codes[kind], shape, dtype))


def _payload_bytes(kind: int, shape: tuple[int, ...], dtype: str) -> int:
    if kind == _KIND_FLOAT:
        return _float_payload_bytes(shape, dtype)
    return _ITEM_BYTES[dtype] * math.prod(shape)


def _check_prefix(view: memoryview, kind: int, *, partial: bool = False) -> tuple[str, tuple[int, ...]] | None:
    """Magic, version, kind, dtype, ndim and dims of a frame expected to be of `kind`; (dtype, shape).

    Raises WireFormatError on the first bad field; the caller has checked the fixed prefix is there.
    `partial`: a view cut inside the dims is None instead of an error."""
    size = len(view)
    want = _KIND_NAMES[kind]
    magic, version, found_kind, code, ndim = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise WireFormatError(f"bad magic: expected {MAGIC!r}, found {bytes(magic)!r} (not an Agora wire frame)")
    if version != VERSION:
        raise WireFormatError(f"unsupported wire version: expected {VERSION}, found {version}")
    if found_kind != kind:
        found = f"a {_KIND_NAMES[found_kind]} frame" if found_kind in _KIND_NAMES else f"unknown kind {found_kind}"
        raise WireFormatError(f"expected a {want} frame, found {found}")
    names = _FLOAT_NAMES if kind == _KIND_FLOAT else _TOKEN_NAMES
    if code not in names:
        raise WireFormatError(
            f"unknown {want} dtype code {code}: expected one of "
            + ", ".join(f"{c} ({n})" for c, n in sorted(names.items()))
        )
    dtype = names[code]
    if not 1 <= ndim <= MAX_NDIM:
        raise WireFormatError(f"ndim must be in 1..{MAX_NDIM}, found {ndim}")
    header = _header_bytes(ndim)
    if size < header:
        if partial:
            return None
        raise WireFormatError(f"frame is {size} bytes, shorter than its {header}-byte header (ndim {ndim})")
    shape = struct.unpack_from(f"<{ndim}I", view, _PREFIX.size)
    if 0 in shape:
        raise WireFormatError(f"every dim must be positive, found shape {list(shape)}")
    return dtype, shape


def _read_header(view: memoryview, kind: int, max_bytes: int,
                 expected_shape: tuple[int | None, ...] | None) -> tuple[str, tuple[int, ...], int]:
    """Validate a frame's header against everything it implies; return (dtype, shape, payload offset).

    Nothing is allocated here beyond a few Python ints: the payload size is computed from the
    header and checked against `max_bytes` and the actual length before anyone reads it.
    """
    size = len(view)
    want = _KIND_NAMES[kind]
    if size > max_bytes:
        raise WireFormatError(f"{want} frame is {size} bytes, over the limit of {max_bytes}")
    if size < _PREFIX.size:
        raise WireFormatError(f"{want} frame is {size} bytes, shorter than the {_PREFIX.size}-byte header")
    dtype, shape = _check_prefix(view, kind)
    ndim = len(shape)
    header = _header_bytes(ndim)
    if expected_shape is not None:
        expected = tuple(expected_shape)
        if len(expected) != ndim or any(e is not None and e != s for e, s in zip(expected, shape)):
            shown = ", ".join("*" if e is None else str(e) for e in expected)
            raise WireFormatError(f"shape mismatch: expected [{shown}], found {list(shape)}")
    payload = _payload_bytes(kind, shape, dtype)
    if header + payload > max_bytes:
        raise WireFormatError(
            f"header claims shape {list(shape)} {dtype} = {header + payload} bytes, over the limit of {max_bytes}"
        )
    if size != header + payload:
        problem = "truncated" if size < header + payload else "trailing bytes"
        raise WireFormatError(
            f"{problem}: shape {list(shape)} {dtype} needs {header + payload} bytes, frame has {size}"
        )
    return dtype, shape, header


def _float32_cpu(tensor: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The tensor as contiguous CPU float32 and its max |value|, refusing NaN and Inf."""
    if not isinstance(tensor, torch.Tensor):
        raise WireFormatError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise WireFormatError(f"expected a floating-point tensor, got {tensor.dtype}")
    _check_shape(tuple(tensor.shape), "tensor")
    # Checked after the cast so that a float64 value beyond float32's range is caught too.
    values = tensor.detach().to(device="cpu", dtype=torch.float32).contiguous()
    # aminmax propagates NaN and sees Inf, in one pass that is ~20x faster than isfinite().all().
    low, high = (bound.item() for bound in torch.aminmax(values))
    if not (math.isfinite(low) and math.isfinite(high)):
        raise WireFormatError(
            f"refusing to encode a tensor with NaN or Inf values (or beyond float32 range), shape {list(values.shape)}"
        )
    return values, max(-low, high)


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN and no Inf in ``tensor`` (a floating-point one), by aminmax: one pass without an
    allocation, ~10x faster than ``isfinite().all()`` on this torch's CPU build (measured on a tiny
    stage's gradients: 150 us against 2 ms for all of them; an empty tensor is finite)."""
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor.detach())
    return math.isfinite(low.item()) and math.isfinite(high.item())


# ----------------------------------------------------------------------------- floats


@dataclass(frozen=True)
class CheckedFrame:
    """What `WireCodec.inspect` found in a well-formed float frame."""

    shape: tuple[int, ...]
    largest_magnitude: float  # max |value|


class WireCodec:
    """Encodes float tensors in one chosen wire dtype; decodes frames of any dtype."""

    def __init__(self, dtype: str = "fp32", max_bytes: int = 256 * 2**20):
        if dtype not in _FLOAT_CODES:
            raise ValueError(f"wire dtype must be one of {FLOAT_DTYPES}, got {dtype!r}")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive integer, got {max_bytes!r}")
        self.dtype = dtype
        self.max_bytes = max_bytes

    def __repr__(self) -> str:
        return f"WireCodec(dtype={self.dtype!r}, max_bytes={self.max_bytes})"

    def frame_bytes(self, shape: Sequence[int]) -> int:
        """Exact encoded length of a tensor of this shape in this codec's dtype."""
        return float_frame_bytes(shape, self.dtype)

    def encode(self, tensor: torch.Tensor) -> bytes:
        """Frame a float tensor (ndim 1..4, no empty dims, all finite) in this codec's dtype."""
        values, absmax = _float32_cpu(tensor)
        shape = tuple(values.shape)
        # Refuse to build what a peer with the same limit must refuse: fail here, with a clear cause.
        size = float_frame_bytes(shape, self.dtype)
        if size > self.max_bytes:
            raise WireFormatError(
                f"encoded shape {list(shape)} {self.dtype} would be {size} bytes, over the limit of {self.max_bytes}"
            )
        header = _pack_header(_KIND_FLOAT, _FLOAT_CODES[self.dtype], shape)
        if self.dtype == "fp32":
            return header + values.numpy().astype("<f4", copy=False).tobytes()
        if self.dtype == "int8":
            return header + _quantize_int8(values)
        narrow_dtype = torch.bfloat16 if self.dtype == "bf16" else torch.float16
        # Rounding is monotonic, so if the largest magnitude stays finite every value does.
        if not torch.tensor(absmax).to(narrow_dtype).isfinite():
            raise WireFormatError(f"refusing to encode: max |value| {absmax:.4g} overflows {self.dtype}")
        narrow = values.to(narrow_dtype)
        return header + narrow.view(torch.int16).numpy().astype("<i2", copy=False).tobytes()

    def check(self, data: bytes, *, expected_shape: tuple[int | None, ...] | None = None) -> tuple[int, ...]:
        """Everything `decode` checks (header, size, shape, no NaN or Inf), without building the tensor:
        the frame's shape (see `inspect`)."""
        return self.inspect(data, expected_shape=expected_shape).shape

    def inspect(self, data: bytes, *, expected_shape: tuple[int | None, ...] | None = None) -> CheckedFrame:
        """`check`, and the largest magnitude the frame carries, from the same pass. What a relay needs,
        which passes a frame on unchanged: fp32 and fp16 payloads are read in place (min and max of a
        zero-copy view: NaN propagates into both, an infinity is one of them), bf16 by its bits (the
        largest exponent-and-mantissa is the largest magnitude; all exponent bits set is Inf or NaN);
        int8 is decoded (its scales and range need it)."""
        view = _as_buffer(data)
        dtype, shape, offset = _read_header(view, _KIND_FLOAT, self.max_bytes, expected_shape)
        count = math.prod(shape)
        if dtype in ("fp32", "fp16"):
            values = np.frombuffer(view, dtype="<f4" if dtype == "fp32" else "<f2", count=count, offset=offset)
            low, high = float(values.min()), float(values.max())
            finite, largest = math.isfinite(low) and math.isfinite(high), max(-low, high)
        elif dtype == "bf16":
            bits = np.frombuffer(view, dtype="<u2", count=count, offset=offset)
            top = int((bits & 0x7FFF).max())
            finite = top < 0x7F80
            largest = float(np.array([top << 16], dtype=np.uint32).view(np.float32)[0])
        else:
            largest = float(self.decode(data, expected_shape=expected_shape).abs().max())
            finite = True
        if not finite:
            raise WireFormatError(f"{dtype} payload of shape {list(shape)} contains NaN or Inf")
        return CheckedFrame(shape, largest)

    def decode(self, data: bytes, *, expected_shape: tuple[int | None, ...] | None = None,
               out: Callable[[tuple[int, ...]], torch.Tensor] | None = None) -> torch.Tensor:
        """A fresh float32 tensor from a frame of any float dtype; WireFormatError if anything is off.

        `out`, given the frame's shape once the header is checked, returns the contiguous CPU float32
        tensor to decode into (a pinned staging buffer, pipeline/runtime.py): the widening out of the
        wire dtype then writes straight into it, with no intermediate copy."""
        view = _as_buffer(data)
        dtype, shape, offset = _read_header(view, _KIND_FLOAT, self.max_bytes, expected_shape)
        count = math.prod(shape)
        target = out(shape) if out is not None else torch.empty(shape, dtype=torch.float32)
        if target.dtype != torch.float32 or target.device.type != "cpu" or tuple(target.shape) != shape \
                or not target.is_contiguous():
            raise ValueError(f"decode: out must give a contiguous CPU float32 tensor of shape {list(shape)}")
        values = target.numpy().reshape(-1)
        if dtype == "fp32":
            np.copyto(values, np.frombuffer(view, dtype="<f4", count=count, offset=offset))
        elif dtype == "bf16":
            # bf16 is the top half of an fp32: widening by a shift is exact.
            bits = values.view(np.uint32)
            np.copyto(bits, np.frombuffer(view, dtype="<u2", count=count, offset=offset))
            bits <<= 16
        elif dtype == "fp16":
            np.copyto(values, np.frombuffer(view, dtype="<f2", count=count, offset=offset))
        else:
            np.copyto(values, _dequantize_int8(view, offset, shape).reshape(-1))
        if not np.isfinite(values).all():
            raise WireFormatError(f"{dtype} payload of shape {list(shape)} contains NaN or Inf")
        return target


def _quantize_int8(values: torch.Tensor) -> bytes:
    """Per-row absmax: float32 scales (rows,) then int8 values (rows, cols), round to nearest."""
    rows = values.reshape(-1, values.shape[-1])
    scale = rows.abs().amax(dim=1) / 127.0
    # A zero row (or one so small its scale underflows) keeps scale 0 and sends zeros;
    # dividing by 1 there rounds every element to 0 instead of producing 0/0.
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(1)
    quantized = torch.round(rows / divisor).clamp_(-127, 127).to(torch.int8)
    return scale.numpy().astype("<f4", copy=False).tobytes() + quantized.numpy().tobytes()


def _dequantize_int8(view: memoryview, offset: int, shape: tuple[int, ...]) -> np.ndarray:
    cols = shape[-1]
    rows = math.prod(shape) // cols
    scale = np.frombuffer(view, dtype="<f4", count=rows, offset=offset).astype(np.float32)
    if not (np.isfinite(scale).all() and (scale >= 0).all()):
        raise WireFormatError("int8 frame has a NaN, Inf or negative row scale")
    quantized = np.frombuffer(view, dtype=np.int8, count=rows * cols, offset=offset + _SCALE_BYTES * rows)
    if (quantized == -128).any():
        raise WireFormatError("int8 frame holds -128, outside the symmetric range [-127, 127] this codec sends")
    values = quantized.reshape(rows, cols).astype(np.float32)
    with np.errstate(over="ignore"):  # an overflow becomes Inf, which the caller rejects
        values *= scale[:, None]
    return values


# ----------------------------------------------------------------------------- tokens


def encode_tokens(tokens: torch.Tensor, vocab_size: int) -> bytes:
    """Frame integer token ids (ndim 1..4) in the smallest unsigned width that fits `vocab_size`."""
    width = token_width(vocab_size)
    if not isinstance(tokens, torch.Tensor):
        raise WireFormatError(f"expected a torch.Tensor of token ids, got {type(tokens).__name__}")
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise WireFormatError(f"token ids must be an integer tensor, got {tokens.dtype}")
    shape = tuple(tokens.shape)
    _check_shape(shape, "tokens")
    ids = tokens.detach().to(device="cpu", dtype=torch.int64)
    low, high = ids.min().item(), ids.max().item()
    if low < 0 or high >= vocab_size:
        raise WireFormatError(f"token ids must be in [0, {vocab_size}), found range [{low}, {high}]")
    payload = ids.numpy().astype(_TOKEN_NUMPY[width]).tobytes()
    return _pack_header(_KIND_TOKENS, _TOKEN_CODES[width], shape) + payload


def decode_tokens(data: bytes, vocab_size: int, *, max_bytes: int = 64 * 2**20,
                  expected_shape: tuple[int | None, ...] | None = None) -> torch.Tensor:
    """A fresh int64 tensor of token ids, each checked to be < `vocab_size`.

    Any unsigned width is accepted (a sender may use a wider one than needed); the range
    check on the values is what protects the embedding lookup downstream.
    """
    token_width(vocab_size)  # validates vocab_size itself
    view = _as_buffer(data)
    dtype, shape, offset = _read_header(view, _KIND_TOKENS, max_bytes, expected_shape)
    ids = np.frombuffer(view, dtype=_TOKEN_NUMPY[dtype], count=math.prod(shape), offset=offset)
    high = int(ids.max())
    if high >= vocab_size:
        raise WireFormatError(f"token id {high} is out of range: expected ids < vocab_size={vocab_size}")
    return torch.from_numpy(ids.astype(np.int64).reshape(shape))
