"""`agora-bench --row N --update F`: one row measured again, the others kept as they were.

Run on the suite's committed raw figures (bench/results/suite.json) with row 1, the wire-bytes
row, which measures in about a second: the rerun row carries its own commit and date, every
other row and the header are byte for byte the recorded ones, and a file that is not a suite
record is refused in one line.
"""

import json
import shutil
from pathlib import Path

import pytest

from agora.bench.suite_report import render
from agora.bench.cli import main

pytestmark = pytest.mark.timeout(300)

RECORD = Path(__file__).resolve().parents[2] / "bench" / "results" / "suite.json"


def test_a_row_measured_again_replaces_only_itself(tmp_path):
    raw, out = tmp_path / "suite.json", tmp_path / "RESULTS.md"
    shutil.copy(RECORD, raw)
    before = json.loads(raw.read_text())
    code = main(["--row", "1", "--update", str(raw), "--out", str(out),
                 "--workdir", str(tmp_path / "work")])
    assert code == 0
    after = json.loads(raw.read_text())
    rerun = after["items"]["1"].pop("rerun")
    assert rerun["commit"] and rerun["date"] and rerun["command"].startswith("agora-bench --row 1 --update")
    assert len(rerun["load"]) == 2
    assert set(after["items"]["1"]["data"]) == set(before["items"]["1"]["data"])
    for key in ("command", "commit", "date", "machine", "plan", "quick"):
        assert after[key] == before[key]
    assert {n: i for n, i in after["items"].items() if n != "1"} == {n: i for n, i in before["items"].items()
                                                                       if n != "1"}
    table = out.read_text()
    assert f"Measured again since, with the same plan and the other rows kept: row 1 on {rerun['date']}, " \
           f"commit {rerun['commit']}" in table
    # Everything but the header's new sentence and row 1's own section is the recorded table.
    old = render(before).split("\n## ")
    new = table.split("\n## ")
    assert [s for s in new if not s.startswith("1. ")][1:] == [s for s in old if not s.startswith("1. ")][1:]


def test_an_update_of_a_copy_writes_its_table_beside_it_and_leaves_the_repositorys_alone(tmp_path):
    from agora.bench.suite import RECORD_PATH, RESULTS_PATH, _table_path

    raw = tmp_path / "copy.json"
    shutil.copy(RECORD, raw)
    before = RESULTS_PATH.read_bytes()
    assert main(["--row", "1", "--update", str(raw), "--workdir", str(tmp_path / "work")]) == 0
    assert "| 1 | wire bytes" in (tmp_path / "copy.md").read_text()
    assert RESULTS_PATH.read_bytes() == before
    assert _table_path(False, str(RECORD_PATH)) == RESULTS_PATH and _table_path(False, None) == RESULTS_PATH


def test_a_row_that_fails_to_run_again_keeps_its_recorded_figures(tmp_path, monkeypatch):
    import agora.bench.suite as suite

    def broken():
        raise RuntimeError("the wire-bytes probe broke")

    monkeypatch.setattr(suite, "wire_row", broken)
    raw, out = tmp_path / "suite.json", tmp_path / "RESULTS.md"
    shutil.copy(RECORD, raw)
    before = json.loads(raw.read_text())
    code = main(["--row", "1", "--update", str(raw), "--out", str(out)])
    assert code == 1
    after = json.loads(raw.read_text())
    attempt = after["items"]["1"].pop("rerun_failed")
    assert attempt["error"] == "RuntimeError: the wire-bytes probe broke" and attempt["commit"]
    assert after == before  # nothing recorded was lost
    assert "Tried again and not measured, so the figures shown are the earlier ones: row 1 on " in out.read_text()
    assert "| 1 | wire bytes per token per boundary" in out.read_text()


def test_only_the_named_rows_run_without_a_record(tmp_path):
    raw, out = tmp_path / "raw.json", tmp_path / "RESULTS.md"
    code = main(["--quick", "--row", "1", "--out", str(out), "--json", str(raw)])
    assert code == 0
    results = json.loads(raw.read_text())
    assert list(results["items"]) == ["1"] and "rerun" not in results["items"]["1"]
    table = out.read_text()
    assert "| 1 | wire bytes" in table and "| 2 | swarm" not in table and "Measured again" not in table


@pytest.mark.parametrize("content, flags, message", [
    (None, [], "name the rows to measure again with --row N"),
    ("{not json", ["--row", "1"], "not JSON"),
    ('{"items": {}}', ["--row", "1"], "holds no suite plan"),
    ("copy", ["--row", "1", "--quick"], "--quick, --profile, --config and --seed do not apply"),
])
def test_a_bad_update_is_one_clear_line(tmp_path, capsys, content, flags, message):
    raw = tmp_path / "suite.json"
    if content == "copy" or content is None:
        shutil.copy(RECORD, raw)
    else:
        raw.write_text(content)
    before = raw.read_bytes()
    code = main([*flags, "--update", str(raw), "--out", str(tmp_path / "R.md")])
    assert code == 2
    assert message in capsys.readouterr().err
    assert raw.read_bytes() == before and not (tmp_path / "R.md").exists()


def test_a_missing_update_file_is_named(tmp_path, capsys):
    missing = tmp_path / "nothing.json"
    code = main(["--row", "7", "--update", str(missing)])
    assert code == 2 and f"--update {missing}: cannot read it" in capsys.readouterr().err


def test_the_gpu_row_shows_the_gpu_checks_last_run_or_says_it_never_ran(tmp_path):
    """Row 8 is bench/gpu.py's, measured on a GPU machine: the summary reads its results file, judges
    the best variant's MFU against 40%, and says so plainly where no run left one."""
    from agora.bench.suite_report import _gpu_row

    assert "not measured" in _gpu_row(tmp_path / "absent.json")
    figures = [{"measure": f"{variant}: microbatch 5 x 4096: {name}", **value}
               for variant, mfu in (("eager", 0.336), ("compiled", 0.444))
               for name, value in (("tokens/s", {"tokens_per_s": {0.336: 51_522.0, 0.444: 68_188.0}[mfu]}), ("MFU", {"utilization": mfu}))]
    results = {"environment": {"device": "NVIDIA H200"},
               "settings": {"body_microbatches": [1, 5], "body_variants": ["eager", "compiled"]},
               "parts": {"body-stage": {"status": "ok", "figures": figures}}}
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(results))
    row = _gpu_row(path)
    assert "eager 51,522 tokens/s, 33.6%; compiled 68,188 tokens/s, 44.4%" in row and row.endswith("| yes |")
    results["settings"]["body_variants"] = ["eager"]
    results["parts"]["body-stage"]["figures"] = [{**f, "measure": f["measure"].removeprefix("eager: ")}
                                                 for f in figures[:2]]
    path.write_text(json.dumps(results))
    assert _gpu_row(path).endswith("| no |")


def test_the_simulator_row_reads_the_validations_headlines_and_is_met_only_when_every_count_is_whole(tmp_path):
    from agora.bench.suite_report import _simulator_row

    assert "not run" in _simulator_row(tmp_path / "absent.md")
    path = tmp_path / "simulate_validation.md"
    path.write_text("# title\n\nRow 3: 13 of 34 runs within 10% of the measured tokens/s; median error 13%.\n\n"
                    "Averaging against R (4 R): round p50 4 of 4 within 20%; round p95 0 of 4 within 20%.\n\n"
                    "| a | b |\n")
    row = _simulator_row(path)
    assert "Row 3: 13 of 34 runs within 10%" in row and "round p95 0 of 4 within 20%." in row and row.endswith("| no |")
    path.write_text("Row 3: 34 of 34 runs within 10%.\n\nA newcomer against N (4 N): visible to others 4 of 4 within 20%.\n")
    assert _simulator_row(path).endswith("| yes |")
