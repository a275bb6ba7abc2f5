"""Speculative sampling (Sampler.verify_drafts) keeps the target's distribution: the tokens a request gets
with n-gram drafts are distributed exactly as without them, greedy rows keep exactly the argmax's drafts,
and seeded rows are reproducible."""
from __future__ import annotations

import pytest
import torch

from tokenmill.sample.sampler import Sampler, SamplingRequestState
from tokenmill.sampling_params import SamplingParams

# Two positions' logits over a 6-token vocabulary: draft 2 at position 0, then draft 0 at position 1.
POSITION_LOGITS = [[1.0, 0.2, 0.8, -0.5, 1.5, -3.0], [0.3, 1.2, -0.7, 0.9, 0.0, 2.0], [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]]
DRAFTS = [2, 0]


def _target(position: int, params: SamplingParams, output=(), kernels=None) -> torch.Tensor:
    """The distribution the sampler draws position `position` from, one step at a time (empirically,
    through Sampler.__call__, so the test does not restate the sampler's masks)."""
    sampler = Sampler(7, kernels)
    rows = 40_000
    logits = torch.tensor([POSITION_LOGITS[position]] * rows)
    states = [SamplingRequestState(params, [0], list(output), None) for _ in range(rows)]
    tokens = torch.tensor(sampler(logits, states).sampled_token_ids)
    return torch.bincount(tokens, minlength=6).double() / rows


def _verify(params: SamplingParams, requests: int, seed: int = 1, kernels=None):
    sampler = Sampler(seed, kernels)
    logits = torch.tensor(POSITION_LOGITS * requests)
    states = []
    for _ in range(requests):
        for i in range(3):
            states.append(SamplingRequestState(params, [0], list(DRAFTS[:i]), None))
    return sampler.verify_drafts(logits, states, [DRAFTS] * requests)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8), SamplingParams(temperature=1.3, top_k=4),
                                    SamplingParams(temperature=1.0, top_p=0.8, presence_penalty=0.7)],
                         ids=["temperature", "top_k", "top_p_and_penalty"])
def test_tokens_follow_the_target_distribution_position_by_position(params):
    _check_position_by_position(params)


def test_the_cpu_kernels_draws_follow_it_too(kernels):
    """The same with the runner's sampler on CPU, whose exponential race draws its uniforms in C++."""
    _check_position_by_position(SamplingParams(temperature=1.3, top_k=4), kernels)


def _check_position_by_position(params: SamplingParams, kernels=None) -> None:
    requests = 40_000
    outcomes = _verify(params, requests, kernels=kernels)
    first = torch.tensor([(kept + [token])[0] for kept, token in outcomes])
    first_freq = torch.bincount(first, minlength=6).double() / requests
    target0 = _target(0, params, kernels=kernels)
    # Two estimates of the same distribution, 40,000 draws each: within 5 standard deviations.
    assert (first_freq - target0).abs().max() < 5 * (2 * 0.25 / requests) ** 0.5, (first_freq, target0)
    # The draft is kept as often as the target draws it.
    kept_first = sum(1 for kept, _ in outcomes if kept) / requests
    assert abs(kept_first - float(target0[DRAFTS[0]])) < 0.02
    # Given the first draft, the second token follows position 1's distribution (whose state counts the
    # draft among the output: the presence penalty sees it).
    second = torch.tensor([(kept + [token])[1] for kept, token in outcomes if kept])
    second_freq = torch.bincount(second, minlength=6).double() / len(second)
    target1 = _target(1, params, output=DRAFTS[:1], kernels=kernels)
    assert (second_freq - target1).abs().max() < 5 * (2 * 0.25 / len(second)) ** 0.5, (second_freq, target1)


def test_greedy_rows_keep_exactly_the_argmax_drafts_under_penalties():
    params = SamplingParams(temperature=0, repetition_penalty=1.5)
    # Position 0's argmax is 4, not the draft 2: nothing kept, the token is the argmax.
    assert _verify(params, 3) == [([], 4)] * 3
    logits = torch.tensor(POSITION_LOGITS)
    states = [SamplingRequestState(params, [0], [4][:i], None) for i in range(3)]
    kept, token = Sampler().verify_drafts(logits, states, [[4, 5]])[0]
    # One step at a time: argmax 4, then (with 4 in the output and penalized) 5, then 5 penalized.
    one_by_one = [Sampler()(logits[i:i + 1], [states[i]]).sampled_token_ids[0] for i in range(3)]
    assert one_by_one[:2] == [4, 5] and (kept, token) == ([4, 5], one_by_one[2])


def test_seeded_requests_are_reproducible():
    params = SamplingParams(temperature=1.0, seed=42)
    assert _verify(params, 50, seed=1) == _verify(params, 50, seed=2)  # the engine's seed does not matter
    other = SamplingParams(temperature=1.0, seed=43)
    assert _verify(params, 1) != _verify(other, 1) or _verify(params, 1) != _verify(SamplingParams(temperature=1.0,
                                                                                                   seed=44), 1)


def test_a_refused_draft_is_never_the_token_drawn_in_its_place():
    outcomes = _verify(SamplingParams(temperature=0.8), 5_000)
    assert all(token != DRAFTS[len(kept)] for kept, token in outcomes if len(kept) < len(DRAFTS))


def test_drafts_from_a_wrong_distribution_still_give_the_targets():
    """A draft model's drafts (here deliberately drawn from a distribution far from the target's) are kept
    with min(1, p/q) and replaced from max(0, p - q): the tokens follow the target, by a chi-square test at
    the 0.1% level, position by position."""
    requests, temperature = 30_000, 0.8
    q = torch.tensor([[0.05, 0.05, 0.6, 0.1, 0.1, 0.1], [0.5, 0.02, 0.02, 0.02, 0.02, 0.42]], dtype=torch.float64)
    generator = torch.Generator().manual_seed(11)
    drafts = torch.stack([torch.multinomial(q[i].float(), requests, replacement=True, generator=generator)
                          for i in range(2)], dim=1).tolist()
    params = SamplingParams(temperature=temperature)
    logits = torch.tensor(POSITION_LOGITS * requests)
    states = [SamplingRequestState(params, [0], list(d[:i]), None) for d in drafts for i in range(3)]
    draft_probs = q.float().repeat(requests, 1)  # rows in the drafts' order: request by request, position by position
    outcomes = Sampler(seed=3).verify_drafts(logits, states, drafts, draft_probs=draft_probs)
    chi2_critical = 20.52  # 5 degrees of freedom, 0.1%
    for position in (0, 1):
        target = torch.softmax(torch.tensor(POSITION_LOGITS[position], dtype=torch.float64) / temperature, dim=0)
        # Position 1's token exists when position 0's draft was kept.
        tokens = [(kept + [token])[position] for kept, token in outcomes if len(kept) >= position]
        counts = torch.bincount(torch.tensor(tokens), minlength=6).double()
        expected = target * len(tokens)
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < chi2_critical, (position, chi2, counts / len(tokens), target)
    # q is really used: a draft is kept with probability sum_x min(p(x), q(x)), not the point-mass rule's
    # sum_x q(x) p(x) (which also keeps the target's distribution, with fewer drafts kept).
    target = torch.softmax(torch.tensor(POSITION_LOGITS[0], dtype=torch.float64) / temperature, dim=0)
    kept_share = sum(1 for kept, _ in outcomes if kept) / requests
    assert abs(kept_share - float(torch.minimum(target, q[0]).sum())) < 0.015
    assert abs(kept_share - float((target * q[0]).sum())) > 0.1


def test_a_draft_models_draws_follow_its_own_distribution():
    """Sampler.sample_drafts draws each row from the distribution the sampler would (here temperature and
    top-k), returns those rows as q, and a seeded row's draw is its own stream (reproducible, and apart from
    the token the same row would be sampled with)."""
    rows = 30_000
    params = SamplingParams(temperature=0.7, top_k=4)
    logits = torch.tensor([POSITION_LOGITS[0]] * rows)
    states = [SamplingRequestState(params, [0], [], None) for _ in range(rows)]
    tokens, q = Sampler(seed=5).sample_drafts(logits, states)
    expected = _target(0, params)
    assert torch.allclose(q[0].double(), expected, atol=0.01) and torch.allclose(q[0], q[-1])
    observed = torch.bincount(torch.tensor(tokens), minlength=6).double() / rows
    assert torch.allclose(observed, expected, atol=0.015), (observed, expected)
    assert observed[5] == 0 and observed[3] == 0  # outside the top 4
    seeded = [SamplingRequestState(SamplingParams(temperature=1.0, seed=s), [0], [], None) for s in range(200)]
    one = torch.tensor([POSITION_LOGITS[1]] * 200)
    first, _ = Sampler(seed=1).sample_drafts(one, seeded)
    assert Sampler(seed=2).sample_drafts(one, seeded)[0] == first
    assert Sampler(seed=1)(one, seeded).sampled_token_ids != first  # not the token's own draw
