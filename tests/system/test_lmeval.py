"""lm-evaluation-harness (the `lm_eval` CLI, as a user runs it) against a live swarm and against the export.

A bootstrap, two serve-only workers (one per stage) and `agora-node serve` on loopback; the
repository's tasks (bench/evals/agora_code: multiple choice by loglikelihood, and generation up to
the end of the line, from a local JSONL) run once through `--model local-completions` at the
server (lm-eval tokenizes with the server's /tokenize) and once through `--model hf` on the
checkpoint's transformers export (`agora-node export-hf`, tokenizer included). Same accuracy, the
same generations, and every choice's loglikelihood within 1e-3. Offline throughout: no download.

Readiness is every process's ready file; children run one torch thread and are reaped by the
ProcessGroup whatever happens. The export runs while the swarm starts, and the evaluation of the
export beside the swarm's: each is its own process on its own inputs, and each lm_eval run spends
most of its time importing, so side by side they take the time of the longer one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agora.node.demo.processes import ProcessGroup
from agora.pipeline.config import PRESETS
from inference_swarm import node_command, perturbed_checkpoint, serving_swarm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the test extra")

CONFIG = PRESETS["tiny"].with_stages(2)
MODEL = "agora-tiny"
TASKS = Path(__file__).resolve().parents[2] / "bench" / "evals" / "agora_code"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_EVALUATE_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Stage weights away from their initialisation, saved as a train-local checkpoint would be."""
    return perturbed_checkpoint(tmp_path_factory.mktemp("ckpt"), CONFIG, seed=11)[0]


def _start(log: Path, command: list[str]) -> subprocess.Popen:
    """A child with its output in `log` (a pipe nobody reads while it runs could fill and stall it)."""
    with log.open("w") as output:
        return subprocess.Popen(command, env={**os.environ, **OFFLINE}, stdout=output, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)


def _lm_eval(out: Path, *model: str) -> subprocess.Popen:
    """Start the lm_eval CLI on the repository's tasks, writing under `out`; `_results` reads it."""
    out.mkdir()
    return _start(out / "lm_eval.log", [sys.executable, "-m", "lm_eval", *model, "--tasks",
                                        "agora_code_mc,agora_code_gen", "--include_path", str(TASKS), "--output_path",
                                        str(out), "--log_samples", "--batch_size", "4"])


def _finished(process: subprocess.Popen, log: Path, timeout_s: float = 240) -> None:
    """Wait for a child started by `_start` (killed if it overruns); it must exit 0."""
    try:
        process.wait(timeout=timeout_s)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, log.read_text(errors="replace")[-9000:]


def _results(out: Path) -> tuple[dict, dict[str, list[dict]]]:
    """An lm_eval run's results and logged samples by task."""
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    samples = {task: [json.loads(line) for line in next(out.rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()]
               for task in ("agora_code_mc", "agora_code_gen")}
    return results, samples


def _by_doc(samples: list[dict]) -> dict[int, list]:
    return {sample["doc_id"]: sample["resps"] for sample in samples}


def test_lm_eval_through_the_swarm_equals_lm_eval_on_the_export(checkpoint, tmp_path):
    export = tmp_path / "hf"
    exporting = _start(tmp_path / "export.log", node_command("export-hf", "--checkpoint", str(checkpoint),
                                                             "--out", str(export)))
    group = ProcessGroup(tmp_path)
    hf_eval = None
    try:
        url, _, _ = serving_swarm(group, tmp_path, checkpoint, "lmeval-test", [(0, 0), (1, 0)])
        _finished(exporting, tmp_path / "export.log", 120)
        hf_eval = _lm_eval(tmp_path / "hf-eval", "--model", "hf", "--model_args", f"pretrained={export},dtype=float32",
                           "--device", "cpu")
        _finished(_lm_eval(tmp_path / "swarm", "--model", "local-completions", "--model_args",
                           f"model={MODEL},base_url={url}/completions,max_length={CONFIG.model.max_seq_len},"
                           "max_retries=1"), tmp_path / "swarm" / "lm_eval.log")
    except BaseException:
        for process in (exporting, hf_eval):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
        raise
    finally:
        group.shutdown()
    _finished(hf_eval, tmp_path / "hf-eval" / "lm_eval.log")
    swarm_results, swarm_samples = _results(tmp_path / "swarm")
    hf_results, hf_samples = _results(tmp_path / "hf-eval")

    assert swarm_results["agora_code_mc"]["acc,none"] == hf_results["agora_code_mc"]["acc,none"]
    swarm_mc, hf_mc = _by_doc(swarm_samples["agora_code_mc"]), _by_doc(hf_samples["agora_code_mc"])
    assert sorted(swarm_mc) == sorted(hf_mc) == list(range(8))
    for doc, choices in swarm_mc.items():
        swarm_lls = [float(resp[0][0]) for resp in choices]
        hf_lls = [float(resp[0][0]) for resp in hf_mc[doc]]
        assert swarm_lls == pytest.approx(hf_lls, abs=1e-3), doc
        assert [resp[0][1] for resp in choices] == [resp[0][1] for resp in hf_mc[doc]]  # is_greedy
    assert _by_doc(swarm_samples["agora_code_gen"]) == _by_doc(hf_samples["agora_code_gen"])
    assert swarm_results["agora_code_gen"] == hf_results["agora_code_gen"]
