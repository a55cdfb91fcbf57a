"""Stage requests for the bounds tests: the run they address, and codec frames built by hand (a
frame header declaring any shape, with or without its payload), shared by tests/integration/test_worker_bounds.py
and tests/integration/test_worker_memory.py."""

from __future__ import annotations

import struct

import torch

from agora.auth.grpc_policy import FINGERPRINT_METADATA
from agora.pipeline.codec import WireCodec, encode_tokens
from agora.pipeline.config import PRESETS
from agora.pipeline.fingerprint import run_fingerprint
from agora.protos import stage_adapter as adapter

RUN = "bounds-run"
CONFIG = PRESETS["tiny"].with_stages(3)  # microbatch_size 2, seq_len 128, wire_dim 16, vocab 256
K = CONFIG.model.wire_dim
VOCAB = CONFIG.model.vocab_size
ROWS, SEQ = CONFIG.train.microbatch_size, CONFIG.train.seq_len
FINGERPRINT = run_fingerprint(CONFIG)
METADATA = ((FINGERPRINT_METADATA, FINGERPRINT.text()),)
HEAD, BODY, TAIL = 0, 1, 2


def header(kind: str, shape, dtype_code: int | None = None) -> bytes:
    """A codec frame header declaring `shape`, with no payload at all: what a peer needs to send
    to ask for a tensor of that shape."""
    kind_code, default_dtype = {"float": (1, 1), "token": (2, 16)}[kind]
    code = default_dtype if dtype_code is None else dtype_code
    return struct.pack("<3sBBBB", b"AGW", 1, kind_code, code, len(shape)) + struct.pack(f"<{len(shape)}I", *shape)


def tokens(rows: int = 2, seq: int = 8, seed: int = 0) -> bytes:
    return encode_tokens(torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed)), VOCAB)


def wire(rows: int = 2, seq: int = 8, width: int = K, seed: int = 0) -> bytes:
    return WireCodec().encode(torch.randn(rows, seq, width, generator=torch.Generator().manual_seed(seed)) * 0.1)


def forward(stage: int, **fields) -> adapter.ForwardRequest:
    values = dict(run_id=RUN, microbatch_id="m", stage=stage, tokens=tokens(),
                  wire=b"" if stage == HEAD else wire(), targets=tokens(seed=1) if stage == TAIL else b"")
    values.update(fields)
    return adapter.ForwardRequest(**values)


def serialized(request) -> list[bytes]:
    return [adapter.to_message(request).SerializeToString()]


def streamed(request, chunk: int) -> list[bytes]:
    return [m.SerializeToString() for m in adapter.split_parts(request, chunk)]
