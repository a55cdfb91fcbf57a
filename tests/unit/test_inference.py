"""KV-cached inference on stages (pipeline/inference.py), without any network.

- Cached decode equals recomputing the whole sequence: every step's logits within 1e-5 (fp32),
  on `tiny` (Llama, GQA, subspace) and the `pythia-14m` geometry (GPT-NeoX, partial rotary, dense,
  parallel residual), through a 3-stage split, with prefills in chunks and rewinds.
- Greedy generation with the stages composed in one process equals transformers' `generate` on
  the `export-hf` output of the same model (loaded back from disk).
- Sampling: seeded and repeatable, top-p that keeps one token is greedy, bad values named.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from agora.pipeline.config import PRESETS, ConfigError
from agora.pipeline.inference import (
    GREEDY,
    LocalGenerator,
    Sampling,
    SessionTooLong,
    StageCache,
    TokenChooser,
    cached_forward,
    new_token_budget,
    score_positions,
)
from agora.pipeline.model import SubspaceTransformer
from agora.pipeline.stages import stages_of

pytestmark = pytest.mark.timeout(120)


def _model(preset: str, stages: int = 3, **model_fields) -> SubspaceTransformer:
    config = PRESETS[preset].with_stages(stages).model
    model = SubspaceTransformer(replace(config, **model_fields))
    return model.eval()


GEOMETRIES = {
    "tiny": lambda: _model("tiny"),
    # Shorter than pythia's 2048 positions only to keep the test's sequences cheap; the geometry is pythia's.
    "pythia-14m": lambda: _model("pythia-14m"),
}


def _pipeline_logits(stages, caches, tokens, position=None):
    wire = None
    for stage, cache in zip(stages, caches):
        wire = cached_forward(stage, tokens, wire, cache, position=position, last_only=False)
    return wire


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_cached_decode_equals_recomputing_the_whole_sequence(geometry):
    model = GEOMETRIES[geometry]()
    stages = stages_of(model)
    vocab = model.config.vocab_size
    sequence = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(3))
    caches = [StageCache(stage) for stage in stages]
    # A prompt in two chunks (the second attends to the cached first), then one token at a time.
    chunks = [(0, 7), (7, 12)] + [(i, i + 1) for i in range(12, 24)]
    with torch.no_grad():
        for start, end in chunks:
            cached = _pipeline_logits(stages, caches, sequence[:, start:end])
            full = model(sequence[:, :end])[:, start:end]
            torch.testing.assert_close(cached, full, rtol=0, atol=1e-5)
    assert all(cache.length == 24 for cache in caches)
    assert caches[0].layers[next(iter(caches[0].layers))].keys.shape[1] == model.config.n_kv_heads


def test_a_call_at_an_earlier_position_recomputes_from_there():
    """A retried or rewound step: the cache is cut back to `position`, never appended twice."""
    model = _model("tiny")
    stages = stages_of(model)
    sequence = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(4))
    other = torch.randint(0, 256, (1, 4), generator=torch.Generator().manual_seed(5))
    caches = [StageCache(stage) for stage in stages]
    with torch.no_grad():
        _pipeline_logits(stages, caches, sequence[:, :12])
        _pipeline_logits(stages, caches, other)  # positions 12..15 with other tokens
        again = _pipeline_logits(stages, caches, sequence[:, 12:16], position=12)
        full = model(sequence)[:, 12:16]
    torch.testing.assert_close(again, full, rtol=0, atol=1e-5)
    assert caches[-1].length == 16
    with pytest.raises(ValueError, match="holds 16 positions"):
        cached_forward(stages[0], sequence[:, :1], None, caches[0], position=17)
    with pytest.raises(ValueError, match="2 rows, this session has 1"):
        cached_forward(stages[0], sequence.expand(2, -1)[:, :1], None, caches[0])


def test_a_session_cannot_pass_the_models_longest_sequence():
    model = _model("tiny", max_seq_len=8)
    head = stages_of(model)[0]
    cache = StageCache(head)
    cached_forward(head, torch.zeros(1, 6, dtype=torch.long), None, cache)
    with pytest.raises(SessionTooLong, match="model.max_seq_len"):
        cached_forward(head, torch.zeros(1, 3, dtype=torch.long), None, cache)
    assert cache.length == 6


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_greedy_generation_in_one_process_equals_transformers_generate(geometry, tmp_path):
    from transformers import AutoModelForCausalLM

    from agora.pipeline.interop import save_pretrained

    model = GEOMETRIES[geometry]()
    save_pretrained(model, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(6))
    ours = LocalGenerator(stages_of(model)).generate(prompt[0].tolist(), 20)
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)[0, 9:].tolist()
    assert len(ours) == 20
    assert ours == theirs


def test_generation_stops_at_a_stop_id_and_at_the_longest_sequence():
    model = _model("tiny", max_seq_len=16)
    generator = LocalGenerator(stages_of(model))
    prompt = [5, 6, 7, 8]
    free = generator.generate(prompt, 40)
    assert len(free) == 16 - 4 + 1  # the last token needs no forward of its own
    stopped = generator.generate(prompt, 40, stop_ids=(free[3],))
    assert stopped == free[:free.index(free[3])]


def test_sampling_is_seeded_and_top_p_of_one_token_is_greedy():
    logits = torch.randn(256, generator=torch.Generator().manual_seed(7)) * 3
    draw = lambda sampling: [TokenChooser(sampling).choose(logits) for _ in range(1)] + [  # noqa: E731
        chooser.choose(logits) for chooser in [TokenChooser(sampling)] for _ in range(30)]
    hot = Sampling(temperature=1.0, seed=11)
    assert draw(hot) == draw(hot)
    assert draw(hot) != draw(replace(hot, seed=12))
    assert len(set(draw(hot))) > 3
    assert set(draw(Sampling(temperature=1.0, top_p=1e-6, seed=1))) == {int(torch.argmax(logits))}
    assert TokenChooser(GREEDY).choose(logits) == int(torch.argmax(logits))


@pytest.mark.parametrize("fields, needle", [
    ({"temperature": -1.0}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"seed": -1}, "seed"),
])
def test_bad_sampling_values_are_named(fields, needle):
    with pytest.raises(ConfigError, match=needle):
        TokenChooser(Sampling(**fields))


def test_new_token_budget():
    assert new_token_budget(4, 10, 256) == 10
    assert new_token_budget(250, 10, 256) == 7
    assert new_token_budget(256, 0, 256) == 0
    with pytest.raises(ConfigError, match="prompt: empty"):
        new_token_budget(0, 5, 256)
    with pytest.raises(ConfigError, match="at most 256"):
        new_token_budget(256, 1, 256)


def test_scores_are_the_log_softmax_at_each_position_and_a_padded_row_ends_where_its_prompt_does():
    logits = torch.randn(2, 4, 7)
    tokens = torch.tensor([[1, 2, 3, 4], [5, 6, 0, 0]])
    scores = score_positions(logits, tokens, 3)
    expected = torch.log_softmax(logits, dim=-1)
    assert scores.token_logprobs[0, :3].tolist() == [expected[0, i, tokens[0, i + 1]].item() for i in range(3)]
    assert scores.token_logprobs[:, -1].tolist() == [0.0, 0.0]
    assert torch.equal(scores.top_ids, torch.topk(expected, 3, dim=-1).indices)
    row = scores.row(1, 2)
    assert row.token_logprobs.tolist() == [[expected[1, 0, 6].item(), 0.0]] and row.top_ids.shape == (1, 2, 3)
    assert score_positions(logits, tokens, 0).top_ids.shape == (2, 4, 0)
