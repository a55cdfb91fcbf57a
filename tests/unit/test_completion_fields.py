"""The completions API's fields (node/inference/request_fields.py) and its log-probability shapes
(node/inference/logprobs.py), without a server: prompt forms, bounds naming the field, OpenAI's
legacy and chat `logprobs` objects from scored positions."""

from __future__ import annotations

import pytest
import torch

from agora.node.inference.choices import ChoiceDelta, collect
from agora.node.inference.logprobs import (TokenLogprob, chat_logprobs, completion_logprobs, generated_logprobs,
                                           prompt_logprobs)
from agora.node.inference.request_fields import MAX_CHOICES, ApiError, parse_chat, parse_completion
from agora.pipeline.inference import PositionScores

VOCAB = 256


def parse(**body):
    return parse_completion({"model": "m", **body}, VOCAB)


def refusal(call) -> str:
    with pytest.raises(ApiError) as error:
        call()
    assert error.value.status == 400
    return error.value.param


def test_every_prompt_form_and_the_scoring_fields():
    assert parse(prompt="ab").prompts == ("ab",)
    assert parse(prompt=["ab", "c"]).prompts == ("ab", "c")
    assert parse(prompt=[1, 2, 3]).prompts == ((1, 2, 3),)
    request = parse(prompt=[[1, 2], [3]], echo=True, logprobs=0, max_tokens=0, n=2)
    assert request.prompts == ((1, 2), (3,)) and request.echo and request.logprobs == 0
    assert request.max_tokens == 0 and request.n == 2 and request.choices == 4
    assert parse(prompt="a").logprobs is None and not parse(prompt="a").echo


@pytest.mark.parametrize("body, param", [
    ({"prompt": ""}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": ["a", 1]}, "prompt"),
    ({"prompt": [[1], []]}, "prompt"), ({"prompt": [VOCAB]}, "prompt"), ({"prompt": [True]}, "prompt"),
    ({"prompt": "a", "logprobs": 21}, "logprobs"), ({"prompt": "a", "logprobs": True}, "logprobs"),
    ({"prompt": "a", "echo": "yes"}, "echo"), ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": ["a", "b"], "n": MAX_CHOICES}, "n"), ({"prompt": "a", "max_tokens": -1}, "max_tokens"),
])
def test_out_of_range_fields_are_refused_by_name(body, param):
    assert refusal(lambda: parse(**body)) == param


def test_chat_logprobs_take_top_logprobs_only_with_logprobs():
    messages = [{"role": "user", "content": "hi"}]
    assert parse_chat({"messages": messages})[0].logprobs is None
    assert parse_chat({"messages": messages, "logprobs": True})[0].logprobs == 0
    assert parse_chat({"messages": messages, "logprobs": True, "top_logprobs": 3})[0].logprobs == 3
    assert refusal(lambda: parse_chat({"messages": messages, "top_logprobs": 3})) == "top_logprobs"


def scores(token_logprobs, top_logprobs, top_ids) -> PositionScores:
    return PositionScores(torch.tensor([token_logprobs]), torch.tensor([top_logprobs]), torch.tensor([top_ids]))


def test_the_legacy_shape_scores_token_i_at_position_i_minus_1_and_names_the_token_beside_the_top():
    prompt = [ord("a"), ord("b"), ord("c")]
    positions = scores([-1.0, -2.0, 0.0], [[-0.5], [-0.25], [-0.1]], [[ord("b")], [ord("x")], [ord("y")]])
    entries = prompt_logprobs(prompt, positions)
    assert entries[0] == TokenLogprob(ord("a"), None, None)
    shaped = completion_logprobs(entries, chr, text_start=0)
    assert shaped["tokens"] == ["a", "b", "c"] and shaped["text_offset"] == [0, 1, 2]
    assert shaped["token_logprobs"] == [None, -1.0, -2.0]
    assert shaped["top_logprobs"] == [None, {"b": -0.5}, {"x": -0.25, "c": -2.0}]
    drawn = generated_logprobs([ord("y")], [scores([-0.1], [[-0.1]], [[ord("y")]])])
    assert completion_logprobs(drawn, chr, text_start=3) == {
        "tokens": ["y"], "token_logprobs": [pytest.approx(-0.1)], "top_logprobs": [{"y": pytest.approx(-0.1)}],
        "text_offset": [3]}


def test_the_chat_shape_lists_alternatives_with_their_bytes():
    entry = TokenLogprob(ord("h"), -0.5, ((ord("h"), -0.5), (ord("j"), -1.5)))
    assert chat_logprobs([entry], chr) == {"content": [{"token": "h", "logprob": -0.5, "bytes": [104], "top_logprobs": [
        {"token": "h", "logprob": -0.5, "bytes": [104]}, {"token": "j", "logprob": -1.5, "bytes": [106]}]}]}


def test_deltas_add_up_to_choices_by_index():
    entry = TokenLogprob(1, -1.0, ())
    choices = collect([ChoiceDelta(1, "x", None, None, 4), ChoiceDelta(0, "ab", [entry]),
                       ChoiceDelta(0, "c", [entry], "stop"), ChoiceDelta(1, "", None, "length")])
    assert [(c.index, c.text, c.finish_reason, c.text_start) for c in choices] == [(0, "abc", "stop", 0),
                                                                                  (1, "x", "length", 4)]
    assert choices[0].logprobs == [entry, entry] and choices[1].logprobs is None
