"""Structured logs: milestone records as JSON lines, and `--log-format json` on a real role."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys

import pytest

from agora.node.logs import JsonLogFormatter
from agora.node.rpc.server import run
from agora.node.worker.worker import StageWorker
from agora.pipeline.config import PRESETS

pytestmark = pytest.mark.timeout(120)


def test_a_milestone_becomes_one_json_line_with_its_event_and_fields():
    record = logging.LogRecord("agora.node.trainer", logging.WARNING, __file__, 1, "reroute microbatch %s", ("u1m0",),
                               None)
    record.milestone, record.fields = "reroute", {"microbatch": "u1m0", "attempt": 2, "odd": object()}
    line = json.loads(JsonLogFormatter().format(record))
    assert (line["event"], line["microbatch"], line["attempt"], line["level"]) == ("reroute", "u1m0", 2, "warning")
    assert line["message"] == "reroute microbatch u1m0" and line["ts"].endswith("+00:00")
    assert line["odd"].startswith("<object")  # what JSON cannot carry is written as text, never a crash
    plain = json.loads(JsonLogFormatter().format(logging.LogRecord("x", logging.INFO, __file__, 1, "hi", (), None)))
    assert "event" not in plain


def test_a_worker_logs_its_phase_change_as_a_milestone(caplog):
    async def main():
        worker = StageWorker(PRESETS["tiny"].with_stages(2), 0, run_id="logs")
        await worker.start()
        await worker.stop()

    with caplog.at_level(logging.INFO, logger="agora.node.worker"):
        run(main())
    changes = [r for r in caplog.records if getattr(r, "milestone", None) == "phase_changed"]
    assert [r.fields["to"] for r in changes] == ["leaving"] and changes[0].fields["from"] == "member"


def test_log_format_json_on_a_running_role(tmp_path):
    ready = tmp_path / "boot.ready"
    process = subprocess.Popen([sys.executable, "-m", "agora.node", "--log-format", "json", "bootstrap", "--insecure",
                                "--ready-file", str(ready)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)
    try:
        lines = []
        for line in process.stderr:  # readiness: the line that says it serves
            if line.startswith("{"):
                lines.append(json.loads(line))
                if "serving at" in lines[-1]["message"]:
                    break
        process.send_signal(signal.SIGTERM)
        _, rest = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    lines += [json.loads(line) for line in rest.splitlines() if line.startswith("{")]
    assert process.returncode == 0
    assert any("serving at" in line["message"] for line in lines)
    assert all({"ts", "level", "logger", "message"} <= set(line) for line in lines)
