"""bench/gpu.py, the one command a GPU machine runs, checked where there is no GPU: `--cpu-smoke`
runs every part's code on the CPU at tiny sizes and must write a table with every row; a part past
its time box is a row of its own and the next part still runs; without CUDA the command refuses in
one line; the MFU peak table reads device names right."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu.py"

pytestmark = pytest.mark.timeout(300)


def _gpu_module():
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # (its dataclasses look their module up there)
    spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[spec.name]


def _run(*args: str) -> subprocess.CompletedProcess:
    # One torch thread in every process it starts, as in the tests' own (tests/conftest.py): the demo
    # part runs several processes at once, and a part's two threads on a busy 2-core machine ran
    # train-local several times slower than one.
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=280,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def _figures(part: dict) -> dict[str, dict]:
    return {figure["measure"]: figure for figure in part["figures"]}


def test_peak_table_reads_device_names():
    peak = _gpu_module().peak_bf16_tflops
    assert peak("NVIDIA H200") == 989.0
    assert peak("NVIDIA H100 80GB HBM3") == 989.0
    assert peak("NVIDIA H100 PCIe") == 756.0
    assert peak("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak("NVIDIA GeForce RTX 4090") == 165.0
    assert peak("NVIDIA L4") == 121.0
    assert peak("NVIDIA L40S") is None  # not an L4: the user is asked for --peak-tflops
    assert peak("Tesla T4") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_it_refuses_in_one_line(tmp_path):
    printed = _run("--out-dir", str(tmp_path))
    assert printed.returncode == 2
    lines = printed.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device visible" in lines[0] and "--cpu-smoke" in lines[0], printed.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_cpu_smoke_writes_a_row_for_every_part_and_figure(tmp_path):
    gpu = _gpu_module()
    printed = _run("--cpu-smoke", "--out-dir", str(tmp_path), "--log-dir", str(tmp_path / "logs"),
                   "--peak-tflops", "0.1")
    assert printed.returncode == 0, printed.stdout[-3000:] + printed.stderr[-3000:]
    table = (tmp_path / "gpu_cpu-smoke.md").read_text()
    result = json.loads((tmp_path / "gpu_cpu-smoke.json").read_text())
    assert list(result["parts"]) == list(gpu.PARTS)
    assert result["environment"]["torch"] == torch.__version__
    for name, part in result["parts"].items():
        assert part["status"] == "ok", (name, part)
        assert f"| {name} | outcome | ok in " in table
        for figure in part["figures"]:
            assert f"| {name} | {figure['measure']} | {figure['value']} |" in table
    tests = _figures(result["parts"]["cuda-tests"])["tests"]
    assert tests["passed"] + tests["skipped"] >= 9 and tests["failed"] == 0  # all skipped here, none failed
    local = _figures(result["parts"]["train-local"])
    assert local["tokens/s"]["tokens_per_s"] > 0 and local["held-out loss"]["heldout"] > 0
    assert local["peak memory"]["measured_bytes"] > 0 and local["peak memory"]["planned_bytes"] > 0
    demo = _figures(result["parts"]["demo"])
    assert demo["demo outcome"]["outcome"] == "completed" and demo["tokens/s"]["tokens_per_s"] > 0
    body = _figures(result["parts"]["body-stage"])
    assert body["microbatch 2 x 128: tokens/s"]["tokens_per_s"] > 0
    assert body["microbatch 2 x 128: MFU"]["utilization"] > 0
    memory = body["microbatch 2 x 128: peak memory"]
    # What the bench measures is what the plan describes: the tensor bytes of a real tiny body worker.
    assert memory["measured_bytes"] == pytest.approx(memory["planned_bytes"], rel=0.05)


def test_a_part_past_its_time_box_is_a_row_and_the_next_part_still_runs(tmp_path):
    printed = _run("--cpu-smoke", "--out-dir", str(tmp_path), "--parts", "cuda-tests,body-stage",
                   "--time-box", "cuda-tests=0.5")
    assert printed.returncode == 1, printed.stdout[-3000:] + printed.stderr[-3000:]
    table = (tmp_path / "gpu_cpu-smoke.md").read_text()
    assert "| cuda-tests | outcome | timed out: ran past its time box of 0.5 s" in table
    assert "| body-stage | outcome | ok in " in table and "| body-stage | microbatch 2 x 128: MFU | n/a |" in table
