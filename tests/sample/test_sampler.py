"""Sampler: exact masks and penalties on hand-built logits, seeded reproducibility, distributions."""
from __future__ import annotations

import math

import pytest
import torch

from tokenmill.sample import logits_processors as lp
from tokenmill.sample import sampler as sampler_module
from tokenmill.sample.sampler import (
    Sampler,
    SamplingRequestState,
    compute_prompt_logprobs,
    mix_seed,
)
from tokenmill.sampling_params import SamplingParams

NEG_INF = float("-inf")


def state(prompt=(0,), output=(), eos=None, **params) -> SamplingRequestState:
    return SamplingRequestState(SamplingParams(**params), list(prompt), list(output), eos)


def kept(row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(row).nonzero().flatten().tolist())


def log_probs(*probs: float) -> list[float]:
    return [math.log(p) for p in probs]


@pytest.fixture(params=["torch", "cpu kernels"])
def make_sampler(request):
    """Sampler(seed) drawing through torch's generators, or through tokenmill's C++ kernels as the runner
    builds it on CPU (argmax and the exponential race's uniforms)."""
    kernels = request.getfixturevalue("kernels") if request.param == "cpu kernels" else None
    return lambda seed=0: Sampler(seed, kernels)


# -- truncation masks ---------------------------------------------------------------------------


def test_top_k_keeps_exactly_k_largest_and_ties():
    logits = torch.tensor([[0.1, 5.0, 3.0, 4.0, -1.0, 2.0],
                           [5.0, 4.0, 4.0, 1.0, 0.0, 4.0]])
    lp.apply_top_k(logits, torch.tensor([3, 2]))
    assert kept(logits[0]) == {1, 2, 3}
    # Ties with the k-th value survive (HF semantics): all three 4.0s stay.
    assert kept(logits[1]) == {0, 1, 2, 5}
    assert logits[0, 1].item() == 5.0  # survivors keep their values


def test_top_k_larger_than_vocab_keeps_everything():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    lp.apply_top_k(logits, torch.tensor([10]))
    assert kept(logits[0]) == {0, 1, 2}


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [(0.3, {3}), (0.65, {3, 1}), (0.75, {3, 1, 0}), (0.95, {3, 1, 0, 2}), (1.0, {0, 1, 2, 3})],
)
def test_top_p_keeps_smallest_set_reaching_mass(top_p, expected):
    # probabilities 0.2, 0.3, 0.1, 0.4 in shuffled positions, so the un-sort is exercised
    logits = torch.tensor([log_probs(0.2, 0.3, 0.1, 0.4)])
    lp.apply_top_p(logits, torch.tensor([top_p]))
    assert kept(logits[0]) == expected


def test_top_p_per_row_values():
    logits = torch.tensor([log_probs(0.4, 0.3, 0.2, 0.1), log_probs(0.1, 0.2, 0.3, 0.4)])
    lp.apply_top_p(logits, torch.tensor([0.5, 0.85]))
    assert kept(logits[0]) == {0, 1}
    assert kept(logits[1]) == {1, 2, 3}


@pytest.mark.parametrize(("min_p", "expected"), [(0.4, {0, 1}), (0.25, {0, 1, 2}), (0.1, {0, 1, 2, 3}),
                                                 (1.0, {0})])
def test_min_p_threshold_relative_to_top_token(min_p, expected):
    logits = torch.tensor([log_probs(0.5, 0.25, 0.15, 0.1)]) * 1.0
    lp.apply_min_p(logits, torch.tensor([min_p]))
    assert kept(logits[0]) == expected


def test_sampler_applies_top_k_before_top_p(make_sampler):
    # top_k=2 renormalizes 0.4/0.3 to 0.571/0.429, so top_p=0.5 keeps only token 0; top_p alone
    # (without top_k first) would keep tokens 0 and 1.
    logits = torch.tensor([log_probs(0.4, 0.3, 0.2, 0.1)] * 64)
    out = make_sampler(seed=1)(logits, [state(top_k=2, top_p=0.5) for _ in range(64)])
    assert set(out.sampled_token_ids) == {0}
    out = make_sampler(seed=1)(logits, [state(top_p=0.5) for _ in range(64)])
    assert set(out.sampled_token_ids) == {0, 1}


def test_sampler_masks_restrict_sampled_tokens(make_sampler):
    torch.manual_seed(0)
    base = torch.randn(1, 50)
    top3 = set(base[0].topk(3).indices.tolist())
    logits = base.repeat(300, 1)
    out = make_sampler(seed=3)(logits, [state(top_k=3, temperature=5.0) for _ in range(300)])
    assert set(out.sampled_token_ids) == top3  # all three show up at a high temperature, nothing else


# -- penalties, bias, min_tokens ----------------------------------------------------------------


def test_repetition_penalty_hf_semantics():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5], [2.0, -2.0, 1.0, -1.0, 0.5]])
    # row 1 only: prompt token 0 and output token 1 (twice) are penalized once each
    lp.apply_repetition_penalty(logits, [1], [[0, 1, 1]], [2.0])
    assert logits[0].tolist() == [2.0, -2.0, 1.0, -1.0, 0.5]
    assert logits[1].tolist() == [1.0, -4.0, 1.0, -1.0, 0.5]


def test_presence_and_frequency_penalties_openai_semantics():
    logits = torch.zeros(2, 5)
    lp.apply_presence_frequency_penalties(logits, [0], [[1, 1, 2]], [0.5], [0.25])
    assert logits[0].tolist() == [0.0, -1.0, -0.75, 0.0, 0.0]
    assert logits[1].tolist() == [0.0] * 5


def test_sampler_penalties_use_prompt_only_for_repetition():
    logits = torch.tensor([[3.0, 2.9, 1.0], [3.0, 2.9, 1.0]])
    states = [
        state(prompt=[0], output=[], temperature=0.0, repetition_penalty=1.1),  # 3.0/1.1 < 2.9
        state(prompt=[0], output=[], temperature=0.0, presence_penalty=2.0),  # prompt not counted
    ]
    assert Sampler()(logits, states).sampled_token_ids == [1, 0]


def test_logit_bias_then_repetition_penalty_order():
    logits = torch.tensor([[2.0, 0.0]])
    # bias first: (0 + 3) / 2 = 1.5 < 2 -> token 0; penalty first would give 0 / 2 + 3 = 3 -> token 1
    s = state(prompt=[1], temperature=0.0, logit_bias={1: 3.0, 99: 50.0}, repetition_penalty=2.0)
    assert Sampler()(logits, [s]).sampled_token_ids == [0]
    assert Sampler()(logits, [state(temperature=0.0, logit_bias={1: 3.0})]).sampled_token_ids == [1]


def test_min_tokens_blocks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0]])  # EOS=2 is the favourite, stop id 3 the runner-up
    blocked = state(output=[1], eos=2, temperature=0.0, min_tokens=2, stop_token_ids=[3])
    assert Sampler()(logits, [blocked]).sampled_token_ids == [1]
    reached = state(output=[1, 1], eos=2, temperature=0.0, min_tokens=2, stop_token_ids=[3])
    assert Sampler()(logits, [reached]).sampled_token_ids == [2]
    ignore = state(output=[1], eos=2, temperature=0.0, min_tokens=2, ignore_eos=True)
    assert Sampler()(logits, [ignore]).sampled_token_ids == [2]
    # Random rows too: EOS never appears while blocked
    many = [state(output=[], eos=2, min_tokens=1, temperature=1.0) for _ in range(200)]
    assert 2 not in Sampler()(logits.repeat(200, 1), many).sampled_token_ids


def test_greedy_takes_first_max_and_input_is_untouched(make_sampler):
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    before = logits.clone()
    out = make_sampler()(logits, [state(temperature=0.0, repetition_penalty=1.5, prompt=[3])])
    assert out.sampled_token_ids == [1]
    assert torch.equal(logits, before)


def test_plain_greedy_rows_take_the_argmax_without_a_working_copy(monkeypatch):
    """Greedy rows with no processor (no bias, penalty or min_tokens left) skip the float32 copy the processors
    write into; a row that has one (here a logit bias in the same batch) keeps the whole path."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, 2.0, 1.0, 5.0]])
    copies = []
    original = sampler_module.SamplingArrays.from_params

    def counting(params):
        copies.append(len(params))
        return original(params)

    monkeypatch.setattr(sampler_module.SamplingArrays, "from_params", staticmethod(counting))
    plain = [state(temperature=0.0), state(temperature=0.0, min_tokens=1, output=[5], eos=3)]
    assert Sampler()(logits, plain).sampled_token_ids == [1, 3] and copies == []
    biased = [state(temperature=0.0), state(temperature=0.0, logit_bias={0: 10.0})]
    assert Sampler()(logits, biased).sampled_token_ids == [1, 0] and copies == [2]
    blocked = [state(temperature=0.0), state(temperature=0.0, min_tokens=2, output=[5], eos=3)]
    assert Sampler()(logits, blocked).sampled_token_ids == [1, 1]


# -- seeds ----------------------------------------------------------------------------------------


def test_mix_seed_is_63_bit_and_deterministic():
    values = {mix_seed(s, t) for s in (-5, 0, 1, 2**63 - 1) for t in range(4)}
    assert len(values) == 16
    assert all(0 <= v < 2**63 for v in values)
    assert mix_seed(7, 3) == mix_seed(7, 3)


def test_seeded_rows_reproduce_across_batches_and_positions(make_sampler):
    vocab = 1000
    target = torch.zeros(1, vocab)  # uniform: any token is possible, so agreement is not luck
    seeds = list(range(20))
    alone = [make_sampler(seed=0)(target, [state(seed=s, output=[5] * 3)]).sampled_token_ids[0] for s in seeds]
    assert len(set(alone)) > 10
    torch.manual_seed(1)
    for s, expected in zip(seeds, alone):
        neighbours = torch.randn(3, vocab)
        logits = torch.cat([neighbours[:2], target, neighbours[2:]])
        states = [state(), state(seed=s + 100, output=[1]), state(seed=s, output=[9] * 3),
                  state(temperature=0.0)]
        # a different engine seed too: a recomputed request on a fresh engine draws the same
        out = make_sampler(seed=99)(logits, states)
        assert out.sampled_token_ids[2] == expected


def test_same_seed_different_step_draws_differ(make_sampler):
    logits = torch.zeros(20, 1000)
    states = [state(seed=1234, output=[0] * step) for step in range(20)]
    assert len(set(make_sampler()(logits, states).sampled_token_ids)) > 15


def test_unseeded_rows_follow_engine_seed(make_sampler):
    logits = torch.zeros(8, 1000)
    states = [state() for _ in range(8)]
    first, again, other = (make_sampler(seed=s)(logits, states).sampled_token_ids for s in (5, 5, 6))
    assert first == again
    assert first != other


def chi_square(tokens: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).float()
    expected = probs * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.0])
def test_temperature_sampling_follows_softmax(temperature, make_sampler):
    base = torch.tensor([0.0, 1.0, 2.0, 0.5, -1.0])
    probs = torch.softmax(base / temperature, dim=0)
    n = 4000
    out = make_sampler(seed=11)(base.repeat(n, 1), [state(temperature=temperature) for _ in range(n)])
    # df = 4; the 99.99th percentile is about 23, a loose but real bound
    assert chi_square(out.sampled_token_ids, probs) < 25.0
    # the wrong temperature is clearly rejected
    wrong = torch.softmax(base / (temperature * 2), dim=0)
    assert chi_square(out.sampled_token_ids, wrong) > 50.0


def test_seeded_sampling_follows_softmax(make_sampler):
    base = torch.tensor([0.0, 1.0, 2.0, 0.5])
    probs = torch.softmax(base, dim=0)
    n = 2000
    out = make_sampler()(base.repeat(n, 1), [state(seed=s) for s in range(n)])
    assert chi_square(out.sampled_token_ids, probs) < 22.0  # df = 3


# -- logprobs -------------------------------------------------------------------------------------


def test_logprobs_from_raw_logits_with_ranks():
    raw = [1.0, 3.0, 2.0, 0.0]
    logits = torch.tensor([raw, raw, raw])
    norm = math.log(sum(math.exp(x) for x in raw))
    expected = [x - norm for x in raw]
    states = [
        state(temperature=0.0, logit_bias={3: 100.0}, logprobs=2),  # forced to the worst token
        state(temperature=0.0, logprobs=0),
        state(temperature=0.0),
    ]
    out = Sampler()(logits, states)
    assert out.sampled_token_ids == [3, 1, 1]
    first = out.logprobs[0]
    assert list(first) == [3, 1, 2]  # sampled token first, then top-2
    assert first[3].rank == 4 and first[1].rank == 1 and first[2].rank == 2
    for token, entry in first.items():
        assert entry.logprob == pytest.approx(expected[token], abs=1e-6)
    assert list(out.logprobs[1]) == [1] and out.logprobs[1][1].rank == 1
    assert out.logprobs[2] is None


def test_sampled_ids_and_logprobs_reach_the_host_in_one_copy(monkeypatch):
    """On a GPU every device-to-host copy waits for the step: the sampled ids and every row's logprobs
    (rows asking for different top-N, one not asking) come back together."""
    logits = torch.tensor([[0.5, 2.0, 1.0, -1.0, 0.0], [3.0, 1.0, 2.0, 0.0, 4.0], [1.0, 1.0, 0.0, 0.0, 2.0]])
    states = [state(temperature=0.0, logprobs=3), state(temperature=0.0), state(temperature=0.0, logprobs=1)]
    copies = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: copies.append(self.shape) or real_tolist(self))
    out = Sampler()(logits, states)
    assert len(copies) == 1
    assert out.sampled_token_ids == [1, 4, 4] and all(type(t) is int for t in out.sampled_token_ids)
    reference = torch.log_softmax(logits, dim=1)
    assert list(out.logprobs[0]) == [1, 2, 0] and [e.rank for e in out.logprobs[0].values()] == [1, 2, 3]
    assert out.logprobs[1] is None
    assert list(out.logprobs[2]) == [4] and out.logprobs[2][4].rank == 1
    for row in (0, 2):
        for token, entry in out.logprobs[row].items():
            assert entry.logprob == reference[row, token].item()  # float32 values, exactly


def test_compute_prompt_logprobs(monkeypatch):
    monkeypatch.setattr(sampler_module, "_PROMPT_LOGPROBS_CHUNK", 2)  # exercise several chunks
    torch.manual_seed(0)
    logits = torch.randn(5, 12)
    targets = [3, 0, 11, 7, 7]
    result = compute_prompt_logprobs(logits, targets, 3)
    reference = torch.log_softmax(logits, dim=1)
    assert len(result) == 5
    for t, entry in enumerate(result):
        row = reference[t]
        chosen = row[targets[t]].item()
        assert next(iter(entry)) == targets[t]
        assert entry[targets[t]].logprob == pytest.approx(chosen, abs=1e-6)
        assert entry[targets[t]].rank == 1 + int((row > chosen).sum())
        top = row.topk(3).indices.tolist()
        assert set(entry) == set(top) | {targets[t]}
        for rank, token in enumerate(top, start=1):
            if token != targets[t]:
                assert entry[token].rank == rank
    with pytest.raises(ValueError):
        compute_prompt_logprobs(logits, targets[:4], 1)


def test_top_p_candidate_shortcut_matches_full_sort(monkeypatch):
    torch.manual_seed(2)
    logits = torch.randn(16, 40) * torch.linspace(0.2, 4.0, 16).unsqueeze(1)  # flat to peaked
    top_p = torch.linspace(0.3, 0.97, 16)
    monkeypatch.setattr(lp, "TOP_P_CANDIDATES", 40)
    full = logits.clone()
    lp.apply_top_p(full, top_p)
    monkeypatch.setattr(lp, "TOP_P_CANDIDATES", 3)  # most rows miss top_p within 3 and fall back
    short = logits.clone()
    lp.apply_top_p(short, top_p)
    assert torch.equal(torch.isfinite(full), torch.isfinite(short))
    sizes = torch.isfinite(full).sum(1)
    assert (sizes <= 3).any() and (sizes > 3).any()  # both the shortcut and the fallback ran
