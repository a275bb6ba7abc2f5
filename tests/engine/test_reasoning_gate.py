"""The engine side of reasoning models (structured.backend.AfterToken): the grammar starts after `</think>` and
thinking_token_budget forces it; n-gram speculative decoding (whose drafts the gate checks) gives the same
greedy tokens as plain decoding."""
from __future__ import annotations

import re

from model_factory import build_thinking_llama
from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def test_the_gate_holds_with_and_without_speculation(tmp_path, smollm2_tokenizer):
    directory, tokenizer = build_thinking_llama(tmp_path, smollm2_tokenizer)
    start_id, end_id = (tokenizer.convert_tokens_to_ids(tag) for tag in ("<think>", "</think>"))
    (word_id,) = tokenizer.encode(" plan", add_special_tokens=False)
    prompt = "Think about it. Think about it. Think about it."  # repeated text: n-grams to draft from
    cases = [  # (budget, regex)
        (4, None),  # the budget alone: </think> is the fifth token
        (6, "(yes|no)( plan)*"),  # both: </think> by the seventh token, then the grammar
        (None, "(yes|no)( plan)*"),  # a grammar after whatever reasoning the model writes
    ]
    params = [SamplingParams(temperature=0, max_tokens=20, logit_bias={start_id: 100, word_id: 100, end_id: 100 if
                                                                      budget is None else 0},
                             reasoning_end_token_id=end_id, thinking_token_budget=budget,
                             structured_outputs=None if regex is None else StructuredOutputsParams(regex=regex))
              for budget, regex in cases]
    kwargs = dict(num_kv_blocks=128, max_model_len=256)
    plain = LLM(str(directory), **kwargs).generate([prompt] * len(cases), params, use_tqdm=False)
    spec = LLM(str(directory), speculative_config=NGRAM, **kwargs).generate([prompt] * len(cases), params,
                                                                            use_tqdm=False)
    for (budget, regex), ours, theirs in zip(cases, plain, spec):
        ids = list(ours.outputs[0].token_ids)
        assert ids == list(theirs.outputs[0].token_ids)
        assert end_id in ids, ids
        if budget is not None:
            assert ids.index(end_id) <= budget
        if regex is not None:
            answer = tokenizer.decode(ids[ids.index(end_id) + 1:], skip_special_tokens=True)
            assert re.fullmatch(regex, answer), answer
