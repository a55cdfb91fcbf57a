"""The relay's hand-rolled Forward/Backward encoding (protos/stage_relay_adapter.py) against the
generated classes: both directions equal, and nothing it accepts means something else to protobuf."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agora.protos import stage_adapter as adapter
from agora.protos import stage_pb2
from agora.protos.stage_relay_adapter import WireMessageError, decode_message, encode_message

uint32 = st.integers(0, 2**32 - 1)
uint64 = st.integers(0, 2**64 - 1)
doubles = st.floats(allow_nan=False)
frames = st.binary(max_size=300)
text = st.text(max_size=40)

forward_requests = st.builds(adapter.ForwardRequest, run_id=text, microbatch_id=text, stage=uint32, tokens=frames,
                             wire=frames, targets=frames, evaluate=st.booleans())
backward_requests = st.builds(adapter.BackwardRequest, run_id=text, microbatch_id=text, stage=uint32,
                              output_grad=frames)
forward_replies = st.builds(adapter.ForwardReply, wire=frames, loss=st.none() | doubles, input_grad=frames,
                            step=uint64, queued_s=doubles, compute_s=doubles)
backward_replies = st.builds(adapter.BackwardReply, input_grad=frames, step=uint64, queued_s=doubles,
                             compute_s=doubles)


def _plain(value):
    """A dataclass with its memoryviews as bytes, for comparison."""
    return type(value)(**{k: bytes(v) if isinstance(v, memoryview) else v for k, v in vars(value).items()})


@settings(max_examples=200, deadline=None)
@given(st.one_of(forward_requests, backward_requests))
def test_requests_serialize_as_protobuf_parses_them(request):
    message_cls = stage_pb2.ForwardRequest if isinstance(request, adapter.ForwardRequest) else stage_pb2.BackwardRequest
    data = encode_message(request, message_cls)
    assert adapter.from_message(message_cls.FromString(data)) == request
    assert data == adapter.to_message(request).SerializeToString()  # byte for byte, field order included


@settings(max_examples=200, deadline=None)
@given(st.one_of(forward_replies, backward_replies))
def test_replies_parse_as_protobuf_wrote_them(reply):
    message_cls = stage_pb2.ForwardReply if isinstance(reply, adapter.ForwardReply) else stage_pb2.BackwardReply
    data = adapter.to_message(reply).SerializeToString()
    parsed = decode_message(data, message_cls, type(reply))
    assert _plain(parsed) == reply
    frame = parsed.input_grad
    assert frame == b"" if not reply.input_grad else (isinstance(frame, memoryview) and frame.obj is data)  # no copy


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=80), st.sampled_from([(stage_pb2.ForwardReply, adapter.ForwardReply),
                                                (stage_pb2.BackwardReply, adapter.BackwardReply)]))
def test_whatever_it_accepts_protobuf_reads_the_same(data, classes):
    message_cls, dataclass_cls = classes
    try:
        ours = decode_message(data, message_cls, dataclass_cls)
    except WireMessageError:
        return
    theirs = adapter.from_message(message_cls.FromString(data))  # must not raise either
    assert _plain(ours) == theirs


def test_unknown_fields_are_skipped_and_garbage_refused():
    reply = adapter.ForwardReply(wire=b"frame", loss=1.5, step=3)
    data = adapter.to_message(reply).SerializeToString()
    unknown = bytes([15 << 3 | 2, 3]) + b"xyz" + bytes([14 << 3 | 0, 7])  # field 15 (bytes), 14 (varint)
    assert _plain(decode_message(unknown + data, stage_pb2.ForwardReply, adapter.ForwardReply)) == reply
    for garbage in (data[:-1], bytes([1 << 3 | 2, 50]) + b"short", bytes([0x08]) + b"\xff" * 11, bytes([0x03])):
        with pytest.raises(WireMessageError):
            decode_message(garbage, stage_pb2.ForwardReply, adapter.ForwardReply)
