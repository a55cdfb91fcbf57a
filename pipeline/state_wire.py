"""A stage's state as one byte stream, without pickle: what a joining replica downloads.

The state (parameters, optimizer moments and counters, averaging state: nested dicts, lists and
tuples of tensors and plain scalars) becomes

    [8-byte big-endian manifest length][manifest: JSON][every tensor's raw bytes, in manifest order]

The manifest holds the tree with each tensor replaced by its index, and each tensor's dtype and
shape. Design choices:

- No pickle on the way in. A donor is another admitted peer, not a trusted one: `torch.load` of
  its bytes would run whatever it sent. Here the receiver parses JSON (bounded in size and depth),
  allows a fixed set of dtypes, and allocates only what the manifest declares once the declared
  sizes add up to the stream's length and fit the receiver's own bound (its stage's state size).
- Containers are tagged (`{"m": [[key, value], ...]}` for a dict, `"l"` a list, `"u"` a tuple,
  `"t"` a tensor index), so a dict keeps non-string keys (the optimizer's parameter indices) and a
  tuple stays a tuple (AdamW's betas): the received tree equals the sent one, not a JSON cousin.
  Floats go through JSON's shortest round-trip form (non-finite ones as JSON's NaN/Infinity), so
  they come back bit for bit.
- Sender side: `StateStream` serves any byte range of the stream from the tensors themselves
  (one chunk's copy at a time, no serialized copy of the state), so a donor's snapshot costs one
  clone of the state and resumes are a matter of offsets.
- Receiver side: `StateReceiver` takes the stream in order, parses the manifest as soon as it is
  in, allocates the tensors and copies every later chunk straight into them, so a download needs
  the state's memory once (not a buffer and then the tensors). It hashes what it received; the
  caller compares the digest with the donor's before using the state.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["StateWireError", "StateStream", "StateReceiver", "encode_state", "state_bytes", "FORMAT"]

FORMAT = "agora-stage-state/1"
_PREFIX = struct.Struct(">Q")
# The manifest of a pluralis-8b body stage (a few hundred tensors) is tens of KiB.
MAX_MANIFEST_BYTES = 16 * 2**20
_MAX_DEPTH = 32
_DTYPES = {name: getattr(torch, name) for name in (
    "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class StateWireError(ValueError):
    """A stream that is not a stage state this receiver accepts; the message says why."""


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes (contiguous, CPU), without a copy where it already is."""
    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous() or flat.device.type != "cpu":
        flat = flat.contiguous().cpu()
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _nbytes(dtype: torch.dtype, shape: list[int]) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def encode_state(tree: Any) -> tuple[bytes, list[torch.Tensor]]:
    """(the stream's prefix and manifest, the tensors in stream order) for `tree`."""
    tensors: list[torch.Tensor] = []

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if value.dtype not in _DTYPE_NAMES:
                raise StateWireError(f"tensor dtype {value.dtype} is not one a stage state may carry")
            tensors.append(value.detach().cpu())
            return {"t": len(tensors) - 1}
        if isinstance(value, dict):
            return {"m": [[walk(k), walk(v)] for k, v in value.items()]}
        if isinstance(value, list):
            return {"l": [walk(v) for v in value]}
        if isinstance(value, tuple):
            return {"u": [walk(v) for v in value]}
        if value is None or isinstance(value, (str, bool, int, float)):
            return value
        raise StateWireError(f"a stage state holds tensors and plain scalars, not {type(value).__name__}")

    manifest = {"format": FORMAT, "state": walk(tree),
                "tensors": [{"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape)} for t in tensors]}
    text = json.dumps(manifest, separators=(",", ":")).encode()
    return _PREFIX.pack(len(text)) + text, tensors


def state_bytes(tree: Any) -> int:
    """The length of `tree`'s stream (what a receiver should expect for a state shaped like it)."""
    head, tensors = encode_state(tree)
    return len(head) + sum(t.numel() * t.element_size() for t in tensors)


class StateStream:
    """The stream of one state, served by byte range from its tensors (which must not change)."""

    def __init__(self, tree: Any):
        self._head, self._tensors = encode_state(tree)
        self._segments = [memoryview(self._head)] + [_byte_view(t) for t in self._tensors]
        self._starts = []
        position = 0
        for segment in self._segments:
            self._starts.append(position)
            position += len(segment)
        self.total_bytes = position

    def read(self, offset: int, size: int) -> bytes:
        """Bytes [offset, offset + size) of the stream (fewer at its end)."""
        if not 0 <= offset <= self.total_bytes:
            raise ValueError(f"offset {offset} is outside the stream's {self.total_bytes} bytes")
        end = min(self.total_bytes, offset + size)
        pieces = []
        for start, segment in zip(self._starts, self._segments):
            stop = start + len(segment)
            if stop <= offset or start >= end:
                continue
            pieces.append(segment[max(offset, start) - start:min(end, stop) - start])
        return b"".join(pieces)

    def sha256(self) -> str:
        digest = hashlib.sha256()
        for segment in self._segments:
            digest.update(segment)
        return digest.hexdigest()


@dataclass
class _Slot:
    start: int  # offset in the stream
    view: memoryview  # the allocated tensor's bytes


class StateReceiver:
    """Rebuilds a state from its stream, received in order (see the module docstring).

    `total_bytes`: the length the donor announced; `max_bytes`: the most this receiver accepts
    (a bound from its own stage's state, so a peer cannot make it allocate without limit)."""

    def __init__(self, total_bytes: int, *, max_bytes: int):
        if not _PREFIX.size < total_bytes <= max_bytes:
            raise StateWireError(f"the announced state is {total_bytes} bytes; this stage's state is at most "
                                 f"{max_bytes}")
        self.total_bytes = total_bytes
        self.received = 0
        self._hash = hashlib.sha256()
        self._head = bytearray()
        self._head_length: Optional[int] = None
        self._tree: Any = None
        self._tensors: list[torch.Tensor] = []
        self._slots: list[_Slot] = []

    @property
    def complete(self) -> bool:
        return self.received == self.total_bytes

    def add(self, data: bytes) -> None:
        """The next bytes of the stream (what follows `received`)."""
        if self.received + len(data) > self.total_bytes:
            raise StateWireError(f"the donor sent more than the {self.total_bytes} bytes it announced")
        self._hash.update(data)
        view = memoryview(data)
        while len(view):
            if self._tree is None:
                view = self._take_head(view)
            else:
                view = self._take_tensor_bytes(view)

    def _take_head(self, view: memoryview) -> memoryview:
        if self._head_length is None:
            need = _PREFIX.size - len(self._head)
            self._head += view[:need]
            self.received += min(need, len(view))
            view = view[need:]
            if len(self._head) < _PREFIX.size:
                return view
            (self._head_length,) = _PREFIX.unpack(bytes(self._head))
            self._head.clear()
            if not 0 < self._head_length <= min(MAX_MANIFEST_BYTES, self.total_bytes - _PREFIX.size):
                raise StateWireError(f"manifest of {self._head_length} bytes: not within the stream "
                                     f"(at most {MAX_MANIFEST_BYTES})")
        need = self._head_length - len(self._head)
        self._head += view[:need]
        self.received += min(need, len(view))
        view = view[need:]
        if len(self._head) == self._head_length:
            self._parse_manifest(bytes(self._head))
            self._head.clear()
        return view

    def _parse_manifest(self, text: bytes) -> None:
        try:
            manifest = json.loads(text)
        except (ValueError, UnicodeDecodeError) as error:
            raise StateWireError(f"manifest is not JSON: {error}") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise StateWireError(f"manifest format is not {FORMAT!r}")
        specs = manifest.get("tensors")
        if not isinstance(specs, list):
            raise StateWireError("manifest.tensors: not a list")
        position = _PREFIX.size + self._head_length
        declared = []
        for i, spec in enumerate(specs):
            dtype = _DTYPES.get(spec.get("dtype")) if isinstance(spec, dict) else None
            shape = spec.get("shape") if isinstance(spec, dict) else None
            if dtype is None or not isinstance(shape, list) or not all(
                    isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**48 for n in shape) or len(shape) > 8:
                raise StateWireError(f"manifest.tensors[{i}]: expected an allowed dtype and a shape of at most "
                                     "8 non-negative dimensions")
            declared.append((dtype, shape))
            position += _nbytes(dtype, shape)
            if position > self.total_bytes:
                break
        if position != self.total_bytes:
            raise StateWireError(f"the manifest's tensors add up to {position} bytes, the donor announced "
                                 f"{self.total_bytes}")
        self._tensors = [torch.empty(shape, dtype=dtype) for dtype, shape in declared]
        position = _PREFIX.size + self._head_length
        for tensor in self._tensors:
            view = _byte_view(tensor)
            if len(view):
                self._slots.append(_Slot(position, view))
            position += len(view)
        self._slots.reverse()  # filled in order: pop from the end
        self._tree = _Tree(manifest.get("state"), len(self._tensors))

    def _take_tensor_bytes(self, view: memoryview) -> memoryview:
        if not self._slots:
            raise StateWireError("bytes beyond the manifest's tensors")
        slot = self._slots[-1]
        at = self.received - slot.start
        take = min(len(slot.view) - at, len(view))
        slot.view[at:at + take] = view[:take]
        self.received += take
        if at + take == len(slot.view):
            self._slots.pop()
        return view[take:]

    def sha256(self) -> str:
        return self._hash.hexdigest()

    def result(self) -> Any:
        """The state tree, once every byte is in (the caller checks the digest first)."""
        if not self.complete or self._tree is None:
            raise StateWireError(f"incomplete: {self.received} of {self.total_bytes} bytes")
        return self._tree.build(self._tensors)


class _Tree:
    """The manifest's tagged tree, checked for shape (depth, tags, indices) when built."""

    def __init__(self, encoded: Any, n_tensors: int):
        self.encoded, self.n_tensors = encoded, n_tensors

    def build(self, tensors: list[torch.Tensor]) -> Any:
        used: set[int] = set()

        def walk(value: Any, depth: int) -> Any:
            if depth > _MAX_DEPTH:
                raise StateWireError(f"manifest.state nests deeper than {_MAX_DEPTH}")
            if value is None or isinstance(value, (str, bool, int, float)):
                return value
            if not isinstance(value, dict) or len(value) != 1:
                raise StateWireError("manifest.state: a container must be one tagged object")
            (tag, inner), = value.items()
            if tag == "t":
                if not isinstance(inner, int) or isinstance(inner, bool) or not 0 <= inner < self.n_tensors \
                        or inner in used:
                    raise StateWireError(f"manifest.state: tensor index {inner!r} is not one of the "
                                         f"{self.n_tensors} tensors (or used twice)")
                used.add(inner)
                return tensors[inner]
            if not isinstance(inner, list):
                raise StateWireError(f"manifest.state: {tag!r} must hold a list")
            if tag == "l":
                return [walk(v, depth + 1) for v in inner]
            if tag == "u":
                return tuple(walk(v, depth + 1) for v in inner)
            if tag == "m":
                result = {}
                for pair in inner:
                    if not isinstance(pair, list) or len(pair) != 2:
                        raise StateWireError("manifest.state: a dict entry must be a [key, value] pair")
                    key = walk(pair[0], depth + 1)
                    if not isinstance(key, (str, int, float, bool)) and key is not None:
                        raise StateWireError("manifest.state: dict keys must be scalars")
                    result[key] = walk(pair[1], depth + 1)
                return result
            raise StateWireError(f"manifest.state: unknown tag {tag!r}")

        tree = walk(self.encoded, 0)
        if len(used) != self.n_tensors:
            raise StateWireError(f"manifest.state uses {len(used)} of its {self.n_tensors} tensors")
        return tree
