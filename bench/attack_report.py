"""The attack suite's figures (bench/attacks.py) from its runs: detection F1 per behaviour and position,
the goals, the markdown table, and the summary row RESULTS.md shows.

Pure: a run is the dict `attack_swarm.run_plan` returns. Definitions, so that every figure can be
checked by hand against the runs in the JSON:

- A run's true positive: its liar caught (flagged by the verifier, a gradient, replay or spot
  check; refused by the scale bound; or blamed) after its
  first lie; a false negative: not caught so; false positives: the honest workers caught (any run,
  clean ones included), and a liar caught before it lied (it was an honest worker then).
  F1 = 2 TP / (2 TP + FP + FN) over a behaviour and position's guarded runs.
- Steps to detection: the liar's stage's step at the catch minus its step at the first lie.
- Held-out loss ratio: a run's held-out loss over the clean run of the same seed and steps (no churn).
- A lie moves the loss when its unguarded run's ratio is off 1 by more than `MOVES_LOSS`; the F1
  goal applies to those (and to lies never run unguarded: unknown counts as moving).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

__all__ = ["F1_GOAL", "LOSS_GOAL", "MOVES_LOSS", "score", "render_markdown", "detection_row"]

F1_GOAL = 0.95
LOSS_GOAL = 1.02  # guarded held-out loss at most 2% above the clean run's
MOVES_LOSS = 0.01
ROW_LABEL = ("| 9 | hostile workers (bench/attacks.py): detection F1 over runs; honest workers caught; held-out loss / "
             "clean |")


def _f1(true_positives: int, false_positives: int, false_negatives: int) -> float | None:
    denominator = 2 * true_positives + false_positives + false_negatives
    return None if denominator == 0 else 2 * true_positives / denominator


def _liar_caught(run: dict) -> bool:
    catch = run["caught"].get(run["liar"])
    return catch is not None and catch["lies"] > 0


def _honest_caught(run: dict) -> list[str]:
    return sorted(peer for peer in run["caught"] if peer != run["liar"] or not _liar_caught(run))


def _same(run: dict) -> tuple[int, int]:
    """The key of the clean run a run is held against: its seed and steps."""
    return run["seed"], run["steps"]


def _median(values: list) -> float | None:
    values = [value for value in values if value is not None]
    return statistics.median(values) if values else None


def _cell(runs: list[dict], unguarded: list[dict], clean_loss: dict[int, float]) -> dict:
    caught = [run for run in runs if _liar_caught(run)]
    honest = sum(len(_honest_caught(run)) for run in runs)
    who: dict[str, str] = {}
    for run in runs:
        for peer, catch in run["caught"].items():
            who[peer] = catch["how"]
    steps = [run["caught"][run["liar"]]["step"] - run["first_lie_step"] for run in caught
             if run["first_lie_step"] is not None and run["caught"][run["liar"]]["step"] is not None]
    ratios = [run["heldout"] / clean_loss[_same(run)] for run in runs if _same(run) in clean_loss]
    open_ratios = [run["heldout"] / clean_loss[_same(run)] for run in unguarded if _same(run) in clean_loss]
    open_ratio = _median(open_ratios)
    moves = None if open_ratio is None else abs(open_ratio - 1) > MOVES_LOSS
    f1 = _f1(len(caught), honest, len(runs) - len(caught))
    guarded = _median(ratios)
    met = (f1 is not None and f1 >= F1_GOAL or moves is False) and honest == 0 and \
        (guarded is None or guarded <= LOSS_GOAL)
    return {"attack": runs[0]["attack"], "position": runs[0]["position"], "runs": len(runs), "caught": len(caught),
            "honest_caught": honest, "f1": f1, "steps_to_detection": _median(steps),
            "lies_to_detection": _median([run["caught"][run["liar"]]["lies"] for run in caught]),
            "who": who, "heldout_ratio": guarded, "unguarded_ratio": open_ratio, "moves_loss": moves, "met": met}


def score(runs: list[dict]) -> dict:
    """Per (attack, position) cell and overall (module docstring)."""
    clean = [run for run in runs if run["attack"] is None]
    clean_loss = {_same(run): run["heldout"] for run in clean if not run["churn"]}
    keys = list(dict.fromkeys((run["attack"], run["position"]) for run in runs if run["attack"] is not None))
    cells = [_cell([r for r in runs if (r["attack"], r["position"]) == key and r["verify"]],
                   [r for r in runs if (r["attack"], r["position"]) == key and not r["verify"]], clean_loss)
             for key in keys]
    cells = [cell for cell in cells if cell["runs"]]
    clean_honest = sum(len(_honest_caught(run)) for run in clean)
    goal_cells = [cell for cell in cells if cell["moves_loss"] is not False]
    tp = sum(cell["caught"] for cell in goal_cells)
    fn = sum(cell["runs"] - cell["caught"] for cell in goal_cells)
    fp = sum(cell["honest_caught"] for cell in cells) + clean_honest
    return {"cells": cells,
            "clean": {"runs": len(clean), "churned": sum(run["churn"] for run in clean), "honest_caught": clean_honest,
                      "who": sorted({peer for run in clean for peer in _honest_caught(run)})},
            "overall": {"f1_moving": _f1(tp, fp, fn), "honest_caught": fp,
                        "worst_f1": min((cell["f1"] for cell in goal_cells if cell["f1"] is not None), default=None),
                        "worst_heldout_ratio": max((cell["heldout_ratio"] for cell in cells
                                                    if cell["heldout_ratio"] is not None), default=None),
                        "met": all(cell["met"] for cell in cells) and clean_honest == 0}}


def _f(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _yes(value) -> str:
    return "-" if value is None else ("yes" if value else "no")


def render_markdown(results: dict) -> str:
    """bench/results/attacks_tiny.md: the clean runs, the detection table and how it was made."""
    scores, settings = results["scores"], results["settings"]
    clean = scores["clean"]
    load = "->".join(f"{value:.1f}" for value in results["load"])
    lines = [f"# Hostile workers against the trainer's checks (tiny, head/body/tail x2 replicas averaged every 3 "
             f"steps, {settings['runs']} seed(s) from {settings['seed']})", "",
             f"`{results['command']}` on {results['machine']}, {results['seconds']:.0f} s, 1-minute load {load}. "
             f"A liar lies after {settings['honest_steps']} honest steps, for {settings['lie_steps']} (late: after "
             f"{settings['late_steps']}); on-off lies 4 replies, honest 4. "
             "Caught: flagged by the verifier or by a gradient, replay or spot check, refused by the scale bound, or "
             "blamed for a refusal downstream "
             "(bench/attack_report.py defines every column).", "",
             f"Clean runs: {clean['runs']} ({clean['churned']} losing a body replica half-way); honest workers "
             f"caught: {clean['honest_caught']}{' (' + ', '.join(clean['who']) + ')' if clean['who'] else ''}.", "",
             "| behaviour | at | runs | caught | honest caught | F1 | steps to detection | lies to detection | "
             "whom (how) | held-out / clean | unguarded / clean | moves loss > 1% | goal met |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---|"]
    for cell in scores["cells"]:
        who = ", ".join(f"{peer} ({how})" for peer, how in sorted(cell["who"].items())) or "-"
        lines.append(f"| {cell['attack']} | {cell['position']} | {cell['runs']} | {cell['caught']} | "
                     f"{cell['honest_caught']} | {_f(cell['f1'], 2)} | {_f(cell['steps_to_detection'], 1)} | "
                     f"{_f(cell['lies_to_detection'], 1)} | {who} | {_f(cell['heldout_ratio'], 4)} | "
                     f"{_f(cell['unguarded_ratio'], 4)} | {_yes(cell['moves_loss'])} | {_yes(cell['met'])} |")
    overall = scores["overall"]
    lines += ["", f"Goals: F1 >= {F1_GOAL} on every lie that moves the unguarded loss by more than "
              f"{MOVES_LOSS:.0%}, no honest worker caught, held-out loss within {LOSS_GOAL - 1:.0%} of the clean "
              f"run. Overall F1 over those: {_f(overall['f1_moving'], 3)}; honest workers caught: "
              f"{overall['honest_caught']}; all met: {_yes(overall['met'])}."]
    return "\n".join(lines) + "\n"


def detection_row(path: Path) -> str:
    """RESULTS.md's row from bench/attacks.py's JSON (or a line saying it was never run)."""
    if not path.exists():
        return f"{ROW_LABEL} not measured: `python bench/attacks.py --runs 3 --unguarded 1 --churn --load 2` | - | - |"
    results = json.loads(path.read_text())
    scores = results["scores"]
    overall = scores["overall"]
    short = [f"{cell['attack']} at {cell['position']} {_f(cell['f1'], 2)}" for cell in scores["cells"]
             if cell["moves_loss"] is not False and (cell["f1"] or 0.0) < F1_GOAL]
    measured = (f"{len(scores['cells'])} behaviour x position cells, {results['settings']['runs']} seed(s): worst F1 "
                f"{_f(overall['worst_f1'], 2)}{' (' + '; '.join(short) + ')' if short else ''}; honest caught "
                f"{overall['honest_caught']} (clean runs {scores['clean']['honest_caught']} of "
                f"{scores['clean']['runs']}); worst held-out / clean {_f(overall['worst_heldout_ratio'], 4)} "
                f"(bench/results/attacks_tiny.md)")
    return (f"{ROW_LABEL} {measured} | F1 >= {F1_GOAL}, 0 honest, <= {LOSS_GOAL} | "
            f"{_yes(overall['met'])} |")
