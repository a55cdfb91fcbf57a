"""What a GPU adds (pipeline/runtime.py): the stage on the device in bf16, pinned staging, CUDA-event
timing, host-resident weight copies, SPARTA on the device, and the memory plan against torch's
allocator statistics. Marked `cuda` and skipped without a CUDA device; bench/gpu.py runs these with
a whole demo, train-local and a pluralis-8b body stage on the device."""

from __future__ import annotations

import math
import time
from dataclasses import replace

import pytest
import torch

from memory_scenario import IN_FLIGHT, PINNED, steady_state

from agora.node.averaging.sparta import SlicePartition
from agora.node.membership.state_check import sketch_state
from agora.node.replica.compute import StageCompute
from agora.node.replica.stash import ForwardStash
from agora.node.replica.weight_versions import WeightCopies
from agora.pipeline.centralized import CentralizedTrainer
from agora.pipeline.codec import WireCodec, encode_tokens
from agora.pipeline.config import PRESETS, RuntimeConfig
from agora.pipeline.data import build_data
from agora.pipeline.memory import MemoryOptions, plan_stage
from agora.pipeline.runtime import Runtime
from agora.protos.stage_adapter import BackwardRequest, ForwardRequest, StepRequest

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.timeout(300)]

CODEC = WireCodec("fp32", max_bytes=2**26)


def _runtime(dtype="bf16") -> Runtime:
    return Runtime.from_config(RuntimeConfig(device="cuda", dtype=dtype))


def _config():
    config = PRESETS["tiny"].with_stages(3)
    return replace(config, train=replace(config.train, eval_every=0))


def test_a_bf16_stage_on_the_gpu_computes_what_the_cpu_does_within_bf16():
    config = _config()
    tokens = torch.randint(0, 256, (2, 128))
    wire = torch.randn(2, 128, config.model.wire_dim)
    request = ForwardRequest(run_id="r", stage=1, microbatch_id="m", tokens=encode_tokens(tokens, 256),
                             wire=CODEC.encode(wire))
    outputs = {}
    for name, runtime in (("cpu", Runtime()), ("cuda", _runtime())):
        body = StageCompute(config, 1, run_id="r", codec=CODEC, stash=ForwardStash(8, 60.0), synchronous=True,
                            runtime=runtime)
        outputs[name] = CODEC.decode(body.forward(request).wire)
        body.backward(BackwardRequest(run_id="r", stage=1, microbatch_id="m",
                                      output_grad=CODEC.encode(torch.ones_like(outputs[name]))))
        if name == "cuda":
            assert all(p.device.type == "cuda" and p.dtype == torch.float32 for p in body.stage.parameters())
            assert all(p.grad.dtype == torch.float32 for p in body.optimizer.parameters)
            body.step(StepRequest(run_id="r", stage=1, step=0, microbatches=1))
            assert body.throughput > 0
    torch.testing.assert_close(outputs["cuda"], outputs["cpu"], rtol=0.05, atol=0.05)


def test_staging_is_pinned_and_copies_round_trip():
    runtime = _runtime()
    host = runtime.host_buffer((4, 8))
    assert host.is_pinned()
    host.copy_(torch.arange(32.0).view(4, 8))
    device = runtime.to_device(host)
    assert device.device.type == "cuda"
    back = runtime.to_host(device * 2)
    assert back.is_pinned() and torch.equal(back, torch.arange(32.0).view(4, 8) * 2)
    kept = runtime.keep_on_host(device)
    torch.cuda.synchronize()
    assert kept.is_pinned() and torch.equal(kept, host)


def test_job_timer_counts_the_kernels_not_the_launch():
    runtime = _runtime()
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    timer = runtime.timer()
    timer.start()
    launched = time.perf_counter()
    for _ in range(20):
        a = a @ a / 64
    launch_only = time.perf_counter() - launched
    assert timer.seconds() > launch_only


def test_weight_copies_live_in_pinned_host_memory_and_come_back_exactly():
    runtime = _runtime()
    weights = [torch.randn(64, 32, device="cuda"), torch.randn(32, device="cuda")]
    copies = WeightCopies(runtime, 2)
    copies.keep(0, weights)
    before = [w.clone() for w in weights]
    for w in weights:
        w.add_(1.0)  # the step that follows, on the same stream
    again = copies.weights(0)
    assert copies.on_host and all(b.is_pinned() for b in copies._copies[0])
    assert all(torch.equal(a, b) and a.device.type == "cuda" for a, b in zip(again, before))
    assert torch.cuda.memory_allocated() > 0


def test_sparta_slices_are_the_same_on_the_gpu():
    sizes = [10, 7, 0, 33, 3, 640, 100_003]
    partition = SlicePartition(sizes, 4, seed=5)
    cpu = [torch.randn(n) for n in sizes]
    gpu = [t.cuda() for t in cpu]
    for s in range(4):
        assert all(torch.equal(a, b.cpu()) for a, b in zip(partition.indices(s), partition.indices(s, "cuda")))
        torch.testing.assert_close(partition.gather(gpu, s), partition.gather(cpu, s), rtol=0, atol=0)
        partition.scatter_add(gpu, s, torch.ones(partition.buffer_size))
        partition.scatter_add(cpu, s, torch.ones(partition.buffer_size))
    assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu, gpu))


def test_a_state_sketch_on_the_gpu_is_the_cpus():
    """A donor on a GPU answers a joiner on a CPU: the same signs (an integer hash), the same sums to
    float32 rounding, far inside any drift bound (node/membership/state_check.py)."""
    generator = torch.Generator().manual_seed(3)
    cpu = {"w": torch.randn(3_000_001, generator=generator), "b": torch.zeros(7), "m": torch.randn(640, 33)}
    here = sketch_state(cpu, 987654321, 256)
    there = sketch_state({name: tensor.cuda() for name, tensor in cpu.items()}, 987654321, 256)
    for name in cpu:
        assert there.vectors[name].device.type == "cpu"
        torch.testing.assert_close(there.vectors[name], here.vectors[name], rtol=1e-5, atol=1e-5)
        assert math.isclose(there.norms[name], here.norms[name], rel_tol=1e-9)


def test_train_local_learns_in_bf16_on_the_gpu():
    config = replace(_config(), runtime=RuntimeConfig(device="cuda", dtype="bf16"))
    trainer = CentralizedTrainer(config, build_data(config))
    records = trainer.run(30)
    assert records[-1].loss < records[0].loss - 1.0
    assert all(s.basis.T.dtype == torch.bfloat16 and s.basis.T.device.type == "cuda" for s in trainer.stages)


@pytest.mark.parametrize("index", [0, 1, 2])
def test_plan_matches_the_cuda_allocator(index):
    """torch.cuda.max_memory_allocated over a worker's steady state (tests/helpers/memory_scenario.py, after
    cuBLAS' workspace exists) against the plan's peak without its reserve (the context and the
    allocator's slack are not allocations); pinned copies and Abort records are in host memory."""
    config = _config()
    options = MemoryOptions(microbatch=config.train.microbatch_size, seq_len=config.train.seq_len,
                            in_flight=IN_FLIGHT, pinned_versions=PINNED, applied=config.train.microbatches)
    plan = plan_stage(config, index, options, device_type="cuda", dtype="bf16")
    warm = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    (warm @ warm).sum().item()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    steady_state(config, index, _runtime(), config.train.microbatches, torch.cuda.synchronize)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - baseline
    assert plan.peak - plan.reserve == pytest.approx(measured, rel=0.05), (plan.as_dict(), measured)
