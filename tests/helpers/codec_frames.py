"""Codec frames for fuzzing the stage service (tests/integration/test_stage_fuzz.py): hypothesis strategies
that draw real frames (agora.pipeline.codec) or frames broken in one way each, and headers written
by hand, since the codec refuses to write a wrong one. Sizes are `tiny`'s vocabulary and the
fuzzed workers' lowered message and stream limits.
"""

from __future__ import annotations

import struct

import numpy as np
import torch
from hypothesis import strategies as st

from agora.pipeline.codec import FLOAT_DTYPES, WireCodec, encode_tokens
from agora.pipeline.config import PRESETS

VOCAB = PRESETS["tiny"].model.vocab_size
MAX_SEQ = PRESETS["tiny"].model.max_seq_len
MESSAGE_LIMIT = 2**20  # the fuzzed workers' per-message limit
STREAM_LIMIT = 2 * 2**20  # and per reassembled stream
SEEDS = st.integers(0, 2**16)


_PREFIX = struct.Struct("<3sBBBB")
_FLOAT, _TOKENS = 1, 2
_FLOAT_CODE = {"fp32": 1, "bf16": 2, "fp16": 3, "int8": 4}
_TOKEN_CODE = {"uint8": 16, "uint16": 17, "uint32": 18}


def frame_header(kind: int, code: int, shape, *, magic: bytes = b"AGW", version: int = 1, ndim: int | None = None) -> bytes:
    """A frame header written by hand (the codec refuses to write a wrong one)."""
    return (_PREFIX.pack(magic, version, kind, code, len(shape) if ndim is None else ndim)
            + struct.pack(f"<{len(shape)}I", *shape))


def token_ids(shape, seed: int, high: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, high, tuple(shape), generator=torch.Generator().manual_seed(seed))


def float_values(shape, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(tuple(shape)).astype("<f4")


def _mutations(draw, real: bytes) -> bytes:
    """A real frame broken in one generic way."""
    how = draw(st.sampled_from(["truncated", "trailing", "header_byte", "payload_byte"]))
    if how == "truncated":
        return real[:draw(st.integers(0, len(real) - 1))]
    if how == "trailing":
        return real + draw(st.binary(min_size=1, max_size=16))
    at = draw(st.integers(0, min(len(real), 7 + 4 * 4) - 1) if how == "header_byte" else st.integers(0, len(real) - 1))
    return real[:at] + bytes([draw(st.integers(0, 255))]) + real[at + 1:]


def _huge_declared(draw, kind: int, code: int, ndim: int) -> bytes:
    dims = draw(st.lists(st.sampled_from([1, 2**16, 2**31, 2**32 - 1]), min_size=ndim, max_size=ndim))
    return frame_header(kind, code, dims) + draw(st.binary(max_size=64))


def _garbage(draw, kind: int, shape) -> bytes:
    how = draw(st.sampled_from(["random", "empty", "magic", "version", "kind", "dtype", "ndim"]))
    codes = _FLOAT_CODE if kind == _FLOAT else _TOKEN_CODE
    code = next(iter(codes.values()))
    if how == "random":
        return draw(st.binary(max_size=96))
    if how == "empty":
        return b""
    if how == "magic":
        return frame_header(kind, code, shape, magic=draw(st.binary(min_size=3, max_size=3))) + b"\0" * 64
    if how == "version":
        return frame_header(kind, code, shape, version=draw(st.integers(0, 255))) + b"\0" * 64
    if how == "kind":
        return frame_header(draw(st.integers(0, 255)), code, shape) + b"\0" * 64
    if how == "dtype":
        return frame_header(kind, draw(st.integers(0, 255)), shape) + b"\0" * 64
    return frame_header(kind, code, shape, ndim=draw(st.sampled_from([0, 5, 255]))) + b"\0" * 64


@st.composite
def token_frames(draw, shape, valid: bool):
    """Token ids of `shape` (batch, seq): `valid`, in the narrowest or a wider dtype; else broken in one way."""
    how = draw(st.sampled_from(["real", "wide"] if valid else
                               ["out_of_range", "ndim", "floats", "huge", "mutated", "garbage"]))
    seed = draw(SEEDS)
    if how == "real":
        return encode_tokens(token_ids(shape, seed), VOCAB)
    if how == "wide":  # a wider dtype than needed is allowed
        return frame_header(_TOKENS, _TOKEN_CODE["uint32"], shape) + token_ids(shape, seed).numpy().astype("<u4").tobytes()
    if how == "out_of_range":
        ids = token_ids(shape, seed).numpy().astype("<u4")
        ids.flat[draw(st.integers(0, ids.size - 1))] = draw(st.sampled_from([VOCAB, VOCAB + 1, 2**16, 2**32 - 1]))
        return frame_header(_TOKENS, _TOKEN_CODE["uint32"], shape) + ids.tobytes()
    if how == "ndim":
        other = draw(st.sampled_from([shape[:1], (*shape, 1), (1, *shape), (*shape, 1, 1)]))
        return encode_tokens(token_ids(other, seed), VOCAB)
    if how == "floats":
        return WireCodec("fp32").encode(torch.zeros(shape))
    if how == "huge":
        return _huge_declared(draw, _TOKENS, draw(st.sampled_from(list(_TOKEN_CODE.values()))),
                              draw(st.integers(1, 4)))
    if how == "mutated":
        return _mutations(draw, encode_tokens(token_ids(shape, seed), VOCAB))
    return _garbage(draw, _TOKENS, shape)


@st.composite
def float_frames(draw, shape, valid: bool):
    """A float frame of `shape`: `valid`, in any wire dtype or with extreme finite values; else broken in one way."""
    how = draw(st.sampled_from(["real", "real", "extreme"] if valid else
                               ["shape", "nonfinite", "int8_range", "int8_scale", "tokens", "huge", "mutated",
                                "garbage", "oversized"]))
    seed = draw(SEEDS)
    if how == "real":
        return WireCodec(draw(st.sampled_from(FLOAT_DTYPES))).encode(torch.from_numpy(float_values(shape, seed)))
    if how == "extreme":  # finite, so the codec accepts it; what the stage makes of it is its business
        scale = draw(st.sampled_from([0.0, 1e-38, 1e4, 1e19, 1e30, 1e38, 3.4e38]))
        finite = float(np.finfo(np.float32).max)
        values = np.clip(float_values(shape, seed).astype(np.float64) * scale, -finite, finite).astype("<f4")
        return frame_header(_FLOAT, _FLOAT_CODE["fp32"], shape) + values.tobytes()
    if how == "shape":
        other = draw(st.sampled_from([shape[:-1], (*shape[:-1], shape[-1] + 1), (*shape[:-1], 1), (*shape, 1),
                                      (shape[0] + 1, *shape[1:]), (shape[0], shape[1] + 1, shape[2])]))
        return WireCodec("fp32").encode(torch.from_numpy(float_values(other, seed)))
    if how == "nonfinite":
        dtype = draw(st.sampled_from(["fp32", "fp16", "bf16"]))
        values = float_values(shape, seed)
        values.flat[draw(st.integers(0, values.size - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
        if dtype == "fp32":
            payload = values.tobytes()
        elif dtype == "fp16":
            payload = values.astype("<f2").tobytes()
        else:
            payload = (values.view("<u4") >> 16).astype("<u2").tobytes()
        return frame_header(_FLOAT, _FLOAT_CODE[dtype], shape) + payload
    if how in ("int8_range", "int8_scale"):
        rows = int(np.prod(shape[:-1]))
        scales = np.abs(float_values((rows,), seed)).astype("<f4")
        quantized = np.random.default_rng(seed).integers(-127, 128, size=tuple(shape)).astype(np.int8)
        if how == "int8_range":
            quantized.flat[draw(st.integers(0, quantized.size - 1))] = -128
        else:
            scales[draw(st.integers(0, rows - 1))] = draw(st.sampled_from([np.nan, np.inf, -1.0, 3.4e38]))
        return frame_header(_FLOAT, _FLOAT_CODE["int8"], shape) + scales.tobytes() + quantized.tobytes()
    if how == "tokens":
        return encode_tokens(token_ids(shape[:2], seed), VOCAB)
    if how == "huge":
        return _huge_declared(draw, _FLOAT, draw(st.sampled_from(list(_FLOAT_CODE.values()))), draw(st.integers(1, 4)))
    if how == "mutated":
        return _mutations(draw, WireCodec(draw(st.sampled_from(FLOAT_DTYPES))).encode(
            torch.from_numpy(float_values(shape, seed))))
    if how == "oversized":  # over one message (the unary limit) or over the stream limit as well
        return frame_header(_FLOAT, _FLOAT_CODE["fp32"], shape) + b"\0" * draw(st.sampled_from(
            [MESSAGE_LIMIT + 1, STREAM_LIMIT + 1]))
    return _garbage(draw, _FLOAT, shape)


# (batch, seq); one in ten the longest sequence the model takes, or one token more.
SHAPES = st.tuples(st.integers(1, 3), st.integers(0, 9).flatmap(
    lambda i: st.sampled_from([MAX_SEQ, MAX_SEQ + 1]) if i == 0 else st.integers(1, 16)))
