"""The pools of calls a node's gRPC server serves at once (node/rpc/call_slots.py), without sockets."""

from __future__ import annotations

import pytest

from agora.node.rpc.call_slots import DEFAULT_PROBE_CALLS, REFUSAL_ROOM, CallPool, CallSlots, is_probe


def test_health_and_reflection_are_probes_and_our_services_are_not():
    for method in ("/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch",
                   "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                   "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"):
        assert is_probe(method), method
    for method in ("/agora.v1.Stage/Forward", "/agora.v1.Stage/Info", "/agora.v1.Authorizer/Join",
                   "grpc.health.v1.Health", "/grpc.health.v1.Health", ""):
        assert not is_probe(method), method


def test_a_pool_refuses_a_caller_over_its_share_then_everyone_when_full_and_frees_on_give_back():
    pool = CallPool("health and reflection calls", capacity=3, per_caller=2, setting="worker.max_probe_calls")
    pool.take("a")
    pool.take("a")
    reason, message = pool.refusal("a")
    assert reason == "caller_limit" and "at most 2 per caller" in message and "worker.max_probe_calls" in message
    pool.take("b")
    reason, message = pool.refusal("c")
    assert reason == "full" and "at most 3 health and reflection calls" in message
    with pytest.raises(RuntimeError):
        pool.take("c")
    pool.give_back("a")
    assert pool.refusal("c") is None and pool.refusal("a") is None
    pool.give_back("a")
    pool.give_back("b")
    assert pool.in_use == 0 and pool.held_by("a") == 0


def test_a_pool_needs_a_share_within_its_capacity():
    with pytest.raises(ValueError, match="worker.max_probe_calls"):
        CallPool("probes", capacity=2, per_caller=3, setting="worker.max_probe_calls")


def test_grpc_counts_both_pools_and_room_for_refusals_and_one_caller_gets_half_the_probes():
    slots = CallSlots(calls=10, probe_calls=5)
    assert slots.grpc_limit == 10 + 5 + REFUSAL_ROOM
    assert slots.probes.per_caller == 3 and slots.calls.per_caller == 10
    assert slots.pool_of("/grpc.health.v1.Health/Watch") is slots.probes
    assert slots.pool_of("/agora.v1.Stage/Forward") is slots.calls
    unbounded = CallSlots(probe_calls=1)  # the authorizer: only probes are counted
    assert unbounded.grpc_limit is None and unbounded.pool_of("/agora.v1.Authorizer/Join") is None
    assert unbounded.probes.per_caller == 1


def test_link_probes_have_a_pool_of_their_own_one_per_caller():
    slots = CallSlots(calls=10, probe_calls=5, link_probe_calls=2)
    assert slots.grpc_limit == 10 + 5 + 2 + REFUSAL_ROOM
    pool = slots.pool_of("/agora.v1.Stage/ProbeLink")
    assert pool is slots.link_probes and pool.capacity == 2 and pool.per_caller == 1
    pool.take("prober")
    reason, message = pool.refusal("prober")
    assert reason == "caller_limit" and "at most 1 per caller" in message
    pool.take("another")
    reason, message = pool.refusal("third")
    assert reason == "full" and "at most 2 link probes" in message
    assert slots.calls.refusal("third") is None  # the training calls' pool is untouched
    without = CallSlots(calls=10)  # a server that serves no link probe (the authorizer's)
    assert without.link_probes is None and without.grpc_limit == 10 + DEFAULT_PROBE_CALLS + REFUSAL_ROOM
