"""One record of every family, every field set (none left at its default): tests/unit/test_records.py
pins their wire bytes, tests/integration/test_dht_auth.py files them under every family's key."""

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
    "units": UnitBlockRecord.build("QmTrainer", "run-1", 1, {256, 300}, {257: (10.0, 40.0)}, 10.5),
}
