"""The sampler: one logits row per request that samples this step -> token ids (+ logprobs).

Pipeline per step (each stage only touches the rows that asked for it):

    raw logits ─► logprobs: log_softmax of the *raw* logits (vLLM's default)
        └─ copy ─► logit_bias ─► min_tokens mask ─► repetition penalty ─► presence/frequency
                   ─► grammar mask (structured outputs) ────────────────────────────────────┐
    greedy rows:  argmax (first max, as HF generate)  ◄──────────────────────────────────────┤
    other rows:   / temperature ─► top_k ─► top_p ─► min_p ─► exponential race  ◄────────────┘

Seeded requests sample with a generator derived from (seed, number of tokens generated so far),
so a seeded request draws the same tokens whatever its batch neighbours, its row, or whether it
was preempted and recomputed.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from tokenmill.outputs import Logprob
from tokenmill.sample import logits_processors as lp
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.backend import apply_token_bitmask

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1
# Keeps a seeded row's draft-acceptance draws apart from the stream its tokens are drawn with.
_ACCEPT_SALT = 0x5EC0_D1A7
_DRAFT_SALT = 0x6472616674  # "draft": a draft model's draws
# Rows of prompt logprobs handled at once: a [chunk, vocab] float32 buffer instead of [T, vocab].
_PROMPT_LOGPROBS_CHUNK = 256


@dataclass(slots=True)
class SamplingRequestState:
    """What the sampler needs to know about one row; built by the model runner each step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far, before this step
    eos_token_id: int | None  # the model's EOS; ignored when params.ignore_eos
    # Structured outputs: this row's row in the step's grammar bitmask (computed by the engine core).
    grammar_row: Optional[int] = None
    # Prompt and generated tokens in one sequence, where the caller holds them so (the repetition penalty
    # reads them); None: the two lists above, joined when needed.
    known_token_ids: Optional[Sequence[int]] = None


@dataclass(slots=True)
class SamplingArrays:
    """The rows' temperature and truncation parameters as host arrays, one entry per row: gathered from the
    runner's persistent input batch (written once per request), or built from the rows' params."""

    temperature: np.ndarray  # float32
    top_k: np.ndarray  # int64; 0: no top-k
    top_p: np.ndarray  # float32
    min_p: np.ndarray  # float32

    @classmethod
    def empty(cls, rows: int) -> SamplingArrays:
        """Rows of neutral parameters (temperature 1, no truncation), to be written."""
        return cls(np.ones(rows, dtype=np.float32), np.zeros(rows, dtype=np.int64), np.ones(rows, dtype=np.float32),
                   np.zeros(rows, dtype=np.float32))

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams]) -> SamplingArrays:
        arrays = cls.empty(len(params))
        for row, row_params in enumerate(params):
            arrays.write(row, row_params)
        return arrays

    def write(self, row: int, params: SamplingParams) -> None:
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k or 0
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p

    def select(self, rows: Sequence[int]) -> SamplingArrays:
        index = np.asarray(rows, dtype=np.int64)
        return SamplingArrays(self.temperature[index], self.top_k[index], self.top_p[index], self.min_p[index])

    def grown(self, rows: int) -> SamplingArrays:
        """A copy with `rows` rows, the new ones neutral."""
        grown = SamplingArrays.empty(rows)
        for name in ("temperature", "top_k", "top_p", "min_p"):
            getattr(grown, name)[:len(self.temperature)] = getattr(self, name)
        return grown


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: list[int]  # one per row
    # Per row: None unless params.logprobs is set; else {sampled: Logprob} plus the top-N tokens.
    logprobs: list[dict[int, Logprob] | None]


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed from a request seed and its decode step.

    Two splitmix64 rounds so nearby (seed, step) pairs give unrelated streams; masking to 63 bits
    keeps the value inside what every torch.Generator.manual_seed accepts.
    """
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64)) & _MASK63


def logprob_table(logprobs: torch.Tensor, token_ids: torch.Tensor, max_n: int) -> torch.Tensor:
    """Per row, on the logits' device and in float64 (exact for float32 values and for ids and ranks):
    [token id, its logprob, its rank, top max_n logprobs, their ids]. One table per step, so its rows
    reach the host in the same copy as the sampled ids.

    rank = 1 + number of tokens with a strictly greater logprob.
    """
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=1, keepdim=True).add_(1)
    columns = [token_ids.unsqueeze(1).double(), chosen.double(), ranks.double()]
    if max_n > 0:
        top = logprobs.topk(min(max_n, logprobs.shape[1]), dim=1)
        columns += [top.values.double(), top.indices.double()]
    return torch.cat(columns, dim=1)


def logprob_dicts(table: Sequence[Sequence[float]], num_logprobs: Sequence[int]) -> list[dict[int, Logprob]]:
    """logprob_table's rows (on the host) -> per row {token: Logprob(lp, rank)} followed by the top
    num_logprobs[row] tokens (ranks 1..N); the chosen token comes first and keeps its own rank if it is
    also in the top N."""
    result: list[dict[int, Logprob]] = []
    for row, n in zip(table, num_logprobs):
        width = (len(row) - 3) // 2
        entry = {int(row[0]): Logprob(row[1], int(row[2]))}
        for rank in range(1, min(n, width) + 1):
            entry.setdefault(int(row[2 + width + rank]), Logprob(row[2 + rank], rank))
        result.append(entry)
    return result


def build_logprob_dicts(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: Sequence[int]
) -> list[dict[int, Logprob]]:
    """Per row: {token_ids[row]: Logprob(lp, rank)} followed by the top num_logprobs[row] tokens."""
    table = logprob_table(logprobs, token_ids, max(num_logprobs, default=0))
    return logprob_dicts(table.tolist(), num_logprobs)


def compute_prompt_logprobs(
    logits: torch.Tensor, next_token_ids: Sequence[int], num_logprobs: int
) -> list[dict[int, Logprob]]:
    """logits [T, V] at prompt positions; entry t scores next_token_ids[t] (+ top-num_logprobs)."""
    if logits.shape[0] != len(next_token_ids):
        raise ValueError(f"{logits.shape[0]} logits rows for {len(next_token_ids)} next tokens")
    targets = torch.as_tensor(list(next_token_ids), dtype=torch.int64, device=logits.device)
    result: list[dict[int, Logprob]] = []
    for start in range(0, logits.shape[0], _PROMPT_LOGPROBS_CHUNK):
        end = start + _PROMPT_LOGPROBS_CHUNK
        chunk = torch.log_softmax(logits[start:end].float(), dim=1)
        result.extend(build_logprob_dicts(chunk, targets[start:end], [num_logprobs] * chunk.shape[0]))
    return result


def _apply_to_rows(
    logits: torch.Tensor, rows: list[int], fn: Callable[[torch.Tensor, torch.Tensor], None],
    values: torch.Tensor,
) -> None:
    """Run an in-place row transform on a subset of rows (or on all of them without a copy)."""
    if not rows:
        return
    if len(rows) == logits.shape[0]:
        fn(logits, values)
        return
    index = torch.tensor(rows, device=logits.device)
    sub = logits.index_select(0, index)
    fn(sub, values)
    logits.index_copy_(0, index, sub)


class Sampler:
    """Samples one token per row; stateless apart from the generator used by unseeded requests."""

    def __init__(self, seed: int = 0, kernels: Any = None) -> None:
        """kernels: tokenmill's C++ CPU kernels where the runner has them, for each row's argmax and the
        exponential race's uniforms on float32 CPU rows (several times faster than torch's reduction and
        generators there; docs/benchmarks.md, "Sampling on CPU")."""
        self.seed = seed
        self._kernels = kernels
        self._generators: dict[torch.device, torch.Generator] = {}
        # Reseeded for every seeded row; kept apart so seeded rows never disturb the shared stream.
        self._seeded_generators: dict[torch.device, torch.Generator] = {}

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's index of its first maximum, as torch.argmax(x, dim=1)."""
        if (self._kernels is not None and x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
                and x.stride(1) == 1 and x.shape[1] > 0):
            return self._kernels.argmax_rows(x)
        return x.argmax(dim=1)

    def __call__(self, logits: torch.Tensor, states: list[SamplingRequestState],
                 grammar_bitmask: Optional[torch.Tensor] = None,
                 arrays: Optional[SamplingArrays] = None) -> SamplerOutput:
        """grammar_bitmask: int32 [rows, ceil(vocab / 32)]; a state's grammar_row picks its row.
        arrays: the rows' sampling parameters (built from the states' params when not given)."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"expected [{len(states)}, vocab] logits, got {tuple(logits.shape)}")
        if grammar_bitmask is None and all(s.params.greedy and not _has_processors(s) for s in states):
            # Plain greedy rows (benchmarks, evals): the argmax of the logits as they are, without the float32
            # working copy the processors write into (a 64-row step's copy of SmolLM2's vocabulary is 12 MiB).
            return self._to_host(logits, self.argmax(logits), states)
        if arrays is None:
            arrays = SamplingArrays.from_params([s.params for s in states])
        work = logits.to(torch.float32, copy=True)
        self._apply_processors(work, states)
        if grammar_bitmask is not None:
            self._apply_grammars(work, logits, states, grammar_bitmask)
        random_rows = [i for i, s in enumerate(states) if not s.params.greedy]
        if len(random_rows) == len(states):
            sampled = self._sample(work, states, arrays)
        else:
            sampled = self.argmax(work)  # greedy answer for every row; random rows overwritten
        if 0 < len(random_rows) < len(states):
            index = torch.tensor(random_rows, device=work.device)
            picked = self._sample(work.index_select(0, index), [states[i] for i in random_rows],
                                  arrays.select(random_rows))
            sampled.index_copy_(0, index, picked)
        return self._to_host(logits, sampled, states)

    # -- stages ------------------------------------------------------------------------------

    def _apply_processors(self, logits: torch.Tensor, states: list[SamplingRequestState]) -> None:
        lp.apply_logit_bias(logits, [s.params.logit_bias for s in states])
        lp.mask_tokens(logits, [_min_tokens_blocked(s) for s in states])
        rep_rows = [i for i, s in enumerate(states) if s.params.repetition_penalty != 1.0]
        lp.apply_repetition_penalty(
            logits, rep_rows,
            [_known_tokens(states[i]) for i in rep_rows],
            [states[i].params.repetition_penalty for i in rep_rows],
        )
        pf_rows = [i for i, s in enumerate(states)
                   if s.params.presence_penalty != 0.0 or s.params.frequency_penalty != 0.0]
        lp.apply_presence_frequency_penalties(
            logits, pf_rows,
            [states[i].output_token_ids for i in pf_rows],
            [states[i].params.presence_penalty for i in pf_rows],
            [states[i].params.frequency_penalty for i in pf_rows],
        )

    def _apply_grammars(self, logits: torch.Tensor, raw_logits: torch.Tensor,
                        states: list[SamplingRequestState], grammar_bitmask: torch.Tensor) -> None:
        """Mask each constrained row to the tokens its grammar allows next."""
        rows = [i for i, s in enumerate(states) if s.grammar_row is not None]
        if not rows:
            return
        bitmask = grammar_bitmask[[states[i].grammar_row for i in rows]]
        index = torch.tensor(rows, device=logits.device)
        masked = logits.index_select(0, index)
        apply_token_bitmask(masked, bitmask)
        # When the other processors left none of the grammar's tokens (min_tokens blocking the EOS
        # that ends the grammar), the grammar wins: sample from its tokens on the raw logits.
        dead = torch.isneginf(masked).all(dim=1).nonzero().flatten()
        if dead.numel():
            fallback = raw_logits.index_select(0, index[dead]).float()
            apply_token_bitmask(fallback, bitmask[dead.cpu()])
            masked.index_copy_(0, dead, fallback)
        logits.index_copy_(0, index, masked)

    def _sample(self, logits: torch.Tensor, states: list[SamplingRequestState],
                arrays: SamplingArrays) -> torch.Tensor:
        """Temperature, truncation masks, then one exponential-race draw per row (overwrites logits)."""
        device, vocab = logits.device, logits.shape[1]
        self._truncate(logits, arrays)
        # Unnormalized probabilities are enough: the argmax below ignores a per-row scale.
        probs = logits.sub_(logits.amax(dim=1, keepdim=True)).exp_()  # amax: max(dim) would track indices too
        # argmax(p_i / E_i) with E_i ~ Exp(1) picks i with probability p_i, and lets each row use
        # its own noise stream without a per-row multinomial call.
        return self.argmax(probs.div_(self._exponential_noise(states, vocab, device)))

    @staticmethod
    def _truncate(logits: torch.Tensor, arrays: SamplingArrays) -> None:
        """Temperature, then the top-k, top-p and min-p masks (in place)."""
        device, vocab = logits.device, logits.shape[1]
        logits.div_(torch.from_numpy(arrays.temperature).to(device).unsqueeze(1))
        k_rows = np.flatnonzero((arrays.top_k > 0) & (arrays.top_k < vocab)).tolist()
        _apply_to_rows(logits, k_rows, lp.apply_top_k, torch.from_numpy(arrays.top_k[k_rows]).to(device))
        p_rows = np.flatnonzero(arrays.top_p < 1.0).tolist()
        _apply_to_rows(logits, p_rows, lp.apply_top_p, torch.from_numpy(arrays.top_p[p_rows]).to(device))
        m_rows = np.flatnonzero(arrays.min_p > 0.0).tolist()
        _apply_to_rows(logits, m_rows, lp.apply_min_p, torch.from_numpy(arrays.min_p[m_rows]).to(device))

    def _exponential_noise(
        self, states: list[SamplingRequestState], vocab: int, device: torch.device, salt: int = 0
    ) -> torch.Tensor:
        """Exp(1) draws as -log(U): several times faster than Tensor.exponential_ on CPU. salt: a seeded row's
        stream apart from its token's (a draft model's draws). A seeded row's U come from its seed and position
        alone; unseeded rows share the engine's generator. On the CPU with tokenmill's kernels each row's U come
        from a counter-based generator keyed by a 64-bit seed (unseeded rows: one drawn from the engine's
        generator), filled in parallel; elsewhere from torch generators."""
        seeded = [(i, mix_seed(s.params.seed ^ salt, len(s.output_token_ids)))
                  for i, s in enumerate(states) if s.params.seed is not None]
        unseeded = [i for i, s in enumerate(states) if s.params.seed is None]
        if self._kernels is not None and device.type == "cpu":
            seeds = torch.empty(len(states), dtype=torch.int64)
            if unseeded:
                seeds[unseeded] = torch.randint(0, 2**62, (len(unseeded),), generator=self._generator(device))
            for i, seed in seeded:
                seeds[i] = seed
            return self._kernels.uniform_rows(seeds, vocab).log_().neg_()  # U is never 0 or 1 there
        noise = torch.empty((len(states), vocab), dtype=torch.float32, device=device)
        if len(unseeded) == len(states):
            noise.uniform_(generator=self._generator(device))
        elif unseeded:
            shared = torch.empty((len(unseeded), vocab), dtype=torch.float32, device=device)
            shared.uniform_(generator=self._generator(device))
            noise.index_copy_(0, torch.tensor(unseeded, device=device), shared)
        for i, seed in seeded:
            gen = self._seeded_generator(device)
            gen.manual_seed(seed)
            noise[i].uniform_(generator=gen)
        # U = 0 gives +inf (that token just loses); a zero draw would turn 0/0 into NaN for masked
        # tokens, so the smallest normal float stands in for it.
        return noise.log_().neg_().clamp_min_(torch.finfo(torch.float32).tiny)

    # -- speculative decoding ---------------------------------------------------------------

    def verify_drafts(self, logits: torch.Tensor, states: list[SamplingRequestState],
                      drafts: Sequence[Sequence[int]], grammar_bitmask: Optional[torch.Tensor] = None,
                      draft_probs: Optional[torch.Tensor] = None) -> list[tuple[list[int], int]]:
        """Speculative sampling, which keeps the target's distribution exactly. p_i is the distribution the
        sampler would draw position i from (processors, temperature, top-k, top-p, min-p) and q_i the one
        draft i was drawn from: draft i is kept with probability min(1, p_i(d) / q_i(d)); at the first draft
        refused, the token is drawn from max(0, p_i - q_i), renormalized; when every draft is kept, from the
        position after the last. Without draft_probs the drafts were proposed deterministically (n-grams):
        q_i is a point mass, so a draft is kept with probability p_i(d) and the token at a refusal is drawn
        from p_i without it.
        draft_probs: [number of drafts, vocab], the rows of q in the drafts' order (a draft model's).

        logits and states: one row per position, each request's k + 1 positions in a run (the state of
        position i counts drafts[:i] among its output tokens, so penalties and min_tokens see them, and
        a seeded request's draws depend on its position; a grammar_row, the row of grammar_bitmask masking
        that position). Returns per request (kept drafts, next token).
        Greedy rows take the argmax of their processed logits, so they keep exactly the drafts the
        non-speculative sampler would have produced."""
        expected = sum(len(d) + 1 for d in drafts)
        if logits.dim() != 2 or logits.shape[0] != len(states) or len(states) != expected:
            raise ValueError(f"expected [{expected}, vocab] logits and states, "
                             f"got {tuple(logits.shape)}, {len(states)}")
        probs = self._probabilities(logits, states, grammar_bitmask)
        device = probs.device
        # The target's probability of each draft at its position, and one uniform draw per draft.
        draft_rows: list[int] = []
        draft_ids: list[int] = []
        start = 0
        for request_drafts in drafts:
            draft_rows.extend(range(start, start + len(request_drafts)))
            draft_ids.extend(request_drafts)
            start += len(request_drafts) + 1
        accept: list[bool] = []
        if draft_rows:
            ids = torch.tensor(draft_ids, device=device)
            p_draft = probs[torch.tensor(draft_rows, device=device), ids]
            if draft_probs is not None:
                if draft_probs.shape != (len(draft_rows), probs.shape[1]):
                    raise ValueError(f"expected [{len(draft_rows)}, {probs.shape[1]}] draft probabilities, "
                                     f"got {tuple(draft_probs.shape)}")
                q_draft = draft_probs.to(probs.dtype)[torch.arange(len(draft_ids), device=device), ids]
                p_draft = torch.clamp(p_draft / q_draft.clamp_min(torch.finfo(probs.dtype).tiny), max=1.0)
            uniforms = self._uniforms([states[row] for row in draft_rows], device)
            accept = (uniforms < p_draft).tolist()
        # Per request: how many drafts are kept, the row the next token is drawn from, and the draft it
        # may not be (the one refused there).
        kept_counts, final_rows, refused = [], [], []  # refused: (the draft's index among all, its token)
        start = at = 0
        for request_drafts in drafts:
            kept = 0
            while kept < len(request_drafts) and accept[at + kept]:
                kept += 1
            kept_counts.append(kept)
            final_rows.append(start + kept)
            refused.append((at + kept, request_drafts[kept]) if kept < len(request_drafts) else None)
            at += len(request_drafts)
            start += len(request_drafts) + 1
        final = probs.index_select(0, torch.tensor(final_rows, device=device))
        for row, refusal in enumerate(refused):
            if refusal is None:
                continue
            index, token = refusal
            if draft_probs is None:
                final[row, token] = 0.0
            else:
                residual = (final[row] - draft_probs[index].to(final.dtype)).clamp_min_(0.0)
                # p == q leaves nothing (a refusal then has probability 0): keep p itself for safety.
                if float(residual.sum()) > 0.0:
                    final[row] = residual
        final_states = [states[row] for row in final_rows]
        tokens = self.argmax(final.div_(self._exponential_noise(final_states, final.shape[1], device))).tolist()
        return [(list(d[:kept]), token) for d, kept, token in zip(drafts, kept_counts, tokens)]

    def sample_drafts(self, logits: torch.Tensor, states: list[SamplingRequestState]) -> tuple[list[int], torch.Tensor]:
        """A draft model's drafts, drawn from its distribution q as the sampler draws from the target's (the
        same processors, temperature, top-k, top-p, min-p; greedy rows: the argmax), and q's rows, for
        verify_drafts' draft_probs. A seeded request draws from a stream of its own seed and position, apart
        from its token's and its acceptance's, so it stays reproducible."""
        probs = self._probabilities(logits, states)
        noise = self._exponential_noise(states, probs.shape[1], probs.device, salt=_DRAFT_SALT)
        return self.argmax(probs / noise).tolist(), probs

    def token_logprobs(self, raw_logits: torch.Tensor, token_ids: Sequence[int],
                       states: list[SamplingRequestState]) -> list[dict[int, Logprob] | None]:
        """Per row, the logprobs entry __call__ gives a sampled token (its logprob and rank, and the top
        params.logprobs), for tokens already chosen: a verify's kept drafts and its token."""
        tokens = torch.tensor(list(token_ids), device=raw_logits.device)
        return self._to_host(raw_logits, tokens, states).logprobs

    def _probabilities(self, logits: torch.Tensor, states: list[SamplingRequestState],
                       grammar_bitmask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Each row's distribution as __call__ would draw it: a point mass at the argmax for greedy rows."""
        work = logits.to(torch.float32, copy=True)
        self._apply_processors(work, states)
        if grammar_bitmask is not None:
            self._apply_grammars(work, logits, states, grammar_bitmask)
        arrays = SamplingArrays.from_params([s.params for s in states])
        greedy = [i for i, s in enumerate(states) if s.params.greedy]
        if greedy:
            rows = torch.tensor(greedy, device=work.device)
            argmax = self.argmax(work.index_select(0, rows))
            arrays.temperature[greedy] = 1.0  # their scaled values are not used
        self._truncate(work, arrays)
        probs = torch.softmax(work, dim=1)
        if greedy:
            probs[rows] = 0.0
            probs[rows, argmax] = 1.0
        return probs

    def _uniforms(self, states: list[SamplingRequestState], device: torch.device) -> torch.Tensor:
        """One U(0, 1) draw per row for a draft's acceptance: the shared stream for unseeded rows; for a
        seeded row, a stream of its seed and position apart from the one its token is drawn with."""
        draws = torch.empty(len(states), dtype=torch.float32, device=device)
        draws.uniform_(generator=self._generator(device))
        for i, state in enumerate(states):
            if state.params.seed is not None:
                gen = self._seeded_generator(device)
                gen.manual_seed(mix_seed(state.params.seed ^ _ACCEPT_SALT, len(state.output_token_ids)))
                draws[i] = torch.rand((), generator=gen, device=device)
        return draws

    def _to_host(self, raw_logits: torch.Tensor, sampled: torch.Tensor,
                 states: list[SamplingRequestState]) -> SamplerOutput:
        """The sampled ids and the requested logprobs, brought to the host in one copy (on a GPU, the
        step's only wait for the device)."""
        rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        result: list[dict[int, Logprob] | None] = [None] * len(states)
        if not rows:
            return SamplerOutput(sampled.tolist(), result)
        index = torch.tensor(rows, device=raw_logits.device)
        logprobs = torch.log_softmax(raw_logits.index_select(0, index).float(), dim=1)
        counts = [int(states[i].params.logprobs or 0) for i in rows]  # rows whose logprobs is set
        table = logprob_table(logprobs, sampled.index_select(0, index), max(counts))
        host = torch.cat([sampled.double(), table.flatten()]).tolist()
        width = table.shape[1]
        table_rows = [host[len(states) + k * width:len(states) + (k + 1) * width] for k in range(len(rows))]
        for row, entry in zip(rows, logprob_dicts(table_rows, counts)):
            result[row] = entry
        return SamplerOutput([int(token) for token in host[:len(states)]], result)

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(mix_seed(self.seed, 0))
            self._generators[device] = gen
        return gen

    def _seeded_generator(self, device: torch.device) -> torch.Generator:
        gen = self._seeded_generators.get(device)
        if gen is None:
            gen = self._seeded_generators[device] = torch.Generator(device=device)
        return gen


def has_logit_processors(params: SamplingParams) -> bool:
    """Whether any logit processor may change a row of these parameters (min_tokens counted while it
    could still block a token): when none does, a greedy row's token is the plain argmax of its logits."""
    return params.min_tokens > 0 or _biases_or_penalizes(params)


def _has_processors(state: SamplingRequestState) -> bool:
    """Whether any of _apply_processors' stages changes this row's logits."""
    return bool(_min_tokens_blocked(state)) or _biases_or_penalizes(state.params)


def _biases_or_penalizes(params: SamplingParams) -> bool:
    return bool(params.logit_bias) or params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 \
        or params.frequency_penalty != 0.0


def _min_tokens_blocked(state: SamplingRequestState) -> list[int] | None:
    """Tokens that may not be sampled yet because the request has not reached min_tokens."""
    params = state.params
    if len(state.output_token_ids) >= params.min_tokens:
        return None
    blocked = list(params.stop_token_ids or ())
    if state.eos_token_id is not None and not params.ignore_eos:
        blocked.append(state.eos_token_id)
    return blocked


def _known_tokens(state: SamplingRequestState) -> Sequence[int]:
    if state.known_token_ids is not None:
        return state.known_token_ids
    return [*state.prompt_token_ids, *state.output_token_ids]
