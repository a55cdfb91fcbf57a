"""Pure rules of inference serving, without sockets: the session table's bounds (node/inference/sessions.py),
replica choice (node/inference/routing.py), and the door's inference geometry (node/replica/bounds.py)."""

from __future__ import annotations

import pytest
import torch

from agora.node.inference.routing import ReplicaRoster, ReplicaView, pick_replica
from agora.node.inference.sessions import NotSessionOwner, SessionRefused, SessionsFull, SessionTable, UnknownSession
from agora.node.replica.bounds import HEADROOM_BYTES, OutOfBounds, RequestGeometry
from agora.pipeline.codec import WireCodec, encode_tokens, float_frame_bytes
from agora.pipeline.config import PRESETS
from agora.protos.stage_adapter import InferRequest


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Cache:
    def __init__(self, nbytes: int = 10):
        self.nbytes = nbytes


def table(max_sessions=4, max_tokens=64, ttl_s=30.0):
    clock = Clock()
    return SessionTable(max_sessions, max_tokens, ttl_s, where="stage 1", clock=clock), clock


def test_a_session_is_its_openers_and_unknown_ones_say_replay():
    sessions, _ = table()
    sessions.open("a", "alice", 0, Cache(), step=3)
    assert sessions.get("a", "alice").started_step == 3 and sessions.get("a", "alice").max_tokens == 64
    with pytest.raises(NotSessionOwner, match="another caller"):
        sessions.get("a", "bob")
    with pytest.raises(NotSessionOwner):
        sessions.close("a", "bob")
    with pytest.raises(NotSessionOwner):
        sessions.open("a", "bob", 0, Cache(), step=0)  # nobody replaces someone else's session
    with pytest.raises(UnknownSession, match="'b' is not open on stage 1.*replay its tokens with Prefill"):
        sessions.get("b", "alice")
    assert sessions.close("a", "alice") and not sessions.close("a", "alice")


def test_declared_bounds_are_refused_at_open_and_at_every_call():
    sessions, _ = table(max_tokens=64)
    with pytest.raises(SessionRefused, match="max_tokens: 65 positions, stage 1 holds at most 64"):
        sessions.open("a", "alice", 65, Cache(), step=0)
    session = sessions.open("a", "alice", 10, Cache(), step=0)
    sessions.check_room(session, 8, 2)
    with pytest.raises(SessionRefused, match="positions up to 11 exceed the 10"):
        sessions.check_room(session, 8, 3)


def test_idle_sessions_expire_and_used_ones_stay():
    sessions, clock = table(ttl_s=30.0)
    sessions.open("old", "alice", 0, Cache(), step=0)
    sessions.open("busy", "alice", 0, Cache(), step=0)
    clock.now = 20.0
    sessions.get("busy", "alice")
    clock.now = 40.0
    assert "busy" in sessions and sessions.get("busy", "alice")
    with pytest.raises(UnknownSession):
        sessions.get("old", "alice")
    assert sessions.evictions["ttl"] == 1


def test_a_full_table_evicts_the_largest_holders_least_recently_used():
    sessions, clock = table(max_sessions=4)
    for name, owner in (("b1", "bob"), ("a1", "alice"), ("a2", "alice"), ("a3", "alice")):
        clock.now += 1
        sessions.open(name, owner, 0, Cache(), step=0)
    clock.now += 1
    sessions.get("a1", "alice")  # a2 is now alice's least recently used
    sessions.open("b2", "bob", 0, Cache(), step=0)  # bob holds fewer: alice's LRU goes
    assert "a2" not in sessions and all(name in sessions for name in ("b1", "a1", "a3", "b2"))
    sessions.open("a4", "alice", 0, Cache(), step=0)  # alice and bob tie at 2: the caller's own goes
    assert "b1" in sessions and "b2" in sessions and "a3" not in sessions
    assert sessions.evictions["capacity"] == 2 and sessions.cache_bytes == 40


def test_the_caches_bytes_are_bounded_and_a_session_past_them_refused_while_the_others_stay():
    """Budget 100 bytes: a session that would pass it, opening or growing, is SessionsFull and nothing
    changes (no eviction, the others keep their caches); what a replay replaces, and the session an
    opening evicts for the count, leave room for it."""
    sessions, _ = table(max_sessions=3)
    sessions.max_cache_bytes = 100
    a = sessions.open("a", "alice", 0, Cache(40), step=0, cache_bytes=40)
    sessions.open("b", "bob", 0, Cache(40), step=0, cache_bytes=40)
    with pytest.raises(SessionsFull, match="session 'c' would take the attention caches on stage 1 to 120 bytes, "
                                           "past the 100 .*the open sessions keep theirs") as refused:
        sessions.open("c", "carol", 0, Cache(), step=0, cache_bytes=40)
    assert (refused.value.needed, refused.value.budget) == (120, 100)
    assert len(sessions) == 2 and "c" not in sessions and not sessions.evictions
    sessions.check_room(a, 0, 8, cache_bytes=60)  # a grows to 60: 100 in all, the budget
    with pytest.raises(SessionsFull, match="session 'a' .* to 101 bytes"):
        sessions.check_room(a, 0, 8, cache_bytes=61)
    assert sessions.get("a", "alice") is a and sessions.get("b", "bob")
    sessions.open("a", "alice", 0, Cache(60), step=0, cache_bytes=60)  # a replay: its old 40 bytes go
    sessions.max_sessions = 2  # full by count: opening evicts bob's, whose bytes make the room
    sessions.open("c", "carol", 0, Cache(40), step=0, cache_bytes=40)
    assert "b" not in sessions and sessions.evictions["capacity"] == 1 and sessions.cache_bytes == 100


def test_replicas_are_chosen_by_latency_and_load_and_bans_last():
    fast = ReplicaView("fast", "h:1", 1, seconds=0.01)
    slow = ReplicaView("slow", "h:2", 1, seconds=0.03)
    assert pick_replica([fast, slow], now=0.0).peer_id == "fast"
    fast.open_sessions = 3  # (3 + 1) * 0.01 > (0 + 1) * 0.03
    assert pick_replica([fast, slow], now=0.0).peer_id == "slow"
    new = ReplicaView("new", "h:3", 1)  # not measured: the slowest known time, so its empty queue wins
    assert pick_replica([fast, slow, new], now=0.0).peer_id in ("new", "slow")
    training = ReplicaView("train", "h:4", 1, phase="weight_sync")
    assert pick_replica([training], now=0.0) is None
    roster = ReplicaRoster(ban_base_s=2.0)
    roster.refresh([ReplicaView("a", "h:1", 0), ReplicaView("b", "h:2", 0)])
    assert roster.failed("a", now=10.0) == 2.0 and roster.failed("a", now=10.0) == 4.0
    assert roster.choose(0, now=11.0).peer_id == "b"
    assert roster.choose(0, now=11.0, exclude=frozenset({"b"})) is None
    assert roster.choose(0, now=14.5, exclude=frozenset({"b"})).peer_id == "a"
    roster.succeeded("a", 0.5)
    roster.refresh([ReplicaView("a", "h:1", 0, announced_sessions=2)])
    assert roster.replicas["a"].seconds == 0.5 and roster.replicas["a"].failures == 0 and "b" not in roster.replicas


CONFIG = PRESETS["tiny"].with_stages(3)
K = CONFIG.model.wire_dim


def _infer(stage: int, rows: int, positions: int, width: int = K) -> InferRequest:
    tokens = encode_tokens(torch.zeros(rows, positions, dtype=torch.long), 256)
    wire = b"" if stage == 0 else WireCodec().encode(torch.zeros(rows, positions, width))
    return InferRequest(run_id="r", stage=stage, session_id="s", tokens=tokens, wire=wire)


def test_the_inference_geometry_bounds_positions_by_the_session_and_names_the_flag():
    body = RequestGeometry.from_config(CONFIG, 1).for_inference(256)
    body.check_inference(_infer(1, 2, 256))  # past train.seq_len (128): a session is longer than a sample
    with pytest.raises(OutOfBounds, match="sequence length 257, at most 256 .*--max-session-tokens"):
        body.check_inference(_infer(1, 1, 257))
    with pytest.raises(OutOfBounds, match="tokens: 3 rows, at most 2"):
        body.check_inference(_infer(1, 3, 4))
    with pytest.raises(OutOfBounds, match="last dim 7"):
        body.check_inference(_infer(1, 1, 4, width=7))
    with pytest.raises(OutOfBounds, match="wire: missing"):
        body.check_inference(_infer(0, 1, 4))  # a head's request has no wire
    head = RequestGeometry.from_config(CONFIG, 0).for_inference(256)
    with pytest.raises(OutOfBounds, match="head stage takes token ids only"):
        head.check_inference(_infer(1, 1, 4))
    tokens = 7 + 4 * 2 + 4 * 2 * 256
    assert body.inference_budget() == tokens + float_frame_bytes((2, 256, K), "fp32") + HEADROOM_BYTES
    assert head.inference_budget() == tokens + HEADROOM_BYTES
