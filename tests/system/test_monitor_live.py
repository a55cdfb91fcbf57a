"""The monitor against a running demo, checked with the real tools an operator would use.

One `agora-node demo` (2 stages x 2 replicas, a trainer, the authorizer, the bootstrap and the
monitor, all admitted) is shared by the tests of this module. A real Prometheus server (Debian's
`prometheus`, which .ci/run installs) is started on a free port with the shipped
monitor/prometheus.yml pointed at the demo's monitor, discovers every process through `/sd`,
and must see `up == 1` for each; every PromQL expression of every panel of the shipped Grafana
dashboard must return data from it. The status page is opened in headless Chromium (Debian's
`chromium`), and after its own updates ran its DOM must show every stage with its workers and a
loss chart with points; a screenshot is kept under the test's tmp dir. Every process's
`/metrics` page passes the naming lint. Readiness is read from the monitor's own API and
Prometheus' (polled with deadlines), never waited out with sleeps.
"""

from __future__ import annotations

import html.parser
import json
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agora.monitor.naming import lint
from agora.node.admission import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MONITOR = Path(__file__).resolve().parents[2] / "monitor"
STAGES, REPLICAS = 2, 2
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]


def get(url: str, timeout: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return reply.read()


def get_json(url: str):
    return json.loads(get(url))


def until(condition, timeout_s: float, what: str, pause: float = 0.5):
    """Poll `condition()` until it returns something truthy (returned), or fail naming `what`."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = condition()
        except OSError as error:  # not listening yet
            last = error
        else:
            if last:
                return last
        time.sleep(pause)
    raise AssertionError(f"{what} within {timeout_s:.0f} s (last: {str(last)[:500]})")


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is not installed: .ci/run installs it (apt-get install {name})"
    return path


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A running demo and its monitor's URL; stopped with Ctrl-C afterwards (it must exit 0)."""
    workdir = tmp_path_factory.mktemp("live-demo")
    log = open(workdir / "demo.log", "w")
    process = subprocess.Popen([sys.executable, "-m", "agora.node", "demo", "--stages", str(STAGES),
                                "--replicas", str(REPLICAS), "--steps", "100000", "--seed", "7",
                                "--workdir", str(workdir / "work")],
                               stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        def printed_url():
            assert process.poll() is None, (workdir / "demo.log").read_text()
            found = re.search(r"status page (http://\S+/)", (workdir / "demo.log").read_text())
            return found and found.group(1)

        url = until(printed_url, 240, "the demo printing its status page")

        def trained_and_averaged():
            assert process.poll() is None, (workdir / "demo.log").read_text()
            view = get_json(url + "api/swarm")
            stages = view["stages"]
            return (len(stages) == STAGES and all(len(s["workers"]) == REPLICAS for s in stages)
                    and all(s["averaging_committed"] > 0 for s in stages) and len(view["history"]) >= 3)

        # Alone this takes 40 s; beside the suite's other demos on two cores, 215-275 s was measured.
        until(trained_and_averaged, 420, "every worker up, averaging committed on every stage and a loss curve")
        yield url
    finally:
        process.send_signal(signal.SIGINT)
        try:
            code = process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            code = None
        log.close()
    assert code == 0, (workdir / "demo.log").read_text()[-3000:]


def test_service_discovery_lists_every_process_and_each_passes_the_naming_lint(demo):
    groups = get_json(demo + "sd")
    roles = sorted(group["labels"]["role"] for group in groups)
    assert roles == sorted(["authorizer", "bootstrap", "trainer"] + ["worker"] * STAGES * REPLICAS)
    assert sorted(g["labels"]["stage"] for g in groups if g["labels"]["role"] == "worker") == \
        [str(s) for s in range(STAGES) for _ in range(REPLICAS)]
    for group in groups:
        (target,) = group["targets"]
        page = get(f"http://{target}/metrics").decode()
        families = list(text_string_to_metric_families(page))
        info = next(f for f in families if f.name == "agora_node_info").samples[0].labels
        assert info["role"] == group["labels"]["role"] and info["run"] == "demo"
        assert lint(families) == [], (group, lint(families))
    assert lint(text_string_to_metric_families(get(demo + "metrics").decode())) == []


@pytest.fixture(scope="module")
def prometheus(demo, tmp_path_factory):
    """A real Prometheus scraping the demo through the shipped config (intervals shortened)."""
    binary = tool("prometheus")
    workdir = tmp_path_factory.mktemp("prometheus")
    monitor = urllib.parse.urlparse(demo).netloc
    config = (MONITOR / "prometheus.yml").read_text().replace("127.0.0.1:9400", monitor)
    config = config.replace("scrape_interval: 15s", "scrape_interval: 1s").replace("refresh_interval: 30s",
                                                                                    "refresh_interval: 1s")
    (workdir / "prometheus.yml").write_text(config)
    port = free_port("127.0.0.1")
    process = subprocess.Popen([binary, f"--config.file={workdir / 'prometheus.yml'}",
                                f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                               stdout=open(workdir / "prometheus.log", "w"), stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL)
    api = f"http://127.0.0.1:{port}"
    try:
        until(lambda: get(api + "/-/ready") is not None, 60, "Prometheus ready")
        yield api
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def query(api: str, expr: str) -> list:
    reply = get_json(f"{api}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert reply["status"] == "success", reply
    return reply["data"]["result"]


def test_prometheus_scrapes_every_process_through_the_monitor(demo, prometheus):
    expected = {target for group in get_json(demo + "sd") for target in group["targets"]}
    expected.add(urllib.parse.urlparse(demo).netloc)

    def every_target_up():
        result = query(prometheus, "up")
        up = {sample["metric"]["instance"]: float(sample["value"][1]) for sample in result}
        return up if set(up) == expected and set(up.values()) == {1.0} else None

    up = until(every_target_up, 90, "up == 1 for every discovered process and the monitor")
    roles = {sample["metric"].get("role") for sample in query(prometheus, 'up{job="agora-nodes"}')}
    assert roles == {"authorizer", "bootstrap", "trainer", "worker"} and len(up) == len(expected)


def dashboard_expressions() -> list[tuple[str, str]]:
    dashboard = json.loads((MONITOR / "grafana" / "dashboards" / "agora-swarm.json").read_text())
    found = []
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []):
                found.append((inner["title"], target["expr"]))
    return found


def test_every_dashboard_query_returns_data(demo, prometheus):
    expressions = dashboard_expressions()
    assert len(expressions) > 30
    # Grafana's $__rate_interval is at least four scrape intervals; 1 s scrapes here.
    pending = {(title, expr.replace("$__rate_interval", "20s")) for title, expr in expressions}

    def all_answered():
        for title, expr in list(pending):
            if query(prometheus, expr):
                pending.discard((title, expr))
        return not pending or None

    until(all_answered, 120, f"data for every panel query (still empty: {pending})", pause=2.0)


class _Dom(html.parser.HTMLParser):
    """The few things the status page must show, read from Chromium's serialized DOM."""

    def __init__(self):
        super().__init__()
        self.rows: dict[str, int] = {}
        self.workers: dict[str, int] = {}
        self.points = 0
        self.updates = 0
        self._row = None
        self._svg = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "body":
            self.updates = int(attrs.get("data-updates", 0))
        if tag == "tr" and "data-stage" in attrs:
            self._row = attrs["data-stage"]
            self.rows[self._row] = int(attrs["data-workers"])
            self.workers[self._row] = 0
        if tag == "span" and self._row is not None and "worker" in attrs.get("class", "").split():
            self.workers[self._row] += 1
        if tag == "svg":
            self._svg = attrs.get("id")
        if tag == "circle" and self._svg == "loss-chart" and "point" in attrs.get("class", ""):
            self.points += 1

    def handle_endtag(self, tag):
        if tag == "tr":
            self._row = None
        if tag == "svg":
            self._svg = None


def test_the_status_page_shows_every_stage_its_workers_and_a_loss_curve(demo, tmp_path):
    chromium = tool("chromium")
    # The trainers post signed receipts every 20 global batches; the ledger verifies and sums them.
    contributors = until(lambda: get_json(demo + "api/contributors")["contributors"], 240,
                         "the first receipts in the monitor's ledger")
    flags = [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,1000",
             "--virtual-time-budget=5000"]  # the page's own fetches and redraws run within it
    dom = subprocess.run([chromium, *flags, "--dump-dom", demo], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    page = _Dom()
    page.feed(dom.stdout)
    assert page.updates >= 2, dom.stdout[:2000]  # polled and redrawn more than once
    assert page.rows == {str(s): REPLICAS for s in range(STAGES)}
    assert page.workers == page.rows
    assert page.points >= 3
    shown = set(re.findall(r'<tr data-worker="([^"]+)"', dom.stdout))  # the contributors table
    assert {entry["worker"] for entry in contributors} <= shown
    assert all(entry["flagged_receipts"] == 0 for entry in contributors)  # honest workers counted what they served
    shot = tmp_path / "status-page.png"
    subprocess.run([chromium, *flags, f"--screenshot={shot}", demo], capture_output=True, timeout=120, check=True)
    assert shot.stat().st_size > 10_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
