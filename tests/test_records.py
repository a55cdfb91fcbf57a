"""agora.dht.records: every record family's wire form, pinned to the bytes peers exchange (pure).

The wire bytes below were produced by the released record code; a peer of this version must
write exactly them and read them back, or peers of the two versions stop seeing each other.
"""

import msgpack
import pytest

from agora.dht.records import MoveRecord, RoundRecord, TrainerRecord, UnitBlockRecord, WorkerRecord

SAMPLES = {
    "worker": WorkerRecord(
        peer_id="QmPeerA", run_id="run-1", endpoint="[::1]:50051", stage=1, n_stages=3, throughput=123.5,
        queue_depth=2, step=10, phase="member", version="0.1.0", updated_at=1000.25, fingerprint="seed=0;stages=3",
        sessions=4, metrics_endpoint="127.0.0.1:9100", averaging_rounds=7, averaging_committed=6, capacity=8,
        credits=4, in_flight_credits=2),
    "trainer": TrainerRecord(
        peer_id="QmTrainer", run_id="run-1", trainer_index=1, batches=12, step=11, loss=3.25, tokens_per_s=1500.5,
        version="0.1.0", updated_at=1000.5, metrics_endpoint="host.example:9101"),
    "move": MoveRecord(peer_id="QmPeerA", run_id="run-1", from_stage=0, to_stage=2, started_at=999.0),
    "round": RoundRecord(peer_id="QmPeerA", run_id="run-1", stage=1, round=7, started_at=12.5, closed=True),
    "units": UnitBlockRecord.build("QmTrainer", "run-1", 1, {256, 300}, {257: (10.0, 40.0)}, 10.5, b"-----PEM-----"),
}

WIRE_BYTES = {
    "worker": (
        "de0015a6736368656d6102a46b696e64a6776f726b6572a7706565725f6964a7516d5065657241a672756e5f6964a572756e2d31"
        "a8656e64706f696e74ab5b3a3a315d3a3530303531a5737461676501a86e5f73746167657303aa7468726f756768707574cb405e"
        "e00000000000ab71756575655f646570746802a4737465700aa57068617365a66d656d626572a776657273696f6ea5302e312e30"
        "aa757064617465645f6174cb408f420000000000ab66696e6765727072696e74af736565643d303b7374616765733d33a8736573"
        "73696f6e7304b06d6574726963735f656e64706f696e74ae3132372e302e302e313a39313030b0617665726167696e675f726f75"
        "6e647307b3617665726167696e675f636f6d6d697474656406a8636170616369747908a76372656469747304b1696e5f666c6967"
        "68745f6372656469747302"),
    "trainer": (
        "8ca6736368656d6102a46b696e64a7747261696e6572a7706565725f6964a9516d547261696e6572a672756e5f6964a572756e2d"
        "31ad747261696e65725f696e64657801a7626174636865730ca4737465700ba46c6f7373cb400a000000000000ac746f6b656e73"
        "5f7065725f73cb4097720000000000a776657273696f6ea5302e312e30aa757064617465645f6174cb408f440000000000b06d65"
        "74726963735f656e64706f696e74b1686f73742e6578616d706c653a39313031"),
    "move": (
        "87a6736368656d6102a46b696e64a46d6f7665a7706565725f6964a7516d5065657241a672756e5f6964a572756e2d31aa66726f"
        "6d5f737461676500a8746f5f737461676502aa737461727465645f6174cb408f380000000000"),
    "round": (
        "88a6736368656d6102a46b696e64a5726f756e64a7706565725f6964a7516d5065657241a672756e5f6964a572756e2d31a57374"
        "61676501a5726f756e6407aa737461727465645f6174cb4029000000000000a6636c6f736564c3"),
    "units": (
        "89a6736368656d6102a46b696e64a5756e697473a7706565725f6964a9516d547261696e6572a672756e5f6964a572756e2d31a5"
        "626c6f636b01a9636f6d6d6974746564c42001000000001000000000000000000000000000000000000000000000000000"
        "00a6636c61696d73c412010000000000000024400000000000004440aa757064617465645f6174cb4025000000000000aa637265"
        "64656e7469616cc40d2d2d2d2d2d50454d2d2d2d2d2d"),
}


def packed(wire: dict) -> bytes:
    """What hivemind's MSGPackSerializer puts on the wire for a plain dict."""
    return msgpack.packb(wire, use_bin_type=True, strict_types=True)


@pytest.mark.parametrize("kind", sorted(SAMPLES))
def test_every_record_family_writes_the_released_wire_bytes(kind):
    record = SAMPLES[kind]
    assert record.KIND == kind
    assert packed(record.to_wire()).hex() == WIRE_BYTES[kind]


@pytest.mark.parametrize("kind", sorted(SAMPLES))
def test_every_record_family_reads_the_released_wire_bytes(kind):
    record = SAMPLES[kind]
    wire = msgpack.unpackb(bytes.fromhex(WIRE_BYTES[kind]), raw=False)
    assert type(record).from_wire(wire) == record
