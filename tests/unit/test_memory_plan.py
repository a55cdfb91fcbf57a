"""The memory plan (pipeline/memory.py) against what a real worker allocates, and `agora-node plan`.

How the real bytes are counted: `LiveBytes` is active while a real `StageCompute` is built and
driven into its steady state on the CPU, so every tensor storage an ATen operator allocates in
that time is added when it is created and taken off when its storage is freed (a weak reference to
the storage). At the end its count is what the worker holds (weights, U and T, `.grad`, Adam
state, pinned weight copies, stashed inputs, Abort records), and its peak is the worst moment of
the last job. This is the sum of the tensor storages actually allocated, measured on real tensors
and real kernels; the plan computes the same from the module definitions on fake tensors (meta
storage, nothing allocated) and its own bookkeeping of what a worker keeps. (Token ids decoded by
numpy are not ATen allocations and are not counted: a few KB here.)
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from memory_scenario import CODEC, IN_FLIGHT, PINNED, Driver, steady_state

from agora.node.cli import main
from agora.node.replica.compute import StageCompute
from agora.node.replica.stash import ForwardStash
from agora.pipeline.config import PRESETS, RuntimeConfig
from agora.pipeline.memory import LiveBytes, MemoryOptions, plan_run, plan_stage
from agora.pipeline.runtime import Runtime

pytestmark = pytest.mark.timeout(240)


def _steady_state(config, index: int, runtime: Runtime, applied: int) -> tuple[int, int]:
    """(bytes held, peak bytes of the last job) of a real worker in the plan's steady state."""
    counter = LiveBytes()

    def last_job_starts():
        counter.peak = counter.held()

    with counter:
        compute = steady_state(config, index, runtime, applied, last_job_starts)
        held = counter.held()
    del compute
    return held, counter.peak


def test_stages_of_one_shape_share_a_plan_equal_to_their_own():
    config = PRESETS["tiny"].with_stages(6)  # a block a stage: four bodies of one shape
    options = MemoryOptions(microbatch=2, seq_len=32, in_flight=4, pinned_versions=1, applied=2)
    shared = plan_run(config, options, device_type="cpu", dtype="fp32")
    assert shared == [plan_stage(config, i, options, device_type="cpu", dtype="fp32") for i in range(6)]


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("index", [0, 1, 2])
def test_plan_matches_what_a_worker_allocates_on_the_cpu(preset, index):
    config = PRESETS[preset].with_stages(3)
    applied = config.train.microbatches
    options = MemoryOptions(microbatch=config.train.microbatch_size, seq_len=config.train.seq_len,
                            in_flight=IN_FLIGHT, pinned_versions=PINNED, applied=applied)
    plan = plan_stage(config, index, options, device_type="cpu", dtype="fp32")
    held, peak = _steady_state(config, index, Runtime(), applied)
    assert plan.state == pytest.approx(held, rel=0.05), plan.as_dict()
    assert plan.peak == pytest.approx(peak, rel=0.05), (plan.as_dict(), peak)
    assert plan.reserve == 0 and plan.host == 0


@pytest.mark.parametrize("index", [1, 2])
def test_plan_matches_a_bf16_worker_too(index):
    """Autocast's bf16 copies of the weights and bf16 activations, U and T stored in bf16."""
    config = PRESETS["tiny"].with_stages(3)
    options = MemoryOptions(microbatch=config.train.microbatch_size, seq_len=config.train.seq_len,
                            in_flight=IN_FLIGHT, pinned_versions=PINNED, applied=config.train.microbatches)
    plan = plan_stage(config, index, options, device_type="cpu", dtype="bf16")
    fp32 = plan_stage(config, index, options, device_type="cpu", dtype="fp32")
    held, peak = _steady_state(config, index, Runtime.from_config(RuntimeConfig(device="cpu", dtype="bf16")),
                               config.train.microbatches)
    assert plan.fixed == fp32.fixed // 2 and plan.parameters == fp32.parameters  # master weights stay fp32
    assert plan.state == pytest.approx(held, rel=0.05), plan.as_dict()
    assert plan.peak == pytest.approx(peak, rel=0.05), (plan.as_dict(), peak)


def test_pluralis_body_stage_on_a_gpu_keeps_pinned_versions_on_the_host():
    config = PRESETS["pluralis-8b"]
    options = MemoryOptions(microbatch=1, seq_len=4096, in_flight=64, pinned_versions=2, applied=8)
    plan = plan_stage(config, 1, options, device_type="cuda", dtype="bf16")
    weights = plan.trainable * 4
    assert plan.parameters == weights and plan.gradients == weights
    assert plan.optimizer == pytest.approx(2 * weights, rel=1e-6)
    assert plan.fixed == 2 * (config.model.vocab_size + config.model.rank) * config.model.d_model  # bf16 U, T
    assert plan.pinned == 2 * weights and plan.host >= plan.pinned and plan.pinned_on_host
    assert plan.working_job == "backward on a pinned version" and plan.reserve > 0
    assert plan.peak < 40 * 2**30  # fits a 40 GB card with the pinned versions on the host


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_plan_counts_the_inference_sessions_cache_budget_as_held(dtype):
    """What a position costs is what a real session's cache holds per position (fp32 keys after RoPE
    beside bf16 values under autocast); the default budget is the sessions' positions at that cost,
    `max_kv_cache_gib` replaces it, and either is held state: it moves the state and the peak."""
    from agora.node.inference.options import InferenceOptions
    from agora.node.plan import worker_memory_options
    from agora.pipeline.inference import StageCache, cached_forward
    from agora.pipeline.stages import build_stage

    config = PRESETS["tiny"].with_stages(3)
    runtime = Runtime.from_config(RuntimeConfig(device="cpu", dtype=dtype))
    stage = runtime.place_stage(build_stage(config.model, 1))
    cache = StageCache(stage)
    with runtime.autocast():
        cached_forward(stage, torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 5, config.model.wire_dim), cache)
    default = worker_memory_options(config)
    assert default.session_positions == 32 * config.model.max_seq_len and default.kv_cache_bytes is None
    without = plan_stage(config, 1, replace(default, session_positions=0), device_type="cpu", dtype=dtype)
    plan = plan_stage(config, 1, default, device_type="cpu", dtype=dtype)
    assert plan.kv_per_position == cache.nbytes // 10 and without.kv_cache == 0
    assert plan.kv_cache == default.session_positions * plan.kv_per_position
    assert (plan.state - without.state, plan.peak - without.peak) == (plan.kv_cache, plan.kv_cache)
    assert InferenceOptions().kv_cache_bytes(config, plan.kv_per_position) == plan.kv_cache  # the worker's budget
    set_to = worker_memory_options(config, inference=InferenceOptions(max_kv_cache_gib=0.5))
    assert plan_stage(config, 1, set_to, device_type="cpu", dtype=dtype).kv_cache == 2**29


def test_plan_command_and_join_count_the_cache_budget_they_are_given(capsys):
    assert main(["plan", "--config", "tiny", "--max-kv-cache-gib", "0.25", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["kv_cache_bytes"] == 2**28 and printed["stages"][0]["kv_cache"] == 2**28
    assert main(["plan", "--config", "tiny", "--max-kv-cache-gib", "0"]) == 2
    assert "plan.max_kv_cache_gib: must be > 0, got 0.0" in capsys.readouterr().err
    code = main(["join", "--insecure", "--config", "tiny", "--stage", "0", "--device", "cpu",
                 "--max-kv-cache-gib", "1000000"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("agora-node join: error: memory plan: stage 0 (full) needs 1000000.")
    assert "a --max-kv-cache-gib below the sessions' 1000000.00" in err[-1]


def test_plan_command_prints_every_stage_and_whether_it_fits(capsys):
    assert main(["plan", "--config", "pluralis-8b", "--dtype", "bf16", "--device", "cuda", "--microbatch", "1",
                 "--memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("memory plan: pluralis-8b, 7 stages, cuda bf16, microbatch 1 x 4096")
    assert "peak" in lines[1] and "fits 80 GB" in lines[1]
    assert [line.split()[1] for line in lines[2:9]] == ["head", "body", "body", "body", "body", "body", "tail"]
    assert all(line.split()[-1] in ("yes", "GiB") for line in lines[2:9])
    assert main(["plan", "--config", "pluralis-8b", "--stages", "2", "--memory-gb", "24", "--device", "cuda"]) == 1
    out = capsys.readouterr().out
    assert out.count("no, short") == 2


def test_plan_command_refuses_bad_flags_in_one_line(capsys):
    assert main(["plan", "--config", "tiny", "--microbatch", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "agora-node plan: error: plan.microbatch: must be > 0, got 0"
    for flag, value, bound in (("--pinned-weights", "-1", ">= 0"), ("--in-flight", "0", "> 0"),
                               ("--memory-gb", "0", "> 0")):
        assert main(["plan", "--config", "tiny", flag, value]) == 2
        field = flag.removeprefix("--").replace("-", "_")
        assert capsys.readouterr().err.strip() == f"agora-node plan: error: plan.{field}: must be {bound}, got " + (
            value if flag != "--memory-gb" else "0.0")


def test_join_refuses_a_stage_that_does_not_fit_before_starting_anything(capsys):
    """A pluralis-8b body stage at 64 rows per microbatch needs terabytes: refused in one line that
    names the shortfall, before any DHT peer, port or stage exists (it returns within the plan's time)."""
    code = main(["join", "--insecure", "--config", "pluralis-8b", "--stage", "1", "--max-rows", "64",
                 "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("agora-node join: error: memory plan: stage 1 (body) needs ")
    assert "this machine's RAM" in err[-1] and "short by" in err[-1] and "--dtype bf16" in err[-1]


def test_join_plans_a_geometry_once_per_cache_and_plans_again_what_differs(tmp_path, monkeypatch):
    import agora.pipeline.memory as memory
    from agora.node.plan import _plan_key, cached_plan_stage

    monkeypatch.setenv("AGORA_CACHE_DIR", str(tmp_path))
    config = PRESETS["tiny"].with_stages(3)  # stage 1: a body, which stashes
    runtime, options = Runtime(), MemoryOptions(microbatch=2, seq_len=64, in_flight=3, pinned_versions=2, applied=4)
    planned = []

    def counting(*args, **kwargs):
        planned.append(args[1])
        return plan_stage(*args, **kwargs)

    monkeypatch.setattr(memory, "plan_stage", counting)
    first = cached_plan_stage(config, 1, runtime, options)
    assert first == plan_stage(config, 1, options, device_type="cpu", dtype="fp32") and planned == [1]
    # Another seed sizes nothing differently: the same entry.
    reseeded = replace(config, seed=7, model=replace(config.model, basis_seed=7))
    assert cached_plan_stage(reseeded, 1, runtime, options) == first and planned == [1]
    # Another stage, other worker options or another geometry: planned anew.
    cached_plan_stage(config, 0, runtime, options)
    deeper = cached_plan_stage(config, 1, runtime, replace(options, in_flight=9))
    assert deeper.stash > first.stash
    cached_plan_stage(replace(config, model=replace(config.model, d_ff=config.model.d_ff * 2)), 1, runtime, options)
    assert planned == [1, 0, 1, 1]
    # An entry that no longer reads (a crash mid-write, an older layout) is planned and written again.
    entries = sorted((tmp_path / "plans").iterdir())
    assert len(entries) == 4
    for entry in entries:
        entry.write_text('{"index": 1')
    assert cached_plan_stage(config, 1, runtime, options) == first and planned == [1, 0, 1, 1, 1]
    assert cached_plan_stage(config, 1, runtime, options) == first and len(planned) == 5
    # So is one whose fields have the wrong types.
    entry = tmp_path / "plans" / f"{_plan_key(config, 1, runtime, options)}.json"
    entry.write_text(json.dumps({**json.loads(entry.read_text()), "stash": str(first.stash)}))
    assert cached_plan_stage(config, 1, runtime, options) == first and len(planned) == 6


def test_the_hardware_report_names_the_memory_the_plan_checks_against():
    from agora.auth.admission import hardware_report
    from agora.pipeline.runtime import device_memory

    report = hardware_report(torch.device("cpu"))
    assert report.device == "cpu" and report.accelerator_memory_bytes == 0
    assert report.ram_bytes == device_memory(torch.device("cpu")).total_bytes > 0


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_sparta_slices_keep_nothing_per_parameter_and_stay_inside_the_plan(preset):
    """The partition stores no index per parameter (the cached order it replaced held 4 bytes per
    parameter from the first round on); a round's gather only briefly holds its slice's indices,
    well inside the working set the plan already reserves for a job."""
    from agora.node.averaging.sparta import SlicePartition

    config = PRESETS[preset].with_stages(3)
    compute = StageCompute(config, 1, run_id="run", codec=CODEC, stash=ForwardStash(IN_FLIGHT, 600.0),
                           synchronous=False, runtime=Runtime())
    parameters = compute.optimizer.parameters
    counter = LiveBytes()
    with counter:
        partition = SlicePartition([p.numel() for p in parameters], config.sync.n_slices, config.seed)
        assert counter.held() == 0
        flats = [partition.gather(parameters, s) for s in range(config.sync.n_slices)]
        for s, flat in enumerate(flats):
            partition.scatter_add(parameters, s, torch.zeros_like(flat))
        del flats, flat
        assert counter.held() == 0  # nothing kept between rounds
    options = MemoryOptions(microbatch=config.train.microbatch_size, seq_len=config.train.seq_len,
                            in_flight=IN_FLIGHT, pinned_versions=PINNED, applied=config.train.microbatches)
    plan = plan_stage(config, 1, options, device_type="cpu", dtype="fp32")
    assert 0 < counter.peak < plan.working / 2, (counter.peak, plan.working)


def test_pinning_at_a_step_reuses_the_buffers_of_released_versions():
    """The asynchronous step's copy of the weights: after the first copies, a step that pins writes
    into the buffers of a released version instead of allocating a new copy, and what is held stays
    the plan's `pinned`."""
    config = PRESETS["tiny"].with_stages(3)
    compute = StageCompute(config, 1, run_id="run", codec=CODEC, stash=ForwardStash(IN_FLIGHT, 600.0),
                           synchronous=False, pinned_versions=PINNED, runtime=Runtime())
    drive = Driver(compute, config)
    allocated = []
    for step in range(2 * PINNED + 2):  # every step keeps the version a pending forward ran on
        drive.forward(f"pending{step}")
        drive.forward(f"done{step}")
        drive.backward(f"done{step}")
        if step >= PINNED:  # an old pending backward completes: its version is released
            drive.backward(f"pending{step - PINNED}")
        counter = LiveBytes()
        with counter:
            compute.weights_changing()
        allocated.append(counter.held())
        drive.report()
    options = MemoryOptions(microbatch=2, seq_len=128, in_flight=IN_FLIGHT, pinned_versions=PINNED, applied=4)
    plan = plan_stage(config, 1, options, device_type="cpu", dtype="fp32")
    assert allocated[0] == plan.pinned // PINNED  # the first copy is allocated once ...
    assert allocated[PINNED + 1:] == [0] * (len(allocated) - PINNED - 1)  # ... later steps write into old buffers
    assert compute._pinned.nbytes == plan.pinned
