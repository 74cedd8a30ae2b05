"""Sampling filters against transformers' logits warpers and hand computations on hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from workbench.core.errors import WorkbenchError
from workbench.engine.sampling import (
    Sampler,
    SamplingParams,
    apply_repetition_penalty,
    filter_logits,
    min_p_filter,
    top_k_filter,
    top_p_filter,
)

LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, -3.0, 1.0, 0.0, 2.5])
# Probabilities of LOGITS sorted: 3.0 .370, 2.5 .224, 2.0 .136, 1.0 .050, 0.5 .030, 0.0 .018, ...


def kept(logits: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(logits)).flatten().tolist())


def test_top_k_keeps_the_k_largest():
    assert kept(top_k_filter(LOGITS, 3)) == {3, 7, 0}
    assert kept(top_k_filter(LOGITS, 0)) == set(range(8))
    tied = torch.tensor([1.0, 2.0, 2.0, 0.0])
    assert kept(top_k_filter(tied, 1)) == {1, 2}


def test_top_p_by_hand():
    probs = torch.softmax(LOGITS, -1)
    order = torch.argsort(LOGITS, descending=True).tolist()
    for p in (0.05, 0.3, 0.5, 0.7, 0.9, 0.99):
        expected, mass = set(), 0.0
        for i in order:
            if mass >= p:
                break
            expected.add(i)
            mass += probs[i].item()
        assert kept(top_p_filter(LOGITS, p)) == expected, p
    assert kept(top_p_filter(LOGITS, 1e-6)) == {3}


def test_min_p_by_hand():
    probs = torch.softmax(LOGITS, -1)
    for m in (0.1, 0.3, 0.5, 0.9):
        expected = {i for i in range(8) if probs[i] >= m * probs.max()}
        assert kept(min_p_filter(LOGITS, m)) == expected


def test_repetition_penalty_by_hand():
    seen = torch.zeros(8, dtype=torch.bool)
    seen[[0, 1, 6]] = True
    out = apply_repetition_penalty(LOGITS, seen, 2.0)
    assert out.tolist() == [1.0, -2.0, 0.5, 3.0, -3.0, 1.0, 0.0, 2.5]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=4),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0.9, min_p=0.2),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
    ],
)
def test_filters_match_transformers_warpers(params):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    history = torch.randint(0, 50, (3, 6))
    seen = torch.zeros(3, 50, dtype=torch.bool).scatter(1, history, True)
    chain = []
    if params.repetition_penalty != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    chain.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k:
        chain.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        chain.append(TopPLogitsWarper(params.top_p))
    if params.min_p:
        chain.append(MinPLogitsWarper(params.min_p))
    ref = LogitsProcessorList(chain)(history, logits.clone())
    ours = filter_logits(logits, params, seen)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(ref))
    torch.testing.assert_close(ours[torch.isfinite(ours)], ref[torch.isfinite(ref)])


def test_greedy_takes_argmax_after_penalty():
    sampler = Sampler(SamplingParams(greedy=True), vocab_size=8)
    assert sampler.sample(LOGITS).item() == 3
    penalised = Sampler(SamplingParams(temperature=0.0, repetition_penalty=10.0), vocab_size=8)
    penalised.observe(torch.tensor([3]))
    assert penalised.sample(LOGITS).item() == 7


def test_seeded_sampling_is_reproducible_and_seed_sensitive():
    def draw(seed):
        s = Sampler(SamplingParams(temperature=1.0, seed=seed), vocab_size=8)
        return [s.sample(LOGITS).item() for _ in range(40)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_sampled_frequencies_follow_the_filtered_distribution():
    params = SamplingParams(temperature=0.8, top_k=4, seed=3)
    sampler = Sampler(params, vocab_size=8)
    probs = torch.softmax(filter_logits(LOGITS, params), -1)
    n = 4000
    counts = torch.bincount(torch.cat([sampler.sample(LOGITS) for _ in range(n)]), minlength=8).float()
    assert set(torch.nonzero(counts).flatten().tolist()) <= kept(top_k_filter(LOGITS, 4))
    # Each frequency within 5 standard deviations of its expectation.
    sd = torch.sqrt(n * probs * (1 - probs)) + 1e-9
    assert torch.all((counts - n * probs).abs() <= 5 * sd + 1), (counts / n, probs)


def test_sampler_ignores_padded_vocab_entries():
    padded = torch.cat([LOGITS, torch.full((4,), 100.0)])
    assert Sampler(SamplingParams(greedy=True), vocab_size=8).sample(padded).item() == 3


@pytest.mark.parametrize(
    "kwargs", [dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(min_p=2), dict(top_k=-2),
               dict(repetition_penalty=0)]
)
def test_bad_parameters_are_refused(kwargs):
    with pytest.raises(WorkbenchError):
        SamplingParams(**kwargs)


def test_temperature_scales_log_probabilities():
    out = filter_logits(LOGITS, SamplingParams(temperature=0.5))
    assert math.isclose(out[3].item(), 6.0)
