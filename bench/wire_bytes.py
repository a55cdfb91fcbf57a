"""Bytes per token crossing one pipeline-stage boundary: dense vs subspace (SSN) wire formats.

    python bench/wire_bytes.py [--out bench/results/wire_bytes.md]

Every byte is counted by encoding real tensors with `agora.pipeline.codec` (not from a formula):
the activation (or gradient) frame, the token-id frame, and transport framing. Framing is one
function, `estimated_message_bytes(fields)`: a 5-byte gRPC length prefix per message plus a
protobuf tag and varint length per bytes field. Once the real proto exists, pass
`message_bytes=lambda fields: GRPC_MESSAGE_PREFIX + len(Msg(...).SerializeToString())` to
`measure` instead; nothing else changes.

Choices that affect the ratios:
- One microbatch is one sequence (batch 1), so per-frame headers are amortised over `seq` tokens.
- Forward SSN messages carry the coordinates and the token ids (a stage needs both to rebuild
  h = T[tokens] + U c). Forward dense messages carry only h: a dense stage needs no ids. This
  is the conservative choice for the headline ratio (adding ids to dense would raise it).
- Backward messages carry only the gradient frame in both modes.
- "Per boundary" is one message (one hop). With client-mediated routing each boundary is two
  hops (stage -> trainer -> next stage); every row doubles alike, so the ratios do not change.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from agora.pipeline.codec import WireCodec, decode_tokens, encode_tokens, float_frame_bytes
from agora.pipeline.config import PRESETS

GRPC_MESSAGE_PREFIX = 5  # 1 compressed flag + 4-byte big-endian length, per gRPC message

MessageSizer = Callable[[Sequence[bytes]], int]


def varint_bytes(value: int) -> int:
    """Length of a protobuf base-128 varint."""
    return max(1, (value.bit_length() + 6) // 7)


def protobuf_bytes_field_overhead(length: int, field_number: int = 1) -> int:
    """Bytes a protobuf `bytes` field adds around `length` bytes of content: tag + varint length."""
    tag = (field_number << 3) | 2  # wire type 2: length-delimited
    return varint_bytes(tag) + varint_bytes(length)


def estimated_message_bytes(fields: Sequence[bytes]) -> int:
    """On-the-wire bytes of one gRPC message whose proto holds these bytes fields (numbers 1, 2, ...)."""
    return GRPC_MESSAGE_PREFIX + sum(
        len(field) + protobuf_bytes_field_overhead(len(field), number) for number, field in enumerate(fields, 1)
    )


@dataclass(frozen=True)
class Geometry:
    name: str
    d_model: int
    rank: int
    vocab_size: int
    seq_len: int


@dataclass(frozen=True)
class Row:
    geometry: str
    mode: str  # "dense" or "SSN"
    width: int
    dtype: str
    activation_bytes: int  # forward activation frame (the backward frame has the same size)
    token_bytes: int  # forward token-id frame; 0 for dense
    forward_bytes: int  # whole forward message, framing included
    backward_bytes: int  # whole backward message, framing included
    tokens: int
    encode_ms: float
    decode_ms: float

    def per_token(self, total: int) -> float:
        return total / self.tokens


def geometries() -> list[Geometry]:
    tiny, big = PRESETS["tiny"], PRESETS["pluralis-8b"]
    return [
        Geometry("tiny", tiny.model.d_model, tiny.model.rank, tiny.model.vocab_size, tiny.train.seq_len),
        Geometry("pluralis-8b", big.model.d_model, big.model.rank, big.model.vocab_size, big.train.seq_len),
    ]


def _best_of(call: Callable[[], object], repeats: int = 3) -> tuple[object, float]:
    """The call's result and its fastest wall time in ms (the first run pays page faults)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        result = call()
        best = min(best, time.perf_counter() - start)
    return result, best * 1e3


def measure(geometry: Geometry, mode: str, dtype: str, *, message_bytes: MessageSizer = estimated_message_bytes,
            seed: int = 0) -> Row:
    """Encode one microbatch's forward and backward boundary tensors and count every byte."""
    generator = torch.Generator().manual_seed(seed)
    width = geometry.d_model if mode == "dense" else geometry.rank
    shape = (1, geometry.seq_len, width)
    activation = torch.randn(shape, generator=generator)
    gradient = torch.randn(shape, generator=generator) * 1e-4
    tokens = torch.randint(0, geometry.vocab_size, shape[:2], generator=generator)
    codec = WireCodec(dtype)

    activation_frame, encode_ms = _best_of(lambda: codec.encode(activation))
    decoded, decode_ms = _best_of(lambda: codec.decode(activation_frame, expected_shape=shape))
    gradient_frame = codec.encode(gradient)
    assert len(activation_frame) == len(gradient_frame) == float_frame_bytes(shape, dtype)
    assert decoded.shape == shape

    if mode == "dense":
        token_frame = b""
        forward = message_bytes([activation_frame])
    else:
        token_frame = encode_tokens(tokens, geometry.vocab_size)
        assert torch.equal(decode_tokens(token_frame, geometry.vocab_size), tokens)
        forward = message_bytes([activation_frame, token_frame])
    return Row(geometry.name, mode, width, dtype, len(activation_frame), len(token_frame), forward,
               message_bytes([gradient_frame]), geometry.seq_len, encode_ms, decode_ms)


VARIANTS = [("dense", "fp32"), ("dense", "bf16"), ("SSN", "fp32"), ("SSN", "bf16"), ("SSN", "fp16"), ("SSN", "int8")]


def render(geometry: Geometry, rows: list[Row]) -> str:
    by_variant = {(r.mode, r.dtype): r for r in rows}
    dense_bf16 = by_variant["dense", "bf16"]
    lines = [
        f"### {geometry.name}: d={geometry.d_model}, k={geometry.rank}, vocab={geometry.vocab_size}, "
        f"seq={geometry.seq_len}, microbatch = 1 sequence",
        "",
        "| mode | width | dtype | activation B/tok | token ids B/tok | framing B/tok | forward B/tok "
        "| backward B/tok | dense-bf16 / this (fwd) | dense-bf16 / this (bwd) | encode ms | decode ms |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        framing = row.forward_bytes - row.activation_bytes - row.token_bytes
        lines.append(
            f"| {row.mode} | {row.width} | {row.dtype} | {row.per_token(row.activation_bytes):.3f} "
            f"| {row.per_token(row.token_bytes):.3f} | {row.per_token(framing):.4f} "
            f"| {row.per_token(row.forward_bytes):.3f} | {row.per_token(row.backward_bytes):.3f} "
            f"| {dense_bf16.forward_bytes / row.forward_bytes:.2f}x "
            f"| {dense_bf16.backward_bytes / row.backward_bytes:.2f}x "
            f"| {row.encode_ms:.2f} | {row.decode_ms:.2f} |"
        )
    ssn_bf16, ssn_int8 = by_variant["SSN", "bf16"], by_variant["SSN", "int8"]
    bound = geometry.d_model / geometry.rank
    fwd = dense_bf16.forward_bytes / ssn_bf16.forward_bytes
    lines += [
        "",
        f"- d/k bound: {bound:.2f}x",
        f"- dense-bf16 / SSN-bf16: forward {fwd:.2f}x ({fwd / bound:.1%} of d/k), "
        f"backward {dense_bf16.backward_bytes / ssn_bf16.backward_bytes:.2f}x",
        f"- dense-bf16 / SSN-int8: forward {dense_bf16.forward_bytes / ssn_int8.forward_bytes:.2f}x, "
        f"backward {dense_bf16.backward_bytes / ssn_int8.backward_bytes:.2f}x",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "wire_bytes.md")
    args = parser.parse_args(argv)
    sections = ["# Wire bytes per token per stage boundary", "",
                "Measured by `bench/wire_bytes.py`: real tensors through `agora.pipeline.codec`; framing = "
                f"gRPC prefix ({GRPC_MESSAGE_PREFIX} B/message) + protobuf tag and varint length per bytes field. "
                "Forward SSN messages carry coordinates + token ids; forward dense messages carry h only; "
                "backward messages carry the gradient frame only. One message = one hop.", ""]
    for geometry in geometries():
        rows = [measure(geometry, mode, dtype) for mode, dtype in VARIANTS]
        sections.append(render(geometry, rows))
    report = "\n".join(sections)
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    return report


if __name__ == "__main__":
    main()
