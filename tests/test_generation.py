"""Greedy decoding and beam search on a hand-made next-token distribution, where the best sequence, its
score and the effect of the length penalty and of ``eos`` are known exactly."""

from __future__ import annotations

import math

import pytest
import torch

from headmix.models import beam_search, build_model, get_config, greedy_decode
from headmix.models import generation

PAD, BOS, EOS, A, B, C = 0, 1, 2, 3, 4, 5
V = 6

# Next-token probabilities after each continuation of a prompt; a continuation not listed ends (eos 1);
# after an eos, eos and A are equally likely (so that a score that kept counting would change).
TABLES = {
    # Prompt BOS: greedy takes A (0.6), A (0.5), eos: p = 0.30. The beam also finds B, eos: p = 0.38,
    # better without a length penalty, worse with it (0.38 ** (1/2) < 0.30 ** (1/3)).
    BOS: {(): {A: 0.6, B: 0.4}, (A,): {A: 0.5, B: 0.1, EOS: 0.4}, (B,): {EOS: 0.95, A: 0.05}},
    # Prompt C: greedy takes C (0.7), eos (0.55): p = 0.385 and stops first. The beam also finds
    # C, A, eos: p = 0.315, which wins with a length penalty (0.315 ** (1/3) > 0.385 ** (1/2)).
    C: {(): {C: 0.7, A: 0.3}, (C,): {EOS: 0.55, A: 0.45}},
    # Prompt A, beam 2: at step 2 the top 2 of the candidates are B C (.35, live) and A eos (.30, ends);
    # the 3rd, A B (.20), must go on as the second live beam: it ends as A B eos (.20), the best with
    # length penalty 1 (log .2 / 3 > log .3 / 2).
    A: {(): {A: 0.5, B: 0.35, C: 0.15}, (A,): {EOS: 0.6, B: 0.4}, (B,): {C: 1.0}, (B, C): {EOS: 0.1, A: 0.9}},
}


def table_log_probs(prefix: generation._Prefix) -> torch.Tensor:
    rows = []
    for seq in prefix.tokens.tolist():
        ended = EOS in seq[1:]
        probs = {EOS: 0.5, A: 0.5} if ended else TABLES[seq[0]].get(tuple(seq[1:]), {EOS: 1.0})
        row = torch.full((V,), float("-inf"))
        for token, p in probs.items():
            row[token] = math.log(p)
        rows.append(row)
    return torch.stack(rows)


@pytest.fixture
def lm(monkeypatch):
    """A causal LM whose next-token distribution is the table above (the model itself is not run)."""
    monkeypatch.setattr(generation._Prefix, "next_log_probs", table_log_probs)
    torch.manual_seed(0)
    return build_model(get_config("tiny-mha", task="lm", vocab_size=V))


PROMPTS = torch.tensor([[BOS], [C]])


def test_greedy_takes_the_argmax_and_scores_until_eos(lm):
    out = greedy_decode(lm, PROMPTS, max_len=6, use_cache=False)
    # row 1 ends one step earlier: padded, and nothing added to its score after eos
    assert out.tokens.tolist() == [[A, A, EOS], [C, EOS, PAD]]
    torch.testing.assert_close(out.scores, torch.tensor([math.log(0.6 * 0.5), math.log(0.7 * 0.55)]))
    assert greedy_decode(lm, PROMPTS, max_len=1, use_cache=False).tokens.tolist() == [[A], [C]]


def test_beam_search_finds_a_better_sequence_than_greedy(lm):
    greedy = greedy_decode(lm, PROMPTS[:1], max_len=6, use_cache=False)
    beam = beam_search(lm, PROMPTS, beam_size=2, max_len=6, length_penalty=0.0, use_cache=False)
    assert beam.tokens.tolist() == [[B, EOS], [C, EOS]]
    torch.testing.assert_close(beam.scores, torch.tensor([math.log(0.4 * 0.95), math.log(0.7 * 0.55)]))
    assert beam.scores[0] > greedy.scores[0]  # log 0.38 > log 0.30
    # beam size 1 is greedy, whatever the length penalty
    for alpha in (0.0, 1.0):
        one = beam_search(lm, PROMPTS, beam_size=1, max_len=6, length_penalty=alpha, use_cache=False)
        assert one.tokens.tolist() == [[A, A, EOS], [C, EOS, PAD]]


def test_length_penalty_divides_by_length_to_the_power(lm):
    # score = sum log p / len ** alpha, len counting the eos
    for alpha in (1.0, 2.0):
        beam = beam_search(lm, PROMPTS, beam_size=2, max_len=6, length_penalty=alpha, use_cache=False)
        assert beam.tokens.tolist() == [[A, A, EOS], [C, A, EOS]]
        expected = [math.log(0.6 * 0.5) / 3 ** alpha, math.log(0.7 * 0.45) / 3 ** alpha]
        torch.testing.assert_close(beam.scores, torch.tensor(expected))
    # alpha = 0.5: row 0 keeps the short B, eos (log .38 / 2 ** .5 = -0.684 > log .3 / 3 ** .5 = -0.695)
    beam = beam_search(lm, PROMPTS, beam_size=2, max_len=6, length_penalty=0.5, use_cache=False)
    assert beam.tokens.tolist() == [[B, EOS, PAD], [C, A, EOS]]
    torch.testing.assert_close(beam.scores, torch.tensor([math.log(0.38) / 2 ** 0.5, math.log(0.315) / 3 ** 0.5]))


def test_beam_without_eos_by_max_len_returns_the_best_live_beam(lm):
    # max_len 1: no hypothesis has ended; the live beams (no eos) are scored over max_len tokens.
    beam = beam_search(lm, PROMPTS, beam_size=2, max_len=1, length_penalty=1.0, use_cache=False)
    assert beam.tokens.tolist() == [[A], [C]]
    torch.testing.assert_close(beam.scores, torch.tensor([math.log(0.6), math.log(0.7)]))
    # max_len 2: prompt BOS has B, eos finished (log .38 / 2) and live beams A A (log .30 / 2), A B; the
    # finished one is better. Prompt C has C, eos (log .385 / 2) and the live C A (log .315 / 2).
    beam = beam_search(lm, PROMPTS, beam_size=2, max_len=2, length_penalty=1.0, use_cache=False)
    assert beam.tokens.tolist() == [[B, EOS], [C, EOS]]
    torch.testing.assert_close(beam.scores, torch.tensor([math.log(0.38) / 2, math.log(0.385) / 2]))
    # a wider beam keeps both finished and live hypotheses; with beam 3 at max_len 2 for prompt BOS the
    # finished B, eos (0.38) beats every live beam (A A 0.30, A B 0.06) and A, eos (0.24)
    beam = beam_search(lm, PROMPTS[:1], beam_size=3, max_len=2, length_penalty=0.0, use_cache=False)
    assert beam.tokens.tolist() == [[B, EOS]]


def test_beam_keeps_k_live_hypotheses_when_some_end(lm):
    # 2k candidates per step, so that k beams go on even when some of the top k end with eos
    beam = beam_search(lm, torch.tensor([[A]]), beam_size=2, max_len=6, length_penalty=1.0, use_cache=False)
    assert beam.tokens.tolist() == [[A, B, EOS]]
    torch.testing.assert_close(beam.scores, torch.tensor([math.log(0.5 * 0.4) / 3]))
    # at max_len 2 the live B C (log .35 / 2) beats the finished A eos (log .30 / 2): live beams are
    # length-normalised too
    beam = beam_search(lm, torch.tensor([[A]]), beam_size=2, max_len=2, length_penalty=1.0, use_cache=False)
    assert beam.tokens.tolist() == [[B, C]]
    torch.testing.assert_close(beam.scores, torch.tensor([math.log(0.35) / 2]))


def test_eos_candidates_outside_the_top_k_do_not_finish(lm):
    # Prompt BOS at step 2 with beam 1: candidates A A (.30), A eos (.24): the top 1 is A A, so A eos
    # (ranked 2nd of the 2k candidates) must not be taken as a finished hypothesis.
    beam = beam_search(lm, PROMPTS[:1], beam_size=1, max_len=6, length_penalty=0.0, use_cache=False)
    assert beam.tokens.tolist() == [[A, A, EOS]]
    torch.testing.assert_close(beam.scores, torch.tensor([math.log(0.30)]))


def test_padding_is_never_generated():
    torch.manual_seed(0)
    model = build_model(get_config("tiny-mha", task="translation", vocab_size=V)).eval()
    project = model.compute_logits
    model.compute_logits = lambda hidden: project(hidden) + 100.0 * torch.nn.functional.one_hot(torch.tensor(PAD), V)
    src = torch.tensor([[3, 4, 5], [5, 4, 3]])
    for out in (greedy_decode(model, src, max_len=4), beam_search(model, src, beam_size=2, max_len=4)):
        assert out.tokens.shape == (2, 4) and out.tokens.ne(PAD).all()
