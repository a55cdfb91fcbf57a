"""Which announced metrics endpoints the monitor's `/sd` lists (monitor/scrape_policy.py), and the
view's targets and left-out endpoints built from records (monitor/swarm_view.py). Pure: no sockets."""

from __future__ import annotations

import pytest

from agora.dht.records import TrainerRecord, WorkerRecord
from agora.monitor.scrape_policy import host_key, trainer_target_refusal, worker_target_refusal
from agora.monitor.options import parse_trainer_host
from agora.monitor.swarm_view import LeftOutTarget, StaticTarget, scrape_targets, summarize

RUN = "sd"


def worker(peer: str, stage: int, endpoint: str, metrics: str) -> WorkerRecord:
    return WorkerRecord(peer_id=peer, run_id=RUN, endpoint=endpoint, stage=stage, n_stages=2, throughput=1.0,
                        queue_depth=0, step=1, phase="member", version="1", updated_at=1.0, fingerprint="f",
                        metrics_endpoint=metrics)


def trainer(peer: str, index: int, metrics: str) -> TrainerRecord:
    return TrainerRecord(peer_id=peer, run_id=RUN, trainer_index=index, batches=1, step=1, loss=2.0,
                         tokens_per_s=1.0, version="1", updated_at=1.0, metrics_endpoint=metrics)


def test_a_worker_is_scraped_only_on_the_host_of_its_grpc_endpoint():
    assert worker_target_refusal("203.0.113.5:5000", "203.0.113.5:9100") is None
    assert worker_target_refusal("127.0.0.1:5000", "127.0.0.1:9100") is None  # the demo: all on loopback
    assert worker_target_refusal("[::1]:5000", "[0:0::1]:9100") is None  # one address, two spellings
    assert worker_target_refusal("Node-7.example.org:5000", "node-7.example.org.:9100") is None
    assert worker_target_refusal("203.0.113.5:5000", "198.51.100.7:9100") == "other_host"  # another machine
    assert worker_target_refusal("203.0.113.5:5000", "10.0.0.5:9100") == "other_host"  # private beside public
    assert worker_target_refusal("203.0.113.5:5000", "127.0.0.1:9100") == "other_host"  # the scraper's own
    assert worker_target_refusal("203.0.113.5:5000", "metrics.example.org:9100") == "other_host"
    assert worker_target_refusal("0.0.0.0:5000", "0.0.0.0:9100") == "wildcard"


def test_a_trainer_is_scraped_only_on_a_host_the_operator_named():
    known = {host_key("10.0.0.2"), host_key("ops.example.org")}
    assert trainer_target_refusal("10.0.0.2:9300", known) is None
    assert trainer_target_refusal("OPS.example.org:9300", known) is None
    assert trainer_target_refusal("10.0.0.3:9300", known) == "unknown_host"
    assert trainer_target_refusal("127.0.0.1:9300", set()) == "unknown_host"
    assert trainer_target_refusal("[::]:9300", {host_key("::")}) == "wildcard"


def test_the_view_lists_accepted_endpoints_and_keeps_the_left_out_ones_with_their_peer():
    workers = {0: [worker("honest", 0, "203.0.113.5:5000", "203.0.113.5:9100"),
                   worker("pointer", 0, "203.0.113.6:5000", "10.0.0.5:9100")],
               1: [worker("elsewhere", 1, "203.0.113.7:5000", "198.51.100.7:9100"),
                   worker("quiet", 1, "203.0.113.8:5000", "")]}
    trainers = [trainer("t-ops", 0, "10.0.0.2:9300"), trainer("t-named", 1, "192.0.2.4:9300"),
                trainer("t-stray", 2, "203.0.113.5:22"), trainer("t-quiet", 3, "")]
    view = summarize(RUN, workers, trainers, n_stages=2, now=1.0,
                     static_targets=(StaticTarget("authorizer", "10.0.0.2:9200"),), trainer_hosts=("192.0.2.4",))
    assert [group["targets"] for group in scrape_targets(view)] == [
        ["203.0.113.5:9100"], ["10.0.0.2:9300"], ["192.0.2.4:9300"], ["10.0.0.2:9200"]]
    # A trainer naming a worker's machine is not listed: that host vouches for the worker only.
    assert view.left_out == (LeftOutTarget("worker", "pointer", "10.0.0.5:9100", "other_host"),
                             LeftOutTarget("worker", "elsewhere", "198.51.100.7:9100", "other_host"),
                             LeftOutTarget("trainer", "t-stray", "203.0.113.5:22", "unknown_host"))
    assert view.stages[0].workers[1].metrics_endpoint == "10.0.0.5:9100"  # the status page still shows the claim
    assert view.to_json()["targets"] == 4


def test_trainer_hosts_are_names_or_addresses_never_a_port_or_a_wildcard():
    assert parse_trainer_host("10.0.0.2") == "10.0.0.2"
    assert parse_trainer_host("[0:0::1]") == "::1" and parse_trainer_host("::1") == "::1"
    assert parse_trainer_host("Ops.Example.org") == "ops.example.org"
    for bad, message in (("10.0.0.2:9300", "no port"), ("", "no port"), ("a b", "no port"),
                         ("0.0.0.0", "every interface"), ("[::]", "every interface")):
        with pytest.raises(ValueError, match=message):
            parse_trainer_host(bad)
