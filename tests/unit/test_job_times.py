"""A worker's compute times (node/worker/service.py's `JobTimes`) and the demo summary's sum of them per
stage (node/demo/summary.py): the wall time of its jobs and the compute thread's CPU in them."""

import json
from types import SimpleNamespace

import pytest

from agora.node.demo.summary import _compute_by_stage
from agora.node.worker.service import JobTimes


def test_job_times_add_up_and_a_clock_that_went_back_counts_no_cpu():
    times = JobTimes()
    times.add(0.30, 0.12)
    times.add(0.20, -0.001)  # thread_time read across a clock step: never a negative demand
    times.add_control(0.05, 0.04, 0.2)  # a Step's optimizer step, kept apart from the compute, after 0.2 s in line
    assert times.snapshot() == {"jobs": 2, "compute_s": 0.5, "compute_cpu_s": 0.12, "control_jobs": 1,
                                "control_s": 0.05, "control_cpu_s": 0.04, "control_queued_s": 0.2}


def test_each_stage_sums_its_replicas_stats_files_and_a_missing_or_older_file_counts_nothing(tmp_path):
    workers = [(0, SimpleNamespace(name=f"worker-s0-r{r}")) for r in range(3)] + \
        [(1, SimpleNamespace(name="worker-s1-r0")), (1, SimpleNamespace(name="worker-s1-r1"))]
    for name, jobs, stage in (("worker-s0-r0", {"jobs": 10, "compute_s": 2.0, "compute_cpu_s": 1.0}, 0),
                              ("worker-s0-r1", {"jobs": 6, "compute_s": 2.0, "compute_cpu_s": 1.5}, 0),
                              ("worker-s1-r0", None, 1)):  # written before jobs were kept
        stats = {"stage": stage, **({"jobs": jobs} if jobs else {})}
        (tmp_path / f"{name}.stats.json").write_text(json.dumps(stats))
    # worker-s0-r2 and worker-s1-r1 were killed: no file.
    merged = _compute_by_stage(tmp_path, workers)
    assert merged == {"0": {"jobs": 16, "compute_s": 4.0, "compute_cpu_s": 2.5, "cpu_share": pytest.approx(0.625),
                            "control_jobs": 0, "control_s": 0.0, "control_cpu_s": 0.0, "control_queued_s": 0.0}}
