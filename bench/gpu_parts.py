"""The parts of the GPU check (bench/gpu.py runs each in a process of its own):

    python bench/gpu_parts.py PART --settings JSON --result FILE --work DIR

PART is cuda-tests, train-local, demo or body-stage. A part appends figures to FILE as it
measures them ({"figures": [...]}, plus {"error": ...} when it fails), so the table keeps what a
failing part measured before it failed.

Design choices:
- Peak memory is what the allocator saw: on CUDA torch's statistics (`max_memory_allocated`
  above what was allocated before the part began), compared with the plan's peak without its CUDA
  reserve, as tests/integration/test_cuda.py compares them; and the device's own use (the context, read from
  `mem_get_info` once torch and cuBLAS are up, plus `max_memory_reserved`) against the plan's
  whole peak, which checks the reserve the plan adds for the context and the allocator's slack.
  On the CPU (`--cpu-smoke`) it is the tensor bytes the plan's own `LiveBytes` counts.
- train-local is the `agora-node train-local` command run in this process (so its device memory
  can be read); the plan for it is the plan of each of its stages with nothing stashed, pinned or
  kept for Abort (a centralized run keeps none of them), summed, with every stage's worst working
  set added, since train-local holds the autograd graph of every stage at once.
- The body stage is a real StageCompute (the worker's compute, the codec included) taking Forward
  and Backward requests, so what is timed is what a worker does per microbatch: the forward under
  no_grad, then the backward's recompute of the forward with autograd. MFU counts model FLOPs only
  (6 N per token for forward and backward, N the stage's trainable parameters, plus 12 L H Q S
  for attention as torchtitan and PaLM count it, the whole score matrix); the utilization with
  the recompute counted (8 N + 16 L H Q S) is the hardware's.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ElementTree
from dataclasses import replace
from pathlib import Path

import torch

GiB = 2**30


class Results:
    """The figures of one part, written to its result file after each one."""

    def __init__(self, path: Path):
        self.path = path
        self.figures: list[dict] = []
        self.error: str | None = None

    def add(self, measure: str, value: str, note: str = "", **raw) -> None:
        self.figures.append({"measure": measure, "value": value, "note": note, **raw})
        self.write()
        print(f"{measure}: {value} {note}", flush=True)

    def write(self) -> None:
        body = {"figures": self.figures, **({"error": self.error} if self.error else {})}
        self.path.write_text(json.dumps(body, indent=2) + "\n")


class PeakMemory:
    """Peak bytes allocated from `start()` on (see the module docstring); `reset()` starts a new peak
    over what is held then."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        self.baseline = 0
        self.context = 0
        self._counter = None
        self._active = False

    def start(self) -> None:
        if self.cuda:
            warm = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
            (warm @ warm).sum().item()  # cuBLAS' workspace exists before the baseline is read
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            self.context = total - free - torch.cuda.memory_reserved()
            self.baseline = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            from agora.pipeline.memory import LiveBytes

            self._counter = LiveBytes()
            self._counter.__enter__()
            self._active = True

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            self._counter.peak = self._counter.held()

    def peak(self) -> tuple[int, int | None]:
        """(peak bytes allocated since start or reset, the device's own peak use: its context plus
        the allocator's reserved peak, None on the CPU). Read it before planning: the plan's fake
        tensors would count on the CPU."""
        if not self.cuda:
            return self._counter.peak, None
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - self.baseline, self.context + torch.cuda.max_memory_reserved()

    def stop(self) -> None:
        """Stop counting (the CPU's counter keeps its peak)."""
        if self._counter is not None and self._active:
            self._counter.__exit__(None, None, None)
            self._active = False


def _size(value: int) -> str:
    return f"{value / GiB:.2f} GiB" if value >= GiB else f"{value / 2**20:.2f} MiB"


def _report_memory(results: Results, measured: tuple[int, int | None], planned_peak: int, planned_reserve: int,
                   what: str) -> None:
    allocated, device = measured
    planned = planned_peak - planned_reserve
    where = "CUDA allocator" if device is not None else "tensor bytes (CPU)"
    results.add(f"{what}peak memory", _size(allocated), f"{where}; plan {_size(planned)} (without its CUDA reserve), "
                f"measured / plan {allocated / max(planned, 1):.3f}", measured_bytes=allocated, planned_bytes=planned)
    if device is not None:
        results.add(f"{what}device peak", _size(device),
                    f"context + allocator reserved peak; plan {_size(planned_peak)} with its reserve, "
                    f"measured / plan {device / max(planned_peak, 1):.3f}", measured_bytes=device,
                    planned_bytes=planned_peak)


# ---------------------------------------------------------------------------------------- parts

def cuda_tests(settings: dict, results: Results, work: Path) -> None:
    """`pytest -m cuda tests/integration/test_cuda.py`; on a GPU every test must pass (a skip is a failure)."""
    junit = work / "cuda-tests.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests/integration/test_cuda.py",
               "-p", "no:cacheprovider", f"--junitxml={junit}"]
    printed = subprocess.run(command, capture_output=True, text=True)
    print(printed.stdout[-4000:], printed.stderr[-2000:], flush=True)
    if not junit.exists():
        raise RuntimeError(f"pytest wrote no report (exit {printed.returncode}): {printed.stderr.strip()[-300:]}")
    suite = ElementTree.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, skipped = int(suite.get("tests")), int(suite.get("skipped"))
    failed = int(suite.get("failures")) + int(suite.get("errors"))
    names = [case.get("name") for case in suite.iter("testcase")
             if case.find("failure") is not None or case.find("error") is not None]
    results.add("tests", f"{total - failed - skipped} passed, {failed} failed, {skipped} skipped",
                "failed: " + ", ".join(names) if names else "", passed=total - failed - skipped, failed=failed,
                skipped=skipped)
    if failed or printed.returncode not in (0, 5):
        raise RuntimeError(f"{failed} of {total} CUDA tests failed: {', '.join(names)}")
    if settings["device"] == "cuda" and (skipped or not total):
        raise RuntimeError(f"{skipped} of {total} CUDA tests skipped on a CUDA machine")


def _train_local_run(settings: dict, dtype: str, work: Path, *, measure_memory: bool = True
                     ) -> tuple[list[dict], float, tuple[int, int | None] | None]:
    """One `agora-node train-local` in this process: its step records, held-out loss and peak memory
    (None unless `measure_memory`: on the CPU the count slows every operator several-fold)."""
    from agora.node.cli import main as agora_main

    log = work / f"train-local-{dtype}.jsonl"
    argv = ["--log-level", "WARNING", "train-local", "--config", settings["train_config"],
            "--stages", str(settings["train_stages"]), "--steps", str(settings["train_steps"]),
            "--device", settings["device"], "--dtype", dtype, "--log-json", str(log)]
    argv += ["--compile"] if settings["compile"] else []
    memory = PeakMemory(settings["device"]) if measure_memory else None
    if memory is not None:
        memory.start()
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            code = agora_main(argv)
    finally:
        if memory is not None:
            memory.stop()
    measured = memory.peak() if memory is not None else None
    print(printed.getvalue(), flush=True)
    if code != 0:
        raise RuntimeError(f"agora-node train-local --dtype {dtype} exited {code}: {printed.getvalue().strip()[-300:]}")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return records, float(printed.getvalue().split("heldout=")[1].split()[0]), measured


def train_local(settings: dict, results: Results, work: Path) -> None:
    from agora.pipeline.config import load_config
    from agora.pipeline.data import build_data
    from agora.pipeline.memory import MemoryOptions, plan_stage

    config = load_config(settings["train_config"]).with_stages(settings["train_stages"])
    build_data(config)  # tokenized and cached before anything is measured
    records, heldout, measured = _train_local_run(settings, settings["dtype"], work)
    what = (f"{settings['train_config']}, {settings['train_stages']} stages, {settings['dtype']}"
            + (", compiled" if settings["compile"] else ""))
    results.add("tokens/s", f"{records[-1]['tokens_per_s']:,.0f}", f"{what}, {len(records)} steps, the whole run",
                tokens_per_s=records[-1]["tokens_per_s"])
    results.add("train loss", f"{records[0]['loss']:.4f} -> {records[-1]['loss']:.4f}", "first step -> last step",
                first=records[0]["loss"], last=records[-1]["loss"])
    results.add("held-out loss", f"{heldout:.4f}", "after the last step", heldout=heldout)
    options = MemoryOptions(microbatch=config.train.microbatch_size, seq_len=config.train.seq_len, in_flight=0,
                            pinned_versions=0, applied=0)
    plans = [plan_stage(config, i, options, device_type=settings["device"], dtype=settings["dtype"])
             for i in range(len(config.layer_split))]
    # One process: every stage's state, every stage's graph at once, one CUDA reserve.
    reserve = max(plan.reserve for plan in plans)
    planned = sum(plan.state + plan.working for plan in plans) + reserve
    _report_memory(results, measured, planned, reserve, "")
    reference = settings.get("train_reference_dtype")
    if reference and reference != settings["dtype"]:
        # The same run in the reference precision: what the lower precision costs in loss and buys in speed.
        ref_records, ref_heldout, _ = _train_local_run(settings, reference, work, measure_memory=False)
        speed = records[-1]["tokens_per_s"] / ref_records[-1]["tokens_per_s"]
        results.add(f"{reference} tokens/s", f"{ref_records[-1]['tokens_per_s']:,.0f}",
                    f"{settings['dtype']} / {reference} = {speed:.2f}x", tokens_per_s=ref_records[-1]["tokens_per_s"],
                    ratio=speed)
        results.add(f"{reference} held-out loss", f"{ref_heldout:.4f}",
                    f"{settings['dtype']} / {reference} = {heldout / ref_heldout:.4f}", heldout=ref_heldout,
                    ratio=heldout / ref_heldout)


def demo(settings: dict, results: Results, work: Path) -> None:
    summary_path = work / "demo-summary.json"
    command = [sys.executable, "-m", "agora.node", "--log-level", "WARNING", "demo",
               "--config", settings["demo_config"], "--stages", str(settings["demo_stages"]),
               "--steps", str(settings["demo_steps"]), "--device", settings["device"], "--dtype", settings["dtype"],
               "--summary-json", str(summary_path), "--workdir", str(work / "demo"), "--no-monitor"]
    command += ["--insecure"] if settings["demo_insecure"] else []
    command += ["--compile"] if settings["compile"] else []
    printed = subprocess.run(command, capture_output=True, text=True)
    print(printed.stdout[-4000:], printed.stderr[-4000:], flush=True)
    if not summary_path.exists():
        raise RuntimeError(f"agora-node demo exited {printed.returncode} without a summary: "
                           f"{(printed.stderr or printed.stdout).strip()[-300:]}")
    summary = json.loads(summary_path.read_text())
    what = (f"{settings['demo_config']}, {settings['demo_stages']} stages, {settings['dtype']}, "
            f"{'--insecure' if settings['demo_insecure'] else 'admitted'}{', compiled' if settings['compile'] else ''}, "
            "every process on one device")
    results.add("demo outcome", f"{summary['outcome']}, {summary['steps']} steps",
                f"exit codes {summary.get('exit_codes')}", outcome=summary["outcome"])
    results.add("tokens/s", f"{summary['tokens_per_s']:,.0f}", what, tokens_per_s=summary["tokens_per_s"])
    results.add("held-out loss", f"{summary['heldout_loss']:.4f}", f"wall {summary['wall_s']:.0f} s",
                heldout=summary["heldout_loss"])
    if printed.returncode != 0 or summary["outcome"] != "completed":
        raise RuntimeError(f"agora-node demo exited {printed.returncode}, outcome {summary['outcome']}")


def model_flops_per_token(config, index: int, trainable: int, seq_len: int, *, recompute: bool) -> float:
    """Forward and backward FLOPs per token of stage `index` (see the module docstring)."""
    layers = config.layer_split[index]
    heads, head_dim = config.model.n_heads, config.model.d_model // config.model.n_heads
    attention = 12 * layers * heads * head_dim * seq_len
    return (8 * trainable + attention * 4 / 3) if recompute else (6 * trainable + attention)


# The body stage's variants: how its blocks run and what precision its weights are kept in.
BODY_VARIANTS = {"eager": {"compile": False, "weights": "fp32"},
                 "compiled": {"compile": True, "weights": "fp32"},
                 "compiled-bf16w": {"compile": True, "weights": "bf16"}}


def body_stage(settings: dict, results: Results, work: Path) -> None:
    variants = settings["body_variants"]
    for name in variants:
        _body_stage_variant(settings, results, name, prefix=f"{name}: " if len(variants) > 1 else "")
        gc.collect()
        if settings["device"] == "cuda":
            torch.cuda.empty_cache()  # the next variant's peak starts from an empty cache


def _body_stage_variant(settings: dict, results: Results, variant: str, prefix: str) -> None:
    from agora.node.replica.compute import StageCompute
    from agora.node.replica.stash import ForwardStash
    from agora.pipeline.codec import WireCodec, encode_tokens
    from agora.pipeline.config import RuntimeConfig, load_config
    from agora.pipeline.memory import MemoryOptions, plan_stage
    from agora.pipeline.runtime import Runtime
    from agora.protos.stage_adapter import BackwardRequest, ForwardRequest, StepRequest

    config = load_config(settings["body_config"])
    if settings["body_stages"]:
        config = config.with_stages(settings["body_stages"])
    config = replace(config, runtime=RuntimeConfig(device=settings["device"], dtype=settings["dtype"],
                                                    **BODY_VARIANTS[variant]))
    index, seq, iterations = settings["body_index"], config.train.seq_len, settings["body_iterations"]
    codec = WireCodec("fp32", max_bytes=2**30)
    cuda = settings["device"] == "cuda"

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize()

    memory = PeakMemory(settings["device"])
    memory.start()
    started = time.perf_counter()
    compute = StageCompute(config, index, run_id="gpu", codec=codec, stash=ForwardStash(4, 3600.0),
                           synchronous=True, pinned_versions=0, runtime=Runtime.from_config(config.runtime))
    synchronize()
    if compute.stage.is_head or compute.stage.is_tail:
        raise RuntimeError(f"stage {index} of {config.name} is not a body stage")
    trainable = sum(p.numel() for p in compute.optimizer.parameters)
    results.add(f"{prefix}stage", f"{config.name} stage {index} ({config.layer_split[index]} layers)",
                f"{trainable / 1e6:,.1f}M trainable parameters, built and placed in "
                f"{time.perf_counter() - started:.1f} s; {compute.runtime.describe()}", trainable=trainable)
    generator = torch.Generator().manual_seed(0)
    for rows in settings["body_microbatches"]:
        tokens = encode_tokens(torch.randint(0, config.model.vocab_size, (rows, seq), generator=generator),
                               config.model.vocab_size)
        wire = codec.encode(torch.randn(rows, seq, config.model.wire_dim, generator=generator))
        grad = codec.encode(torch.randn(rows, seq, config.model.wire_dim, generator=generator) * 1e-3)
        times = {"forward": 0.0, "backward": 0.0}

        def microbatch(name: str, timed: bool) -> None:
            for job, call in (("forward", lambda: compute.forward(ForwardRequest(
                    run_id="gpu", microbatch_id=name, stage=index, tokens=tokens, wire=wire))),
                              ("backward", lambda: compute.backward(BackwardRequest(
                                  run_id="gpu", microbatch_id=name, stage=index, output_grad=grad)))):
                synchronize()
                begun = time.perf_counter()
                call()  # its reply is encoded on the host: the job's kernels have finished
                times[job] += (time.perf_counter() - begun) if timed else 0.0

        def step() -> float:
            synchronize()
            begun = time.perf_counter()
            compute.step(StepRequest(run_id="gpu", stage=index, microbatches=compute.accumulated_microbatches,
                                     step=compute.optimizer.steps))
            synchronize()
            return time.perf_counter() - begun

        memory.reset()
        microbatch(f"warm{rows}", timed=False)  # kernels chosen, Adam's state created by the step
        step()
        for i in range(iterations):
            microbatch(f"m{rows}-{i}", timed=True)
        step_s = step()
        per_microbatch = (times["forward"] + times["backward"]) / iterations
        tokens_per_s = rows * seq / per_microbatch
        label = f"{prefix}microbatch {rows} x {seq}: "
        results.add(f"{label}tokens/s", f"{tokens_per_s:,.0f}",
                    f"Forward {times['forward'] / iterations * 1e3:.1f} ms + Backward (recompute) "
                    f"{times['backward'] / iterations * 1e3:.1f} ms per microbatch, mean of {iterations}; "
                    f"optimizer step {step_s * 1e3:.0f} ms", tokens_per_s=tokens_per_s,
                    forward_s=times["forward"] / iterations, backward_s=times["backward"] / iterations, step_s=step_s)
        peak = settings["peak_tflops"]
        for recompute, name in ((False, "MFU"), (True, "utilization with the recompute")):
            flops = model_flops_per_token(config, index, trainable, seq, recompute=recompute) * tokens_per_s
            if peak:
                results.add(f"{label}{name}", f"{flops / (peak * 1e12):.1%}",
                            f"{flops / 1e12:,.1f} TFLOP/s of {peak:g} ({'8N + 16LHQS' if recompute else '6N + 12LHQS'}"
                            " per token)", utilization=flops / (peak * 1e12), tflops=flops / 1e12)
            else:
                results.add(f"{label}{name}", "n/a", f"{flops / 1e12:,.3f} TFLOP/s; no peak known: pass --peak-tflops",
                            tflops=flops / 1e12)
        measured = memory.peak()
        options = MemoryOptions(microbatch=rows, seq_len=seq, in_flight=1, pinned_versions=0, applied=iterations)
        plan = plan_stage(config, index, options, device_type=settings["device"], dtype=settings["dtype"],
                          weights=config.runtime.weights)
        _report_memory(results, measured, plan.peak, plan.reserve, label)
    memory.stop()


PARTS = {"cuda-tests": cuda_tests, "train-local": train_local, "demo": demo, "body-stage": body_stage}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=sorted(PARTS))
    parser.add_argument("--settings", required=True, help="bench/gpu.py's Settings as JSON")
    parser.add_argument("--result", required=True)
    parser.add_argument("--work", required=True, help="a folder for the part's files")
    args = parser.parse_args()
    settings = json.loads(args.settings)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    results = Results(Path(args.result))
    results.write()
    try:
        PARTS[args.part](settings, results, work)
    except Exception as error:  # the part's row says what went wrong; its traceback is in the log
        traceback.print_exc()
        results.error = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        results.write()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
