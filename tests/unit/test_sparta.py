"""AsyncSPARTA and DiLoCo arithmetic, without a network: partition, rounds, delta rule, outer step."""

import math

import pytest
import torch
from hivemind.averaging.key_manager import is_valid_group

from agora.dht.averaging import GROUP_BITS, estimated_bytes, round_group_bits
from agora.dht.keys import rounds_key
from agora.dht.record_fields import RecordError
from agora.dht.records import RoundRecord
from agora.node.averaging.loop import ROUND_LEAD
from agora.node.averaging.sparta import (
    MEMBER_WEIGHT_FLOOR,
    SlicePartition,
    averaged_vector_size,
    next_round,
    outer_nesterov_step,
    peer_weight,
    round_slice,
    stage_parameter_numels,
)
from agora.pipeline.config import PRESETS, ConfigError, SyncConfig, config_from_dict

pytestmark = pytest.mark.timeout(60)

SIZES = [10, 7, 0, 33, 3, 128 * 5]


@pytest.mark.parametrize("n_slices", [1, 4, 20])
def test_partition_covers_every_element_exactly_once_per_rotation(n_slices):
    partition = SlicePartition(SIZES, n_slices, seed=3)
    counts = [torch.zeros(n, dtype=torch.long) for n in SIZES]
    for s in range(n_slices):
        for count, index in zip(counts, partition.indices(s)):
            count.index_add_(0, index.long(), torch.ones(index.numel(), dtype=torch.long))
            assert torch.equal(index, index.sort().values)  # walked in memory order
    assert all(bool((count == 1).all()) for count in counts)
    # Every slice holds the same share of every tensor (within one element).
    for t, n in enumerate(SIZES):
        shares = [partition.indices(s)[t].numel() for s in range(n_slices)]
        assert max(shares) - min(shares) <= 1 and sum(shares) == n
    assert partition.buffer_size == max(partition.slice_sizes)


def test_partition_is_seeded_and_shared_by_replicas():
    a, b = SlicePartition(SIZES, 4, seed=9), SlicePartition(SIZES, 4, seed=9)
    c = SlicePartition(SIZES, 4, seed=10)
    assert all(torch.equal(x, y) for x, y in zip(a.indices(2), b.indices(2)))
    assert not all(torch.equal(x, y) for x, y in zip(a.indices(2), c.indices(2)))


def test_gather_scatter_round_trip_and_padding():
    partition = SlicePartition(SIZES, 4, seed=1)
    tensors = [torch.randn(n) for n in SIZES[:-1]] + [torch.randn(128, 5)]
    original = [t.clone() for t in tensors]
    flat = partition.gather(tensors, 1)
    assert flat.shape == (partition.buffer_size,) and flat.dtype == torch.float32
    assert bool((flat[partition.slice_sizes[1]:] == 0).all())  # padding
    partition.scatter(tensors, 1, torch.zeros_like(flat))
    partition.scatter(tensors, 1, flat)
    assert all(torch.equal(t, o) for t, o in zip(tensors, original))
    with pytest.raises(ValueError):
        partition.gather(tensors[:-1], 0)
    with pytest.raises(IndexError):
        partition.indices(4)


def test_delta_rule_keeps_the_local_steps_taken_during_the_round():
    partition = SlicePartition(SIZES, 4, seed=2)
    weights = [torch.randn(n) for n in SIZES]
    snapshot = partition.gather(weights, 3)  # round starts
    local_step = [torch.randn(n) for n in SIZES]
    before = [w.clone() for w in weights]
    for w, u in zip(weights, local_step):  # training goes on meanwhile
        w.add_(u)
    average = torch.randn_like(snapshot)  # what the group agreed on
    partition.scatter_add(weights, 3, average - snapshot)
    # In the slice: the average plus what was learned since the snapshot.
    expected = average + partition.gather(local_step, 3)
    assert torch.allclose(partition.gather(weights, 3)[:partition.slice_sizes[3]],
                          expected[:partition.slice_sizes[3]], atol=1e-6)
    # Outside it: untouched local training.
    for s in range(3):
        assert torch.allclose(partition.gather(weights, s),
                              partition.gather([b + u for b, u in zip(before, local_step)], s), atol=1e-6)


def test_rounds_are_due_every_n_steps_or_when_announced():
    assert next_round(19, 20, 0).round is None
    assert next_round(20, 20, 0).round == 1
    assert next_round(20, 20, 1).round is None
    decision = next_round(65, 20, 1)  # a long round: rounds 2 came and went
    assert (decision.round, decision.skipped) == (3, 1)
    # A faster replica announced round 5: join it now rather than start our own round 2.
    decision = next_round(41, 20, 1, announced=5)
    assert (decision.round, decision.skipped) == (5, 3)
    assert next_round(41, 20, 5, announced=5).round is None  # already done
    assert next_round(41, 20, 1, announced=1).round == 2  # a stale announcement changes nothing
    assert [round_slice(r, 20) for r in (0, 19, 20, 41)] == [0, 19, 0, 1]


def test_same_round_same_group_key_and_nothing_else():
    bits = [round_group_bits(r) for r in range(300)]
    assert all(len(set(bits[r:r + 2**GROUP_BITS])) == 2**GROUP_BITS for r in range(300 - 2**GROUP_BITS))
    assert all(len(b) == GROUP_BITS for b in bits)
    assert round_group_bits(5) == "0101"
    assert round_group_bits(5) == round_group_bits(5 + 2**GROUP_BITS)  # wraps, beyond any drift:
    assert 2**GROUP_BITS > 2 * ROUND_LEAD  # replicas join rounds at most ROUND_LEAD past the stage's
    assert all(is_valid_group(f"demo_stage1_sparta.0b{b}") for b in bits[:5])
    with pytest.raises(ValueError):
        round_group_bits(-1)


def test_round_records_and_keys_validate():
    record = RoundRecord(peer_id="peer", run_id="demo", stage=1, round=7, started_at=12.5)
    assert RoundRecord.from_wire(record.to_wire()) == record
    closed = RoundRecord(peer_id="peer", run_id="demo", stage=1, round=7, started_at=13.0, closed=True)
    assert RoundRecord.from_wire(closed.to_wire()).closed
    assert rounds_key("demo", 1, "sparta") == "demo.stage1.sparta.rounds"
    with pytest.raises(RecordError):
        RoundRecord(peer_id="peer", run_id="demo", stage=1, round=-1, started_at=0.0)
    with pytest.raises(RecordError):
        rounds_key("de.mo", 1, "sparta")


def test_weight_is_samples_since_the_last_round_and_zero_while_syncing():
    assert peer_weight(32, member=True) == 32.0
    assert peer_weight(0, member=True) == MEMBER_WEIGHT_FLOOR  # idle members still average evenly
    assert peer_weight(32, member=False) == 0.0


def test_outer_nesterov_step_is_torch_sgd_nesterov_on_the_averaged_delta():
    torch.manual_seed(0)
    anchor = torch.randn(50)
    param = torch.nn.Parameter(anchor.clone())
    sgd = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
    momentum = torch.zeros(50)
    for _ in range(4):
        local = anchor - 0.1 * torch.randn(50)  # where the inner steps took the replica
        param.grad = param.detach() - local
        sgd.step()
        anchor = outer_nesterov_step(anchor, local, momentum, lr=0.7, mu=0.9)
        assert torch.allclose(anchor, param.detach(), atol=1e-6)
    # lr 1, no momentum: plain averaging (the new anchor is the average itself).
    local = torch.randn(50)
    assert torch.allclose(outer_nesterov_step(anchor, local, torch.zeros(50), lr=1.0, mu=0.0), local)


def test_averaged_vector_and_bytes():
    assert averaged_vector_size(SyncConfig(), 100) == 100
    assert averaged_vector_size(SyncConfig(average_optimizer_state=True), 100) == 300
    assert averaged_vector_size(SyncConfig(method="diloco"), 100) == 200
    assert estimated_bytes(1000, 1) == 0 and estimated_bytes(1000, 2) == 1000 and estimated_bytes(900, 3) == 1200


def test_stage_sizes_come_from_shapes_alone():
    from agora.pipeline.stages import build_stage

    model = PRESETS["tiny"].with_stages(3).model
    stage = build_stage(model, 2)
    assert stage_parameter_numels(model, 2) == [p.numel() for p in stage.parameters() if p.requires_grad]


def test_sync_config_defaults_and_errors():
    default = SyncConfig()
    assert default.n_slices == 20 and default.every_steps == 20 and default.method == "sparta"
    assert (default.matchmaking_s, default.sender_s, default.reducer_s, default.round_s) == (40, 30, 60, 150)
    assert default.part_size_bytes == 2 * 2**20 and (default.outer_lr, default.outer_momentum) == (0.7, 0.9)
    assert SyncConfig(method="diloco", fragments=4).n_slices == 4
    assert SyncConfig(fraction=0.3).n_slices == math.ceil(1 / 0.3)
    tiny = PRESETS["tiny"].sync
    assert tiny.matchmaking_s < 10 and tiny.round_s < 60
    config = config_from_dict({"preset": "tiny", "sync": {"method": "diloco", "every_steps": 5}})
    assert config.sync.method == "diloco" and config.sync.every_steps == 5
    for values, field in [({"method": "gossip"}, "sync.method"), ({"fraction": 0}, "sync.fraction"),
                          ({"reducer_s": 1.0, "sender_s": 2.0}, "sync.reducer_s"),
                          ({"request_s": 50.0}, "sync.request_s"), ({"quorum": 0}, "sync.quorum"),
                          ({"method": "diloco", "average_optimizer_state": True}, "sync.average_optimizer_state")]:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            config_from_dict({"preset": "tiny", "sync": values})
