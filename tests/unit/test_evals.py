"""The pure parts of a trainer's evaluations (node/trainer/evals.py): when one is due, the held-out
loss from scored prompts, lm-eval's results as flat figures, the log line."""

import json
import math

import pytest
import torch

from agora.node.trainer.evals import EvalResult, heldout_prompts, is_due, mean_heldout_loss, task_figures
from agora.pipeline.config import ConfigError
from agora.pipeline.inference import PositionScores


def scores(*rows: list[float]) -> list[PositionScores]:
    empty = torch.zeros((1, 0, 0))
    return [PositionScores(torch.tensor([row]), empty, empty.long()) for row in rows]


def test_an_evaluation_is_due_every_n_batches_of_this_trainer_and_never_with_every_0():
    assert [n for n in range(1, 10) if is_due(n, 3)] == [3, 6, 9]
    assert not any(is_due(n, 0) for n in range(10)) and not is_due(0, 3)


def test_the_heldout_loss_averages_every_predicted_token_and_ignores_each_prompts_last_position():
    # Position i holds log p(token i+1); the last position's next token is not in the prompt (0).
    loss = mean_heldout_loss(scores([-1.0, -2.0, 0.0], [-3.0, 0.0]))
    assert loss == pytest.approx((1 + 2 + 3) / 3)
    with pytest.raises(ConfigError, match="evals.heldout_batches"):
        mean_heldout_loss(scores([0.0]))


def test_heldout_prompts_are_the_sequences_cut_to_what_one_prefill_takes():
    batches = [torch.arange(10).view(2, 5), torch.arange(10, 20).view(2, 5)]
    assert heldout_prompts(batches, 8) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14], [15, 16, 17, 18, 19]]
    assert heldout_prompts(batches[:1], 4) == [[0, 1, 2, 3], [5, 6, 7, 8]]


def test_lm_eval_results_become_flat_figures_without_stderr_or_text():
    results = {"agora_code_mc": {"alias": "agora_code_mc", "acc,none": 0.5, "acc_stderr,none": "N/A",
                                 "sample_len": 4},
               "gsm": {"exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": 0.1, "ok,none": True}}
    assert task_figures(results) == {"agora_code_mc.acc": 0.5, "gsm.exact_match.strict-match": 0.25}


def test_the_log_line_carries_the_step_the_figures_and_the_time():
    line = json.loads(EvalResult(12, {"heldout_loss": 2.0, "heldout_perplexity": math.exp(2.0)}, 1.23456).to_json())
    assert line == {"step": 12, "eval": {"heldout_loss": 2.0, "heldout_perplexity": math.exp(2.0)}, "eval_s": 1.235}
