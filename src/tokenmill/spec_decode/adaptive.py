"""How many drafts each request verifies: fewer while its recent drafts are refused.

The draft at position i is kept only when the drafts before it were, so with a per-draft acceptance a it
is kept with a chance of about a^i, while its verify row costs a row of compute whether it is kept or not.
A request proposes drafts while that chance stays at least MIN_KEEP_CHANCE, up to the configured
num_speculative_tokens. Its acceptance is a moving average of the share of its drafts kept, starting at
PRIOR; a request that proposes nothing drifts back towards PRIOR, so it tries again later (the text it
copies may start after a stretch of new text).
"""
from __future__ import annotations

# Running requests above which a step proposes no drafts (unless disable_by_batch_size says): on a 2-core
# AVX-512 CPU at the default int8 numerics, drafts broke even at 8 streams and cost 10-16% at 16 and 35-40%
# at 64 (docs/benchmarks.md, "Adaptive draft length"), as the step turns from reading weights to computing.
MAX_BATCH = 8
# The same for drafts from a model, which cost draft forwards too: at 4 streams qspec and draft_model still ran
# 1.01-1.13x, at 8 streams of JSON-schema extraction qspec cost 35% (docs/benchmarks.md, "Drafts from a model").
MAX_BATCH_DRAFT_MODEL = 4
PRIOR = 0.6
MIN_KEEP_CHANCE = 0.3
SMOOTHING = 0.5  # weight of the latest verify in the moving average
# per step without drafts, the share of the way back to PRIOR (a refused request retries about every 10 steps)
RECOVERY = 0.05


def step_draft_limit(max_drafts: int, num_running: int, batch_limit: int | None) -> int:
    """The step's one decision: how many drafts a request may propose (0 while the batch is too large for
    a verify row to pay)."""
    return 0 if batch_limit is not None and num_running > batch_limit else max_drafts


def draft_length(max_drafts: int, acceptance: float) -> int:
    """How many drafts to propose: the positions whose chance of being kept is at least MIN_KEEP_CHANCE."""
    length, chance = 0, 1.0
    while length < max_drafts:
        chance *= acceptance
        if chance < MIN_KEEP_CHANCE:
            break
        length += 1
    return length


def after_verify(acceptance: float, num_drafts: int, num_kept: int) -> float:
    """The acceptance after a verify of num_drafts drafts kept num_kept of them."""
    if num_drafts <= 0:
        return acceptance
    return (1.0 - SMOOTHING) * acceptance + SMOOTHING * (num_kept / num_drafts)


def after_idle_step(acceptance: float) -> float:
    """A step in which the request proposed nothing: its acceptance moves back towards PRIOR."""
    return acceptance + RECOVERY * (PRIOR - acceptance)
