"""The sampler's C++ kernels: `argmax_rows` against torch.argmax(x, dim=1) (the first maximum of each row, ties,
NaNs, infinities, signed zeros, row lengths off the vector width, rows of a wider tensor) and `uniform_rows` (each
row from its seed alone, inside (0, 1), uniform), on every SIMD build; and greedy picks equal with and without
them. (The sampled distributions with the kernels: tests/sample/test_sampler.py.)"""
from __future__ import annotations

import pytest
import torch

from tokenmill.sample.sampler import Sampler, SamplingRequestState
from tokenmill.sampling_params import SamplingParams


def rows_to_check() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    cases = [torch.randn(rows, n, generator=generator) for rows, n in [(1, 1), (3, 7), (5, 8), (16, 1000), (2, 49153)]]
    tied = torch.randint(0, 3, (6, 77), generator=generator).float()  # many equal maxima: the first wins
    special = torch.randn(8, 40, generator=generator)
    special[0, 5] = special[0, 30] = float("nan")  # the first NaN, as torch's argmax picks it
    special[1, 39] = float("nan")  # in the scalar tail
    special[2] = float("-inf")
    special[3, 17] = float("inf")
    special[3, 33] = float("inf")
    special[4] = 0.0
    special[4, 3] = -0.0  # -0.0 == 0.0: a tie, not a smaller value
    special[4, 10:20] = -1.0
    special[5] = -0.0
    special[6, 9] = float("nan")
    special[6, 2] = float("inf")
    wide = torch.randn(4, 100, generator=generator)[:, 3:90]  # rows of a wider tensor (stride 100)
    return [*cases, tied, special, wide]


@pytest.mark.parametrize("case", range(len(rows_to_check())))
def test_argmax_rows_matches_torch(variant, case):
    x = rows_to_check()[case]
    assert torch.equal(variant[1].argmax_rows(x), x.argmax(dim=1))


def test_argmax_rows_refuses_what_it_does_not_read(kernels):
    with pytest.raises(RuntimeError, match="float32"):
        kernels.argmax_rows(torch.zeros(2, 4, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="float32"):
        kernels.argmax_rows(torch.zeros(4, 2).t())  # columns, not rows, contiguous


def test_uniform_rows_come_from_their_seeds_alone(variant):
    kernels = variant[1]
    seeds = torch.tensor([7, 2**62 + 5, -3, 7], dtype=torch.int64)
    u = kernels.uniform_rows(seeds, 100_003)
    assert u.shape == (4, 100_003) and u.dtype == torch.float32
    assert torch.equal(u[0], u[3]) and not torch.equal(u[0], u[1])
    assert torch.equal(kernels.uniform_rows(seeds[1:2], 100_003)[0], u[1])  # whatever the rows beside it
    assert torch.equal(kernels.uniform_rows(seeds[:1], 10)[0], u[0, :10])  # and whatever the row's length
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    counts = torch.histc(u[1], bins=10, min=0.0, max=1.0)
    expected = u.shape[1] / 10
    assert float(((counts - expected) ** 2 / expected).sum()) < 33.7  # chi-square, df = 9: p = 1e-4
    lag = u[2, 1:] - 0.5, u[2, :-1] - 0.5  # neighbouring values uncorrelated
    assert abs(float((lag[0] * lag[1]).mean()) / (1 / 12)) < 0.02
    if variant[0] != "native":
        native = cpu_kernels_native()
        assert torch.equal(native.uniform_rows(seeds, 1000), kernels.uniform_rows(seeds, 1000))  # same integers


def cpu_kernels_native():
    from tokenmill.model.layers import cpu_kernels

    return cpu_kernels.load()


def test_greedy_picks_are_the_same_with_the_kernels(kernels):
    """Greedy rows alone and beside sampled ones: identical tokens either way."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(12, 3000, generator=generator) * 4
    params = [SamplingParams(temperature=0.0) if i % 3 == 0 else SamplingParams(temperature=0.8, top_k=50, seed=i)
              for i in range(12)]
    for rows in (slice(0, 12, 3), slice(0, 4)):
        chosen = [i for i in list(range(12))[rows] if params[i].temperature == 0.0]
        outputs = []
        for sampler in (Sampler(0), Sampler(0, kernels)):
            states = [SamplingRequestState(params[i], [1, 2, 3], [], None) for i in chosen]
            outputs.append(sampler(logits[chosen].clone(), states).sampled_token_ids)
        assert outputs[0] == outputs[1]
