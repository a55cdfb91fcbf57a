"""The attack suite's figures (bench/attack_report.py): F1, steps to detection, loss ratios, goals."""

import json
from pathlib import Path

from agora.bench.attack_report import detection_row, render_markdown, score


def _run(seed, attack=None, position=None, caught=None, heldout=3.0, verify=True, churn=False, first_lie_step=None,
         steps=24):
    liar = None if attack is None else {"head": "s0r1", "body": "s1r1", "tail": "s2r1"}[position]
    return {"seed": seed, "steps": steps, "attack": attack, "position": position, "verify": verify, "churn": churn,
            "liar": liar, "caught": caught or {}, "heldout": heldout, "lies": 5, "first_lie_step": first_lie_step}


def _catch(how="verifier", lies=4, step=14):
    return {"how": how, "lies": lies, "step": step}


def test_f1_counts_liars_caught_missed_and_honest_workers_caught():
    runs = [_run(0, heldout=3.0), _run(1, heldout=2.0),
            _run(0, "sign-grad", "body", {"s1r1": _catch(step=14)}, heldout=3.03, first_lie_step=12),
            _run(1, "sign-grad", "body", {"s1r1": _catch(step=16), "s1r0": _catch()}, heldout=2.0, first_lie_step=12),
            _run(0, "sign-grad", "body", heldout=3.3, verify=False, first_lie_step=12),
            _run(0, "stale", "head", heldout=3.0), _run(1, "stale", "head", heldout=2.0),
            _run(0, "stale", "head", heldout=3.0, verify=False)]
    scores = score(runs)
    sign, stale = scores["cells"]
    # 2 caught, 0 missed, 1 honest caught: F1 = 4 / 5.
    assert (sign["runs"], sign["caught"], sign["honest_caught"]) == (2, 2, 1) and sign["f1"] == 0.8
    assert sign["steps_to_detection"] == 3.0 and sign["lies_to_detection"] == 4
    assert abs(sign["heldout_ratio"] - 1.005) < 1e-9 and abs(sign["unguarded_ratio"] - 1.1) < 1e-9
    assert sign["moves_loss"] is True and sign["met"] is False
    assert sign["who"] == {"s1r1": "verifier", "s1r0": "verifier"}
    # Never caught, but it does not move the loss: the F1 goal does not apply.
    assert stale["f1"] == 0.0 and stale["moves_loss"] is False and stale["met"] is True
    assert scores["overall"]["f1_moving"] == 0.8 and scores["overall"]["honest_caught"] == 1
    assert scores["overall"]["met"] is False


def test_a_late_attack_is_held_against_the_clean_run_of_its_own_length():
    runs = [_run(0, heldout=3.0), _run(0, heldout=2.0, steps=116),
            _run(0, "late", "body", {"s1r1": _catch(step=102)}, heldout=2.02, steps=116, first_lie_step=100)]
    late = score(runs)["cells"][0]
    assert abs(late["heldout_ratio"] - 1.01) < 1e-9 and late["steps_to_detection"] == 2


def test_a_liar_caught_before_its_first_lie_is_an_honest_worker_caught_and_a_miss():
    runs = [_run(0), _run(0, "late", "body", {"s1r1": _catch(lies=0, step=27)}, first_lie_step=100)]
    late = score(runs)["cells"][0]
    assert (late["caught"], late["honest_caught"], late["f1"]) == (0, 1, 0.0)


def test_an_honest_worker_caught_in_a_clean_run_fails_the_goal_and_is_named(tmp_path):
    runs = [_run(0, caught={"s2r0": _catch("scale bound")}), _run(0, churn=True),
            _run(0, "x1e4", "head", {"s0r1": _catch("scale bound", 1, 12)}, first_lie_step=12)]
    scores = score(runs)
    assert scores["clean"] == {"runs": 2, "churned": 1, "honest_caught": 1, "who": ["s2r0"]}
    assert scores["cells"][0]["met"] is True and scores["overall"]["met"] is False
    results = {"command": "python bench/attacks.py --quick", "machine": "m, 2 cores", "load": [1.0, 2.0],
               "seconds": 10.0, "settings": {"runs": 1, "seed": 0, "honest_steps": 12, "late_steps": 100,
                                             "lie_steps": 12}, "runs": runs, "scores": scores}
    table = render_markdown(results)
    assert "honest workers caught: 1 (s2r0)" in table and "| x1e4 | head | 1 | 1 | 0 | 1.00 | 0.0 | 1.0 |" in table
    path = tmp_path / "attacks.json"
    assert "not measured" in detection_row(path)
    path.write_text(json.dumps(results))
    row = detection_row(path)
    assert row.startswith("| 9 | hostile workers") and "honest caught 1 (clean runs 1 of 2)" in row
    assert row.endswith("| no |")


def test_the_suite_table_carries_the_detection_row_after_the_gpu_row():
    from agora.bench.suite_report import render

    record = json.loads((Path(__file__).resolve().parents[2] / "bench" / "results" / "suite.json").read_text())
    summary = render(record).split("\n## ")[1]
    rows = [line for line in summary.splitlines() if line.startswith("| 8 |") or line.startswith("| 9 |")]
    assert [row[:5] for row in rows] == ["| 8 |", "| 9 |"] and "hostile workers" in rows[1]
