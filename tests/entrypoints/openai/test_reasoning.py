"""Reasoning parsers (`--reasoning-parser`): replies split into reasoning and content, whole and streamed
(tags arriving split across deltas, never split across the two fields), and end to end on a tiny model whose
tokenizer has the tags, through the official openai client."""
from __future__ import annotations

from dataclasses import dataclass

import httpx
import openai
import pytest

from model_factory import build_thinking_llama
from tokenmill.entrypoints.openai.reasoning import make_reasoning_parser, reasoning_token_count

REPLIES = ["<think>a plan</think>the answer", "a plan</think>the answer", "<think>a plan, unfinished",
           "no thinking at all", "  <think>\nstep</think>\n\nanswer</think>", "<think></think>only answer", ""]


@pytest.mark.parametrize("reply", REPLIES)
def test_whole_replies(reply):
    r1, qwen = make_reasoning_parser("deepseek_r1").split(reply), make_reasoning_parser("qwen3").split(reply)
    if reply.lstrip().startswith("<think>"):
        assert r1 == qwen  # an opened think block reads the same either way
    expected = {
        "<think>a plan</think>the answer": ("a plan", "the answer", "a plan", "the answer"),
        "a plan</think>the answer": ("a plan", "the answer", None, "a plan</think>the answer"),
        "<think>a plan, unfinished": ("a plan, unfinished", "", "a plan, unfinished", ""),
        "no thinking at all": ("no thinking at all", "", None, "no thinking at all"),
        "  <think>\nstep</think>\n\nanswer</think>": ("\nstep", "\n\nanswer</think>", "\nstep", "\n\nanswer</think>"),
        "<think></think>only answer": ("", "only answer", "", "only answer"),
        "": ("", "", None, ""),
    }[reply]
    assert (r1.reasoning, r1.content, qwen.reasoning, qwen.content) == expected


def _stream(name: str, pieces: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    parser = make_reasoning_parser(name)
    deltas = [parser.feed(piece, final=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    return "".join(r for r, _ in deltas), "".join(c for _, c in deltas), deltas


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("reply", [r for r in REPLIES if r])
def test_streamed_replies_match_whole_ones_at_every_split(name, reply):
    """Two deltas cut at every position (tags split across them), and one character at a time."""
    whole = make_reasoning_parser(name).split(reply)
    cuts = [[reply[:i], reply[i:]] for i in range(len(reply) + 1)] + [list(reply)]
    for pieces in cuts:
        reasoning, content, deltas = _stream(name, pieces)
        assert (reasoning, content) == (whole.reasoning or "", whole.content), pieces
        for r, c in deltas:  # a tag never leaks into either field, whole or in part, mid-stream
            assert "<think>" not in r and "</think>" not in r


class _Tokens:
    """A tokenizer whose </think> is one token (id 7), as in Qwen3's and DeepSeek-R1's vocabularies."""

    def encode(self, text, add_special_tokens=False):
        return [7] if text == "</think>" else [ord(ch) for ch in text]


def test_reasoning_tokens_count_up_to_the_end_tag():
    assert reasoning_token_count(_Tokens(), [1, 2, 3, 7, 4], "abc") == 4
    assert reasoning_token_count(_Tokens(), [1, 2, 3], "abc") == 3  # never closed: all reasoning
    assert reasoning_token_count(_Tokens(), [1, 2], None) == 0


# ---- end to end ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory, smollm2_tokenizer, server_log_dir):
    """A tiny random model whose tokenizer has <think> and </think> as tokens, served with deepseek_r1."""
    from server_process import ServerProcess

    directory, tokenizer = build_thinking_llama(tmp_path_factory.mktemp("thinking"), smollm2_tokenizer)
    server = ServerProcess(["--model", str(directory), "--max-model-len", "256", "--num-kv-blocks", "64",
                            "--reasoning-parser", "deepseek_r1"], server_log_dir)
    try:
        yield server.wait_ready(), tokenizer
    finally:
        server.stop()


MESSAGES = [{"role": "user", "content": "Think, then answer."}]


@dataclass
class Thinking:
    """The thinking server's client and the ids of the only tokens the tests let its model write."""

    url: str
    client: openai.OpenAI
    model: str
    start_id: int
    end_id: int
    word_id: int

    def bias(self, end: bool = True) -> dict[str, int]:
        """+100 on <think>, " plan" and (unless `end` is False) </think>: whichever the logits prefer."""
        return {str(self.start_id): 100, str(self.word_id): 100, **({str(self.end_id): 100} if end else {})}

    def chat(self, **kwargs):
        return self.client.chat.completions.create(model=self.model, messages=MESSAGES, temperature=0, **kwargs)

    def streamed(self, **kwargs) -> tuple[str, str, object]:
        """(reasoning, content, the last usage) of a streamed chat reply."""
        reasoning, content, usage = "", "", None
        for chunk in self.chat(stream=True, **kwargs):
            usage = chunk.usage if chunk.usage is not None else usage
            for choice in chunk.choices:
                reasoning += getattr(choice.delta, "reasoning_content", None) or ""
                content += choice.delta.content or ""
        return reasoning, content, usage


@pytest.fixture(scope="module")
def thinking(thinking_server) -> Thinking:
    server, tokenizer = thinking_server
    start_id, end_id = (tokenizer.convert_tokens_to_ids(tag) for tag in ("<think>", "</think>"))
    (word_id,) = tokenizer.encode(" plan", add_special_tokens=False)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=120)
    return Thinking(server.url, client, client.models.list().data[0].id, start_id, end_id, word_id)


def test_replies_split_end_to_end_streamed_and_whole(thinking):
    """The model may only write <think>, </think> or " plan" (logit_bias +100 on each): whichever its logits
    prefer. The chat reply's reasoning and content are deepseek_r1's split of the raw completion of the same
    prompt, whole and streamed, and usage counts the reasoning tokens up to </think>."""
    t = thinking
    prompt = httpx.post(f"{t.url}/tokenize", json={"model": t.model, "messages": MESSAGES},
                        timeout=60).json()["tokens"]
    raw = httpx.post(f"{t.url}/v1/completions", json={
        "model": t.model, "prompt": prompt, "max_tokens": 24, "temperature": 0, "logit_bias": t.bias(),
        "return_tokens_as_token_ids": True, "logprobs": 0}, timeout=60).json()["choices"][0]
    raw_ids = [int(token.removeprefix("token_id:")) for token in raw["logprobs"]["tokens"]]
    assert set(raw_ids) <= {t.start_id, t.end_id, t.word_id} and t.end_id in raw_ids  # the test means something
    expected = make_reasoning_parser("deepseek_r1").split(raw["text"])

    reply = t.chat(max_tokens=24, logit_bias=t.bias())
    message = reply.choices[0].message
    assert (message.reasoning_content, message.content) == (expected.reasoning, expected.content)
    assert message.model_extra["reasoning"] == expected.reasoning
    assert reply.usage.completion_tokens_details.reasoning_tokens == raw_ids.index(t.end_id) + 1

    reasoning, content, usage = t.streamed(max_tokens=24, logit_bias=t.bias(), stream_options={"include_usage": True})
    assert (reasoning, content) == (expected.reasoning, expected.content)
    assert usage.completion_tokens_details.reasoning_tokens == raw_ids.index(t.end_id) + 1


def test_completions_carry_no_reasoning_fields(thinking):
    body = httpx.post(f"{thinking.url}/v1/completions", json={"model": thinking.model, "prompt": "hi",
                                                              "max_tokens": 2}, timeout=60).json()
    assert "completion_tokens_details" not in body["usage"]


def test_a_grammar_starts_after_the_reasoning(thinking):
    """With a reasoning parser, structured outputs shape the answer after </think>, not the reasoning (vLLM's
    behaviour): the reasoning is the unconstrained reply's, the content matches the regex, whole and
    streamed."""
    free = thinking.chat(max_tokens=24, logit_bias=thinking.bias()).choices[0].message
    assert free.content  # the tags' bias ends the reasoning within the budget (else this test shows nothing)
    extra = {"structured_outputs": {"regex": "(yes|no)"}}
    shaped = thinking.chat(max_tokens=24, logit_bias=thinking.bias(), extra_body=extra)
    message = shaped.choices[0].message
    assert message.reasoning_content == free.reasoning_content and message.content in ("yes", "no")
    assert shaped.choices[0].finish_reason == "stop"
    reasoning, content, _ = thinking.streamed(max_tokens=24, logit_bias=thinking.bias(), extra_body=extra)
    assert (reasoning, content) == (message.reasoning_content, message.content)


def test_a_prompt_that_closed_the_think_block_gets_an_answer_only():
    from tokenmill.entrypoints.openai.reasoning import prompt_closed_reasoning

    tags = (5, 6)
    assert prompt_closed_reasoning([1, 5, 2, 6, 3], tags)  # <think> ... </think> in the prompt
    assert not prompt_closed_reasoning([1, 6, 2, 5], tags)  # the prompt opened a new think block
    assert not prompt_closed_reasoning([1, 2], tags) and not prompt_closed_reasoning([1, 6], None)


def test_after_token_grammar_lets_everything_through_until_its_token():
    import torch

    from tokenmill.structured.backend import AfterToken, allocate_token_bitmask

    class OnlyTwo:  # a grammar that allows token 2 only, then ends
        done = False

        def fill_bitmask(self, bitmask, row):
            bitmask[row] = 0
            bitmask[row, 0] = 1 << 2

        def accept_token(self, token):
            self.done = token == 2
            return self.done

        def valid_prefix(self, tokens, stop_before_forced=False):
            return 1 if tokens and tokens[0] == 2 else 0

        def fill_bitmasks_along(self, bitmask, first_row, tokens):
            for row in range(first_row, first_row + len(tokens) + 1):
                self.fill_bitmask(bitmask, row)

        def forced_tokens(self):
            return [2]

        def is_terminated(self):
            return self.done

    gate = AfterToken(OnlyTwo(), token_id=9)
    mask = allocate_token_bitmask(5, 64)
    gate.fill_bitmask(mask, 0)
    assert torch.all(mask[0] == -1) and gate.forced_tokens() == [] and not gate.is_terminated()
    assert gate.valid_prefix([4, 4, 9, 2, 2]) == 4 and gate.valid_prefix([4, 4]) == 2
    gate.fill_bitmasks_along(mask, 0, [4, 9, 2, 3])
    assert torch.all(mask[:2] == -1) and mask[2, 0] == 1 << 2
    assert gate.accept_token(4) and gate.accept_token(9) and gate.forced_tokens() == [2]
    assert gate.accept_token(2) and gate.is_terminated()


def test_a_thinking_budget_forces_the_end_of_the_reasoning(thinking):
    """thinking_token_budget N (vLLM's field): </think> comes at token N + 1 at the latest, whole and
    streamed, and the answer follows. Without the budget this reply reasons past it (checked first)."""
    bias = thinking.bias(end=False)  # </think> not favoured: the reasoning runs long
    free = thinking.chat(max_tokens=12, logit_bias=bias)
    assert free.usage.completion_tokens_details.reasoning_tokens == 12 and not free.choices[0].message.content
    capped = thinking.chat(max_tokens=12, logit_bias=bias, extra_body={"thinking_token_budget": 5})
    assert capped.usage.completion_tokens_details.reasoning_tokens == 6  # five, then the forced </think>
    assert capped.choices[0].message.reasoning_content == free.choices[0].message.reasoning_content[
        :len(capped.choices[0].message.reasoning_content)]
    assert capped.choices[0].message.content  # the answer got the rest of the tokens
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        thinking.chat(max_tokens=4, extra_body={"thinking_token_budget": -1})
