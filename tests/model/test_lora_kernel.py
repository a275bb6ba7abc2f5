"""The C++ `lora_add` kernel against the same LoRA deltas computed row by row in torch: rows of several slots and
of none, fused parts, column counts that are not a multiple of 8 or 16, input sizes that are not a multiple of 8
and groups of fewer than four rows, on this CPU's widest SIMD and on the narrower builds (AVX2, portable C++)."""
from __future__ import annotations

import pytest
import torch


def reference(y, x, slots, a, bt, offsets, rank):
    out = y.clone()
    parts = len(offsets) - 1
    for t in range(x.shape[0]):
        s = int(slots[t])
        if s < 0:
            continue
        xa = a[s * parts * rank:(s + 1) * parts * rank] @ x[t]
        for p in range(parts):
            first, end = offsets[p], offsets[p + 1]
            out[t, first:end] += xa[p * rank:(p + 1) * rank] @ bt[s * rank:(s + 1) * rank, first:end]
    return out


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts, rows, in_features", [([40, 24, 24], 13, 72), ([100], 1, 72), ([37, 37], 64, 75),
                                                     ([3, 64], 5, 5)])
def test_lora_add_matches_torch_row_by_row(variant, parts, rows, in_features, weights):
    """bfloat16 weights (kept so where the projections round their activations) are read as their float32
    values: the same deltas as float32 weights holding those values."""
    torch.manual_seed(rows)
    num_slots, rank = 3, 8
    offsets = [sum(parts[:i]) for i in range(len(parts) + 1)]
    a = torch.randn(num_slots * len(parts) * rank, in_features).to(weights)
    bt = torch.randn(num_slots * rank, offsets[-1]).to(weights)
    x = torch.randn(rows, in_features)
    y = torch.randn(rows, offsets[-1])
    slots = torch.randint(-1, num_slots, (rows,))
    expected = reference(y, x, slots, a.float(), bt.float(), offsets, rank)
    variant[1].lora_add(y, x, slots, a, bt, offsets, rank)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4)
    untouched = slots < 0
    assert torch.equal(y[untouched], expected[untouched])  # the base model's rows exactly as they were
