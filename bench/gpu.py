"""The GPU check: one command a GPU machine runs, writing every figure the accelerator issue asks for.

    python bench/gpu.py [--out-dir bench/results] [--log-dir DIR] [--peak-tflops T] [--parts P,...]
    python bench/gpu.py --cpu-smoke --out-dir DIR      # the same code paths on the CPU, tiny sizes

Parts, each in a child process of its own with its own time box (bench/gpu_parts.py):
  - cuda-tests: `pytest -m cuda tests/integration/test_cuda.py` (passed / failed / skipped, from its JUnit XML);
  - train-local: `agora-node train-local` on `small` in bf16 on the device: tokens/s, held-out loss,
    peak device memory against the memory plan; then the same run in fp32 (tokens/s and held-out
    loss ratios);
  - demo: a whole `agora-node demo` on one device (every process shares it): outcome, tokens/s;
  - body-stage: one `pluralis-8b` body stage's Forward and Backward jobs (a real StageCompute) at
    the report's microbatches, 1 and 5 samples of 4096 tokens: tokens/s, model FLOP utilization,
    peak device memory against the plan; eager, compiled (`--compile`) and compiled with bf16
    weights, each built afresh (`--body-variants`).
Writes `gpu.md` (a table: device, torch and CUDA versions, every figure) and `gpu.json` into
--out-dir (`gpu_cpu-smoke.*` under --cpu-smoke); exits 0 when every part succeeded, 1 otherwise.

Design choices:
- A child process per part isolates failures (an out-of-memory error, a crash in a CUDA library,
  a hang) and gives each part a clean allocator, so its peak memory is its own. A part that fails
  or runs past its time box is a row with its error; the parts after it still run. A part writes
  its figures as it measures them, so what it measured before failing is kept.
- Without CUDA the command refuses in one line (exit 2) instead of measuring a CPU and calling it
  a GPU figure; `--cpu-smoke` runs every part on the CPU at tiny sizes (tiny config, a tiny body
  stage, a few steps) so a test checks this script end to end where no GPU is (tests/system/test_gpu_script.py).
- MFU needs the device's peak dense bf16 rate: taken from a table by the device's name, or
  `--peak-tflops`; an unknown device gets its MFU rows left out with a line saying so, not a guess.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from agora.bench.gpu_parts import BODY_VARIANTS
from agora.node.__main__ import CUDA_ALLOCATOR_ENV

REPO = Path(__file__).resolve().parent.parent
PARTS_SCRIPT = Path(__file__).resolve().parent / "gpu_parts.py"
PARTS = ("cuda-tests", "train-local", "demo", "body-stage")

# Dense bf16 tensor-core peaks (TFLOP/s) from the vendors' data sheets, by a pattern of the name
# torch reports; the first match wins (PCIe and NVL H100s are slower than the SXM part).
PEAK_BF16_TFLOPS = (
    (r"H100.*PCIe", 756.0),
    (r"H100 NVL", 835.0),
    (r"H100|H200|GH200", 989.0),
    (r"A100", 312.0),
    (r"RTX 4090", 165.0),
    (r"\bL4\b", 121.0),
)


def peak_bf16_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a device by its name, or None when the table does not know it."""
    for pattern, tflops in PEAK_BF16_TFLOPS:
        if re.search(pattern, device_name):
            return tflops
    return None


@dataclass(frozen=True)
class Settings:
    """What every part runs (passed to the parts as JSON). The defaults are the GPU run's."""

    device: str = "cuda"
    dtype: str = "bf16"
    peak_tflops: float | None = None
    train_config: str = "small"
    train_stages: int = 4
    train_steps: int = 60
    train_reference_dtype: str | None = "fp32"  # train-local again in it: the precision's cost in loss and speed
    demo_config: str = "tiny"
    demo_stages: int = 3
    demo_steps: int = 40
    demo_insecure: bool = False
    compile: bool = False  # train-local and the demo with --compile (the body stage has its own variants)
    body_config: str = "pluralis-8b"
    body_stages: int | None = None  # None: the preset's own split
    body_index: int = 1
    body_microbatches: tuple[int, ...] = (1, 5)  # the report's: 1 sample at ~20 GB up to 5 at ~78 GB
    body_iterations: int = 8
    body_variants: tuple[str, ...] = tuple(BODY_VARIANTS)
    time_boxes: dict[str, float] = field(default_factory=lambda: {
        "cuda-tests": 120.0, "train-local": 120.0, "demo": 120.0, "body-stage": 300.0})


# The same parts at tiny sizes on the CPU (`--cpu-smoke`).
CPU_SMOKE = Settings(
    device="cpu", train_config="tiny", train_stages=3, train_steps=3, demo_config="tiny", demo_stages=2, demo_steps=2,
    demo_insecure=True, body_config="tiny", body_stages=3, body_microbatches=(2,), body_iterations=2,
    body_variants=("eager",),
    time_boxes={"cuda-tests": 120.0, "train-local": 120.0, "demo": 180.0, "body-stage": 120.0})  # a loaded CI box


def environment(settings: Settings) -> dict:
    """What the figures were measured on."""
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda or "none",
            "cpu_count": os.cpu_count(), "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M")}
    if settings.device == "cuda":
        properties = torch.cuda.get_device_properties(0)
        info.update(device=properties.name, device_memory_gib=round(properties.total_memory / 2**30, 1),
                    capability=f"{properties.major}.{properties.minor}", device_count=torch.cuda.device_count(),
                    cudnn=str(torch.backends.cudnn.version()))
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20).stdout.split("\n")[0].strip()
        except (OSError, subprocess.SubprocessError):
            pass
    else:
        info["device"] = f"cpu ({platform.processor() or platform.machine()})"
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                        text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def _last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def run_part(name: str, settings: Settings, log_dir: Path) -> dict:
    """Run one part in its own process group within its time box; its figures and outcome."""
    result_path, log_path = log_dir / f"{name}.json", log_dir / f"{name}.log"
    result_path.unlink(missing_ok=True)
    box = settings.time_boxes[name]
    command = [sys.executable, str(PARTS_SCRIPT), name, "--settings", json.dumps(asdict(settings)),
               "--result", str(result_path), "--work", str(log_dir / name)]
    started = time.monotonic()
    # The parts measure the allocator agora-node runs with (a user's own setting wins there too).
    env = {**os.environ}
    env.setdefault(*CUDA_ALLOCATOR_ENV)
    with open(log_path, "w") as log:
        child = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True, env=env)
        try:
            code = child.wait(timeout=box)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out, code = True, None
            _stop(child)
    seconds = time.monotonic() - started
    result = json.loads(result_path.read_text()) if result_path.exists() else {}
    figures = result.get("figures", [])
    if timed_out:
        status, error = "timed out", f"ran past its time box of {box:g} s (last output: {_last_line(log_path)})"
    elif code != 0 or "error" in result:
        status, error = "failed", result.get("error") or f"exit code {code}: {_last_line(log_path)}"
    else:
        status, error = "ok", None
    return {"status": status, "seconds": round(seconds, 1), "error": error, "figures": figures,
            "log": str(log_path)}


def _stop(child: subprocess.Popen) -> None:
    """SIGTERM the part's process group (a demo then stops its own processes), SIGKILL after 10 s."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            break
        try:
            child.wait(timeout=grace)
            break
        except subprocess.TimeoutExpired:
            continue


def format_table(env: dict, settings: Settings, parts: dict[str, dict], smoke: bool) -> str:
    title = "GPU check (CPU smoke run: the script's code paths, not GPU figures)" if smoke else "GPU check"
    lines = [f"# {title}: bench/gpu.py", "",
             f"{env['device']}" + (f", {env['device_memory_gib']} GiB" if "device_memory_gib" in env else "")
             + f"; torch {env['torch']}, CUDA {env['cuda']}"
             + (f", cuDNN {env['cudnn']}" if "cudnn" in env else "")
             + (f", driver {env['driver']}" if env.get("driver") else "")
             + f"; Python {env['python']}, {env['cpu_count']} CPUs; commit {env.get('commit', '?')}, {env['date']}.",
             "",
             f"Peak dense bf16 for MFU: {settings.peak_tflops:g} TFLOP/s." if settings.peak_tflops else
             "Peak dense bf16 for MFU: unknown for this device (pass --peak-tflops); MFU rows left out.",
             "", "| part | measure | value | note |", "|---|---|---:|---|"]
    for name, part in parts.items():
        outcome = f"ok in {part['seconds']:g} s" if part["status"] == "ok" else f"{part['status']}: {part['error']}"
        lines.append(f"| {name} | outcome | {_cell(outcome)} | |")
        for figure in part["figures"]:
            lines.append(f"| {name} | {_cell(figure['measure'])} | {_cell(figure['value'])} | "
                         f"{_cell(figure.get('note', ''))} |")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(REPO / "bench" / "results"), help="where gpu.md and gpu.json go")
    parser.add_argument("--log-dir", default=None, help="each part's log and raw result (default: a temp folder)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's peak dense bf16 TFLOP/s for MFU (default: from its name)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    parser.add_argument("--time-box", action="append", default=[], metavar="PART=SECONDS",
                        help="override one part's time box (repeatable)")
    parser.add_argument("--body-variants", default=None,
                        help="comma-separated body-stage variants: eager, compiled, compiled-bf16w (default: all; "
                             "--cpu-smoke: eager)")
    parser.add_argument("--compile", action="store_true", help="run train-local and the demo with --compile")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="run every part on the CPU at tiny sizes: checks this script, measures no GPU")
    args = parser.parse_args(argv)
    prog = "bench/gpu.py"
    parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    unknown = [part for part in parts if part not in PARTS]
    if unknown or not parts:
        parser.error(f"--parts: unknown part(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(PARTS)}")
    settings = CPU_SMOKE if args.cpu_smoke else Settings()
    boxes = dict(settings.time_boxes)
    for item in args.time_box:
        part, _, seconds = item.partition("=")
        try:
            if part not in PARTS or float(seconds) <= 0:
                raise ValueError
        except ValueError:
            parser.error(f"--time-box: expected PART=SECONDS with PART one of {', '.join(PARTS)}, got {item!r}")
        boxes[part] = float(seconds)
    if not args.cpu_smoke and not torch.cuda.is_available():
        build = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "built without CUDA"
        print(f"{prog}: error: no CUDA device visible (torch {torch.__version__}, {build}); run it on a GPU machine, "
              "or pass --cpu-smoke to check this script on the CPU", file=sys.stderr)
        return 2
    peak = args.peak_tflops
    if peak is None and not args.cpu_smoke:
        name = torch.cuda.get_device_name(0)
        peak = peak_bf16_tflops(name)
        if peak is None:
            print(f"{prog}: the peak bf16 rate of {name!r} is not in the table; pass --peak-tflops for MFU "
                  "(MFU rows are left out)", file=sys.stderr)
    settings = replace(settings, peak_tflops=peak, time_boxes=boxes, compile=args.compile)
    if args.body_variants:
        variants = tuple(v.strip() for v in args.body_variants.split(",") if v.strip())
        known = tuple(BODY_VARIANTS)
        if not variants or any(v not in known for v in variants):
            parser.error(f"--body-variants: expected some of {', '.join(known)}, got {args.body_variants!r}")
        settings = replace(settings, body_variants=variants)

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="agora-gpu-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    env = environment(settings)
    print(f"{prog}: {env['device']}, torch {env['torch']}, CUDA {env['cuda']}; logs in {log_dir}", flush=True)
    results: dict[str, dict] = {}
    stem = "gpu_cpu-smoke" if args.cpu_smoke else "gpu"
    for name in parts:
        print(f"{prog}: {name} (time box {boxes[name]:g} s) ...", flush=True)
        results[name] = run_part(name, settings, log_dir)
        part = results[name]
        print(f"{prog}: {name}: {part['status']} in {part['seconds']:g} s"
              + (f": {part['error']}" if part["error"] else ""), flush=True)
        # Written after every part: a run cut short still leaves the parts it finished.
        table = format_table(env, settings, results, args.cpu_smoke)
        (out_dir / f"{stem}.md").write_text(table)
        (out_dir / f"{stem}.json").write_text(json.dumps(
            {"environment": env, "settings": asdict(settings), "parts": results}, indent=2) + "\n")
    print(table)
    return 0 if all(part["status"] == "ok" for part in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
