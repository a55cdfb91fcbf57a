"""Traces from a real demo: trainer and workers as `agora-node` processes (admitted, mutual TLS), given
`--otlp-endpoint` by the demo, export over OTLP/gRPC to a collector in this test's process
(bench/tracing_cost.py's TraceService). Every traced call of the trainer has its worker's span:
the trace context crossed the process boundary in the calls' metadata, behind the credential check.
"""

from __future__ import annotations

import pytest

from agora.bench.tracing_cost import TraceCollector
from agora.node.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_demo_sends_every_hop_of_its_sampled_microbatches_to_the_collector(tmp_path):
    steps, microbatches = 2, 4  # tiny's
    with TraceCollector() as collector:
        code = main(["demo", "--stages", "2", "--steps", str(steps), "--no-monitor",
                     "--workdir", str(tmp_path / "work"), "--otlp-endpoint", collector.endpoint, "--trace-sample", "1"])
    assert code == 0
    trainer, worker = collector.spans["agora-trainer"], collector.spans["agora-worker"]
    assert trainer["Backward stage 0"] == worker["Backward"] == steps * microbatches
    # Training and held-out microbatches alike: one root each, at least one Forward per stage under it (a
    # Forward answered busy on a loaded machine is tried again, a span each), every one answered by a
    # worker's span.
    assert trainer["microbatch"] >= steps * microbatches
    assert trainer["Forward stage 0"] >= trainer["microbatch"] and trainer["Forward stage 1"] >= trainer["microbatch"]
    assert worker["Forward"] == trainer["Forward stage 0"] + trainer["Forward stage 1"]
