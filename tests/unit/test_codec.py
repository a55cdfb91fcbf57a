"""The wire codec: round trips per dtype, token widths, and every way a peer's frame can be wrong."""

from __future__ import annotations

import math
import struct
import warnings

import numpy as np
import pytest
import torch

from agora.pipeline.codec import (
    FLOAT_DTYPES,
    MAGIC,
    VERSION,
    WireCodec,
    WireFormatError,
    decode_tokens,
    encode_tokens,
    float_frame_bytes,
    token_frame_bytes,
    token_width,
    wire_bytes_per_token,
)


def _coords(*shape: int, seed: int = 0) -> torch.Tensor:
    """Random values whose rows span five orders of magnitude, as real token coordinates do."""
    generator = torch.Generator().manual_seed(seed)
    rows = shape[-2] if len(shape) > 1 else 1
    return torch.randn(*shape, generator=generator) * torch.logspace(-3, 2, rows).reshape(rows, 1)


def _header(kind: int = 1, code: int = 1, dims: tuple[int, ...] = (2, 3), *, magic: bytes = MAGIC,
            version: int = VERSION, ndim: int | None = None) -> bytes:
    ndim = len(dims) if ndim is None else ndim
    return struct.pack("<3sBBBB", magic, version, kind, code, ndim) + struct.pack(f"<{len(dims)}I", *dims)


def _assert_int8_close(decoded: torch.Tensor, original: torch.Tensor) -> None:
    rows = original.reshape(-1, original.shape[-1])
    bound = rows.abs().amax(dim=1, keepdim=True) / 127  # half of this is the rounding bound; keep slack
    assert ((decoded.reshape(rows.shape) - rows).abs() <= bound + 1e-30).all()


# ----------------------------------------------------------------------------- round trips


def test_fp32_round_trip_is_bit_exact():
    tensor = _coords(2, 5, 16)
    tensor[0, 0, 0] = 1e-45  # a subnormal survives too
    decoded = WireCodec("fp32").decode(WireCodec("fp32").encode(tensor))
    assert decoded.dtype == torch.float32
    assert torch.equal(decoded.view(torch.int32), tensor.view(torch.int32))


@pytest.mark.parametrize("dtype, torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_half_precision_round_trips_match_torch_casts(dtype, torch_dtype):
    tensor = _coords(2, 5, 16).clamp(-6e4, 6e4)
    decoded = WireCodec(dtype).decode(WireCodec(dtype).encode(tensor))
    # Exactly what a torch cast gives: the codec adds no error of its own.
    torch.testing.assert_close(decoded, tensor.to(torch_dtype).float(), rtol=0, atol=0)
    relative = 2**-8 if dtype == "bf16" else 2**-11
    normal = tensor.abs() > 1e-4  # fp16's subnormals lose relative precision; bf16 keeps fp32's range
    assert ((decoded - tensor).abs()[normal] <= tensor.abs()[normal] * relative).all()


def test_int8_is_within_absmax_over_127_per_row_and_zero_rows_stay_zero():
    tensor = _coords(3, 7, 51)
    tensor[1, 2] = 0.0
    frame = WireCodec("int8").encode(tensor)
    decoded = WireCodec("fp32").decode(frame)  # any codec decodes any dtype
    _assert_int8_close(decoded, tensor)
    assert torch.equal(decoded[1, 2], torch.zeros(51))
    # The row's absmax itself is exact up to float rounding: it maps to +-127.
    row = tensor[0, 0]
    assert decoded[0, 0].abs().max().item() == pytest.approx(row.abs().max().item(), rel=1e-6)


def test_int8_layout_is_scales_then_values():
    tensor = torch.tensor([[1.0, -2.0], [0.0, 0.0]])
    frame = WireCodec("int8").encode(tensor)
    header = 7 + 4 * 2
    scales = np.frombuffer(frame, dtype="<f4", count=2, offset=header)
    values = np.frombuffer(frame, dtype=np.int8, offset=header + 8)
    assert scales.tolist() == [pytest.approx(2 / 127), 0.0]
    assert values.tolist() == [64, -127, 0, 0]  # 1 / (2/127) = 63.5 rounds to nearest even


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_frame_size_matches_formula_and_decode_is_fresh_and_writable(dtype):
    tensor = _coords(2, 4, 8)
    frame = WireCodec(dtype).encode(tensor)
    assert len(frame) == float_frame_bytes(tensor.shape, dtype) == WireCodec(dtype).frame_bytes(tensor.shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when wrapping a non-writable buffer
        decoded = WireCodec().decode(frame, expected_shape=(None, 4, 8))
    decoded += 1  # writable, and owns its memory
    assert decoded.is_contiguous() and decoded.shape == (2, 4, 8)


def test_encode_accepts_other_float_dtypes_devices_and_grad_tensors():
    tensor = _coords(4, 8).double().requires_grad_()
    decoded = WireCodec("fp32").decode(WireCodec("fp32").encode(tensor))
    torch.testing.assert_close(decoded, tensor.detach().float(), rtol=0, atol=0)
    half = _coords(4, 8).to(torch.bfloat16)
    assert torch.equal(WireCodec("bf16").decode(WireCodec("bf16").encode(half)), half.float())
    strided = _coords(8, 4).t()  # non-contiguous
    assert torch.equal(WireCodec().decode(WireCodec().encode(strided)), strided)


@pytest.mark.parametrize("vocab_size, width, item", [(256, "uint8", 1), (50304, "uint16", 2), (128256, "uint32", 4)])
def test_token_widths_and_round_trip(vocab_size, width, item):
    assert token_width(vocab_size) == width
    tokens = torch.randint(0, vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    tokens[0, 0], tokens[0, 1] = 0, vocab_size - 1  # both ends of the range
    frame = encode_tokens(tokens, vocab_size)
    assert len(frame) == 7 + 4 * 2 + item * tokens.numel() == token_frame_bytes(tokens.shape, vocab_size)
    decoded = decode_tokens(frame, vocab_size, expected_shape=(2, 33))
    assert decoded.dtype == torch.int64 and torch.equal(decoded, tokens)


def test_token_width_boundaries():
    assert [token_width(v) for v in (1, 256, 257, 65536, 65537, 2**32)] == \
        ["uint8", "uint8", "uint16", "uint16", "uint32", "uint32"]
    for bad in (0, -1, 2**32 + 1, 3.0, True):
        with pytest.raises(WireFormatError, match="vocab_size"):
            token_width(bad)


def test_wire_bytes_per_token_formula():
    # SSN bf16 at 8b geometry: 51 * 2 bytes of coordinates + 4 bytes of uint32 id, plus headers.
    per_token = wire_bytes_per_token(1, 4096, 51, "bf16", vocab_size=128256)
    assert per_token == pytest.approx((19 + 4096 * 102 + 15 + 4096 * 4) / 4096)
    assert wire_bytes_per_token(1, 4096, 51, "int8") == pytest.approx((19 + 4096 * (51 + 4)) / 4096)


def test_random_shapes_and_dtypes_round_trip():
    rng = np.random.default_rng(1234)
    for trial in range(60):
        ndim = int(rng.integers(1, 5))
        shape = tuple(int(d) for d in rng.integers(1, 7, size=ndim))
        dtype = FLOAT_DTYPES[int(rng.integers(len(FLOAT_DTYPES)))]
        tensor = torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * float(10.0 ** rng.integers(-3, 4)))
        frame = WireCodec(dtype).encode(tensor)
        assert len(frame) == float_frame_bytes(shape, dtype), (trial, shape, dtype)
        decoded = WireCodec("int8").decode(frame, expected_shape=shape)
        assert decoded.shape == shape and decoded.dtype == torch.float32
        if dtype == "fp32":
            assert torch.equal(decoded, tensor)
        elif dtype == "int8":
            _assert_int8_close(decoded, tensor)
        else:
            torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float16
            assert torch.equal(decoded, tensor.to(torch_dtype).float())
        vocab = int(rng.choice([2, 256, 1000, 70000]))
        tokens = torch.from_numpy(rng.integers(0, vocab, size=shape))
        assert torch.equal(decode_tokens(encode_tokens(tokens, vocab), vocab), tokens)


# ----------------------------------------------------------------------------- bad frames


def test_every_truncation_of_a_frame_is_rejected():
    codec = WireCodec()
    for frame in (codec.encode(_coords(2, 3, 4)), WireCodec("int8").encode(_coords(2, 3, 4)),
                  encode_tokens(torch.arange(6).reshape(2, 3), 256)):
        decode = codec.decode if frame[4] == 1 else (lambda data: decode_tokens(data, 256))
        decode(frame)  # the whole frame is fine
        for cut in range(len(frame)):
            with pytest.raises(WireFormatError):
                decode(frame[:cut])


def test_trailing_bytes_are_rejected():
    frame = WireCodec().encode(_coords(2, 3))
    with pytest.raises(WireFormatError, match="trailing bytes: .* needs 39 bytes, frame has 40"):
        WireCodec().decode(frame + b"\0")
    with pytest.raises(WireFormatError, match="trailing"):
        decode_tokens(encode_tokens(torch.arange(4), 256) + b"\0", 256)


def test_truncated_payload_message_says_expected_and_found():
    frame = WireCodec().encode(_coords(2, 3))
    with pytest.raises(WireFormatError, match="truncated: shape \\[2, 3\\] fp32 needs 39 bytes, frame has 38"):
        WireCodec().decode(frame[:-1])


@pytest.mark.parametrize("frame, message", [
    (b"", "0 bytes, shorter than the 7-byte header"),
    (_header(magic=b"XYZ") + bytes(24), "bad magic"),
    (_header(version=2) + bytes(24), "unsupported wire version: expected 1, found 2"),
    (_header(code=0) + bytes(24), "unknown float dtype code 0"),
    (_header(code=99) + bytes(24), "unknown float dtype code 99"),
    (_header(code=16) + bytes(24), "unknown float dtype code 16"),  # a token dtype in a float frame
    (_header(kind=2, code=16, dims=(2, 3)) + bytes(6), "expected a float frame, found a token frame"),
    (_header(kind=7) + bytes(24), "expected a float frame, found unknown kind 7"),
    (_header(dims=(), ndim=0), "ndim must be in 1..4, found 0"),
    (_header(dims=(1,) * 9), "ndim must be in 1..4, found 9"),
    (_header(dims=(2, 0)), "every dim must be positive"),
    (_header(dims=(2**31, 2**31)), "over the limit"),
    (_header(dims=(2**32 - 1,) * 4, code=4), "over the limit"),
])
def test_malformed_float_frames_are_rejected_with_clear_messages(frame, message):
    with pytest.raises(WireFormatError, match=message):
        WireCodec().decode(frame)


def test_huge_claimed_shape_raises_before_allocating(monkeypatch):
    # If decode reached numpy it would try to read 2**64 bytes; make that path fail loudly.
    monkeypatch.setattr(np, "frombuffer", lambda *a, **k: pytest.fail("allocated from an unchecked header"))
    with pytest.raises(WireFormatError, match="header claims shape \\[2147483648, 2147483648\\]"):
        WireCodec(max_bytes=2**62).decode(_header(dims=(2**31, 2**31)))
    with pytest.raises(WireFormatError, match="over the limit"):
        decode_tokens(_header(kind=2, code=18, dims=(2**31, 2**31)), 128256)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_payloads_are_rejected(dtype, bad):
    frame = bytearray(WireCodec(dtype).encode(torch.ones(2, 3)))
    header = 7 + 4 * 2
    if dtype == "fp32":
        frame[header:header + 4] = np.float32(bad).tobytes()
    elif dtype == "bf16":
        frame[header:header + 2] = torch.tensor([bad], dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
    elif dtype == "fp16":
        frame[header:header + 2] = np.float16(bad).tobytes()
    else:
        frame[header:header + 4] = np.float32(bad).tobytes()  # the first row's scale
    with pytest.raises(WireFormatError, match="NaN|Inf"):
        WireCodec().decode(bytes(frame))


def test_int8_scale_overflow_and_bad_values_are_rejected():
    header = _header(code=4, dims=(1, 2))
    huge = np.float32(3e38).tobytes()
    with pytest.raises(WireFormatError, match="NaN or Inf"):  # 127 * 3e38 overflows float32
        WireCodec().decode(header + huge + bytes([127, 0]))
    with pytest.raises(WireFormatError, match="negative row scale"):
        WireCodec().decode(header + np.float32(-1).tobytes() + bytes([1, 0]))
    with pytest.raises(WireFormatError, match="-128"):
        WireCodec().decode(header + np.float32(1).tobytes() + bytes([0x80, 0]))


def test_encoding_refuses_garbage():
    for bad in (float("nan"), float("inf")):
        with pytest.raises(WireFormatError, match="NaN or Inf"):
            WireCodec().encode(torch.tensor([1.0, bad]))
    with pytest.raises(WireFormatError, match="float32 range"):
        WireCodec().encode(torch.tensor([1e300], dtype=torch.float64))
    with pytest.raises(WireFormatError, match="overflows fp16"):
        WireCodec("fp16").encode(torch.tensor([1e5]))
    with pytest.raises(WireFormatError, match="overflows fp16"):
        WireCodec("fp16").encode(torch.tensor([1.0, -65520.0]))  # rounds to -inf in fp16
    assert WireCodec().decode(WireCodec("fp16").encode(torch.tensor([-65504.0]))).item() == -65504.0
    with pytest.raises(WireFormatError, match="overflows bf16"):
        WireCodec("bf16").encode(torch.tensor([torch.finfo(torch.float32).max]))
    with pytest.raises(WireFormatError, match="floating-point"):
        WireCodec().encode(torch.arange(3))
    with pytest.raises(WireFormatError, match="1..4 dims"):
        WireCodec().encode(torch.tensor(1.0))
    with pytest.raises(WireFormatError, match="1..4 dims"):
        WireCodec().encode(torch.ones(1, 1, 1, 1, 1))
    with pytest.raises(WireFormatError, match="dims must be in"):
        WireCodec().encode(torch.ones(2, 0))
    with pytest.raises(WireFormatError, match="over the limit of 100"):
        WireCodec(max_bytes=100).encode(torch.ones(100))
    with pytest.raises(ValueError, match="wire dtype"):
        WireCodec("fp8")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_encoding_finds_a_single_non_finite_value_anywhere(dtype):
    rng = np.random.default_rng(3)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for _ in range(5):
            tensor = torch.randn(3, 37, 51)
            tensor.view(-1)[int(rng.integers(tensor.numel()))] = bad
            with pytest.raises(WireFormatError, match="NaN or Inf"):
                WireCodec(dtype).encode(tensor)


def test_max_bytes_bounds_decode():
    frame = WireCodec().encode(torch.ones(4, 8))  # 15 + 128 bytes
    assert WireCodec(max_bytes=len(frame)).decode(frame).shape == (4, 8)
    with pytest.raises(WireFormatError, match=f"over the limit of {len(frame) - 1}"):
        WireCodec(max_bytes=len(frame) - 1).decode(frame)
    tokens = encode_tokens(torch.arange(100), 256)
    with pytest.raises(WireFormatError, match="over the limit of 50"):
        decode_tokens(tokens, 256, max_bytes=50)


def test_expected_shape_mismatch():
    frame = WireCodec().encode(torch.ones(2, 3, 4))
    assert WireCodec().decode(frame, expected_shape=(None, None, 4)).shape == (2, 3, 4)
    for expected in ((2, 3, 5), (2, 3), (None, None, None, 4)):
        with pytest.raises(WireFormatError, match="shape mismatch: expected"):
            WireCodec().decode(frame, expected_shape=expected)
    with pytest.raises(WireFormatError, match="shape mismatch: expected \\[\\*, 7\\], found \\[2, 3\\]"):
        decode_tokens(encode_tokens(torch.zeros(2, 3, dtype=torch.long), 256), 256, expected_shape=(None, 7))


def test_token_ids_out_of_range():
    with pytest.raises(WireFormatError, match="token id 300 is out of range: expected ids < vocab_size=256"):
        decode_tokens(encode_tokens(torch.tensor([1, 300]), 512), 256)
    with pytest.raises(WireFormatError, match=r"must be in \[0, 256\), found range \[0, 256\]"):
        encode_tokens(torch.tensor([0, 256]), 256)
    with pytest.raises(WireFormatError, match="found range \\[-1"):
        encode_tokens(torch.tensor([-1, 3]), 256)
    with pytest.raises(WireFormatError, match="integer tensor"):
        encode_tokens(torch.tensor([1.0]), 256)
    with pytest.raises(WireFormatError, match="expected a token frame, found a float frame"):
        decode_tokens(WireCodec().encode(torch.ones(3)), 256)
    with pytest.raises(WireFormatError, match="unknown token dtype code 1"):
        decode_tokens(_header(kind=2, code=1, dims=(2,)) + bytes(8), 256)


def test_non_bytes_input_is_rejected_and_bytes_likes_are_accepted():
    frame = WireCodec().encode(torch.ones(3))
    assert torch.equal(WireCodec().decode(bytearray(frame)), torch.ones(3))
    assert torch.equal(WireCodec().decode(memoryview(frame)), torch.ones(3))
    with pytest.raises(WireFormatError, match="must be bytes"):
        WireCodec().decode("AGW")  # type: ignore[arg-type]
    with pytest.raises(WireFormatError, match="must be bytes"):
        decode_tokens(None, 256)  # type: ignore[arg-type]


def test_random_garbage_never_escapes_as_another_exception():
    rng = np.random.default_rng(7)
    valid = bytearray(WireCodec("int8").encode(torch.randn(3, 4)))
    for _ in range(300):
        mutated = bytearray(valid)
        for position in rng.integers(0, len(mutated), size=int(rng.integers(1, 4))):
            mutated[position] = int(rng.integers(0, 256))
        try:
            WireCodec().decode(bytes(mutated))
            decode_tokens(bytes(mutated), 256)
        except WireFormatError:
            pass


def test_all_finite_sees_every_nan_and_inf_and_takes_an_empty_tensor():
    from agora.pipeline.codec import all_finite

    values = torch.randn(1000)
    assert all_finite(values) and all_finite(torch.empty(0)) and all_finite(torch.full((3,), 3e38))
    for bad in (math.nan, math.inf, -math.inf):
        for where in (0, 517, 999):
            poisoned = values.clone()
            poisoned[where] = bad
            assert not all_finite(poisoned) and not all_finite(poisoned.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16", "int8"])
def test_check_refuses_exactly_what_decode_refuses_without_building_a_tensor(dtype):
    """`check` (what a relay runs on a frame it passes on unchanged) agrees with `decode` on good
    frames, non-finite payloads, a wrong shape and a truncated frame."""
    codec = WireCodec(dtype)
    tensor = torch.randn(2, 8, 4)
    frame = codec.encode(tensor)
    assert codec.check(frame, expected_shape=(2, 8, 4)) == (2, 8, 4)
    width = {"fp32": 4, "bf16": 2, "fp16": 2}.get(dtype)
    bad_frames = [frame[:-1], frame + b"\0"]
    if width is not None:
        for bits in ({"fp32": b"\x00\x00\xc0\x7f", "bf16": b"\xc0\x7f", "fp16": b"\x00\x7e"}[dtype],  # NaN
                     {"fp32": b"\x00\x00\x80\xff", "bf16": b"\x80\xff", "fp16": b"\x00\xfc"}[dtype]):  # -Inf
            at = len(frame) - 3 * width
            bad_frames.append(frame[:at] + bits + frame[at + width:])
    for bad in bad_frames:
        with pytest.raises(WireFormatError):
            codec.decode(bad)
        with pytest.raises(WireFormatError):
            codec.check(bad)
    with pytest.raises(WireFormatError, match="shape mismatch"):
        codec.check(frame, expected_shape=(2, 8, 5))


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16", "int8"])
def test_inspect_finds_the_largest_magnitude_a_frame_carries(dtype):
    """The measure a relay holds a frame to (pipeline/wire_scale.py), from the pass that checks it: the
    largest |value| of what `decode` would build, whichever its sign and wherever it sits."""
    codec = WireCodec(dtype)
    for where, value in ((0, -7.5e3), (37, 3.0e4), (63, 1.0)):  # within fp16
        tensor = torch.rand(2, 8, 4) * 0.1
        tensor.view(-1)[where] = value
        frame = codec.encode(tensor)
        checked = codec.inspect(frame, expected_shape=(2, 8, 4))
        assert checked.shape == (2, 8, 4)
        assert checked.largest_magnitude == float(codec.decode(frame).abs().max())
