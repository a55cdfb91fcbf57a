"""The committed generated code, its runtime floors, and the Stage adapter's conversions."""

from __future__ import annotations

import configparser
import dataclasses
import re
from pathlib import Path

import pytest

from agora.protos import stage_adapter as adapter
from agora.protos import stage_pb2

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"


def test_committed_generated_code_matches_regeneration():
    pytest.importorskip("grpc_tools")
    from agora.protos.generate import stale_files

    assert stale_files() == [], "generated code is stale: run `python protos/generate.py` and commit the result"


def test_generated_code_imports_through_the_installed_package():
    grpc_code = (PROTOS / "stage_pb2_grpc.py").read_text()
    assert "from agora.protos import stage_pb2" in grpc_code
    assert stage_pb2.DESCRIPTOR.package == "agora.v1"
    assert adapter.SERVICE_NAME == "agora.v1.Stage"


def test_every_proto_is_generated_and_served_under_agora_v1():
    from agora.protos import authorizer_adapter, authorizer_pb2

    assert sorted(p.stem for p in PROTOS.glob("*.proto")) == ["authorizer", "stage"]
    assert "from agora.protos import authorizer_pb2" in (PROTOS / "authorizer_pb2_grpc.py").read_text()
    assert authorizer_pb2.DESCRIPTOR.package == "agora.v1"
    assert authorizer_adapter.SERVICE_NAME == "agora.v1.Authorizer"


def _requirement_floor(requirements: str, name: str) -> tuple[int, ...]:
    match = re.search(rf"^\s*{re.escape(name)}\s*>=\s*([0-9.]+)", requirements, re.MULTILINE)
    assert match, f"setup.cfg install_requires has no `{name}>=` floor"
    return tuple(int(part) for part in match.group(1).split("."))


def test_setup_cfg_floors_cover_what_the_generated_code_demands():
    """The gencode refuses older protobuf/grpcio runtimes; the package must not allow them."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    requirements = config["options"]["install_requires"]
    for name in ("stage", "authorizer"):
        pb_code = (PROTOS / f"{name}_pb2.py").read_text()
        grpc_code = (PROTOS / f"{name}_pb2_grpc.py").read_text()
        protobuf = re.search(r"Protobuf Python Version: ([0-9.]+)", pb_code).group(1)
        grpc_generated = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", grpc_code).group(1)
        protobuf_version = tuple(int(v) for v in protobuf.split("."))
        grpc_version = tuple(int(v) for v in grpc_generated.split("."))
        assert _requirement_floor(requirements, "protobuf") >= protobuf_version, name
        assert _requirement_floor(requirements, "grpcio") >= grpc_version, name


SAMPLES = [
    adapter.ForwardRequest(run_id="run", microbatch_id="t0/u3/m1", stage=2, tokens=b"tok", wire=b"w" * 10,
                           targets=b"tgt"),
    adapter.ForwardReply(wire=b"out", step=7),
    adapter.ForwardReply(loss=0.0, input_grad=b"g", step=1),  # a zero loss must survive as 0.0, not None
    adapter.BackwardRequest(run_id="run", microbatch_id="m", stage=1, output_grad=b"grad"),
    adapter.BackwardReply(input_grad=b"", step=3),
    adapter.StepRequest(run_id="run", stage=0, microbatches=4, step=None),
    adapter.StepRequest(run_id="run", stage=0, microbatches=4, step=0),
    adapter.StepReply(step=5, grad_norm=1.5, lr=1e-3, skipped=False, accumulated=4),
    adapter.InfoRequest(),
    adapter.InfoReply(run_id="run", stage=1, n_stages=3, step=9, phase="member", load=2, capacity=8,
                      stashed=5, synchronous=True, throughput=1234.5),
]


@pytest.mark.parametrize("value", SAMPLES, ids=lambda v: type(v).__name__)
def test_dataclass_message_round_trip(value):
    message = adapter.to_message(value)
    assert type(message).__module__ == stage_pb2.__name__
    again = adapter.from_message(type(message).FromString(message.SerializeToString()))
    assert again == value


def test_unset_optional_fields_read_back_as_none():
    assert adapter.from_message(stage_pb2.ForwardReply(wire=b"x")).loss is None
    assert adapter.from_message(stage_pb2.StepRequest(run_id="r", microbatches=1)).step is None


@pytest.mark.parametrize("chunk_bytes", [1, 3, 4, 1000])
def test_split_and_reassemble(chunk_bytes):
    value = SAMPLES[0]
    parts = adapter.split_parts(value, chunk_bytes)
    for part in parts:
        assert len(part.wire) + len(part.tokens) + len(part.targets) <= chunk_bytes
    assert all(not part.run_id for part in parts[1:]), "scalars travel in the first part only"
    assembler = adapter.PartAssembler(stage_pb2.ForwardRequest, max_bytes=adapter.payload_bytes(value))
    for part in parts:
        assembler.add(part)
    assert assembler.result() == value


def test_reply_without_payload_is_one_part():
    reply = adapter.ForwardReply(loss=2.5, step=1)
    (part,) = adapter.split_parts(reply, 16)
    assert adapter.from_message(part) == reply


def test_reassembly_is_bounded_and_needs_a_part():
    value = dataclasses.replace(SAMPLES[0], wire=b"w" * 100)
    assembler = adapter.PartAssembler(stage_pb2.ForwardRequest, max_bytes=50)
    with pytest.raises(adapter.PayloadTooLarge, match="50-byte limit"):
        for part in adapter.split_parts(value, 10):
            assembler.add(part)
    with pytest.raises(adapter.IncompleteStream):
        adapter.PartAssembler(stage_pb2.BackwardRequest, max_bytes=10).result()
