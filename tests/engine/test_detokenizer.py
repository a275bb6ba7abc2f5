"""IncrementalDetokenizer on the real SmolLM2 byte-level BPE tokenizer."""
from __future__ import annotations

import random

import pytest

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.sampling_params import SamplingParams

CHAT_PROMPT = "<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n"
MULTIBYTE = "Hello 世界! 🎉🙂 naïve café — 日本語のテキスト 👩‍👩‍👧 end."


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(tok, ids: list[int], chunk: int = 1, prompt: str = CHAT_PROMPT, **params):
    """Feed ids `chunk` at a time; returns (detokenizer, deltas, stop string, steps fed)."""
    detok = IncrementalDetokenizer(tok, encode(tok, prompt), SamplingParams(**params))
    deltas: list[str] = []
    stop = None
    steps = 0
    for start in range(0, len(ids), chunk):
        piece = ids[start:start + chunk]
        steps += 1
        stop = detok.update(piece, finished=start + chunk >= len(ids))
        deltas.append(detok.get_delta())
        if stop is not None:
            break
    return detok, deltas, stop, steps


def test_multibyte_characters_never_stream_broken(tok):
    ids = encode(tok, MULTIBYTE)
    # the premise: several tokens hold only part of a character
    assert sum("\ufffd" in tok.decode([i]) for i in ids) > 10
    detok, deltas, stop, _ = stream(tok, ids)
    assert stop is None
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some steps had to wait for the rest of a character
    assert "".join(deltas) == detok.output_text == tok.decode(ids) == MULTIBYTE


@pytest.mark.parametrize("chunk", [2, 3, 7])
def test_multi_token_updates_match_full_decode(tok, chunk):
    ids = encode(tok, MULTIBYTE * 2)
    detok, deltas, _, _ = stream(tok, ids, chunk=chunk)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == detok.output_text == tok.decode(ids)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_token_ids_concatenate_to_full_decode(tok, skip, seed):
    rng = random.Random(seed)
    # random ids are full of stray UTF-8 fragments; specials (0, 1, 2) are sprinkled in
    ids = [rng.choice((0, 1, 2)) if rng.random() < 0.05 else rng.randrange(len(tok)) for _ in range(300)]
    detok, deltas, _, _ = stream(tok, ids, skip_special_tokens=skip)
    expected = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == detok.output_text == expected


def test_special_tokens_skipped_or_kept(tok):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = encode(tok, "Hi there") + [im_end] + encode(tok, " again") + [im_end]
    detok, deltas, _, _ = stream(tok, ids)
    assert "".join(deltas) == detok.output_text == "Hi there again"
    detok, deltas, _, _ = stream(tok, ids, skip_special_tokens=False)
    assert "".join(deltas) == detok.output_text == "Hi there<|im_end|> again<|im_end|>"


def test_stop_string_across_token_boundary(tok):
    text = "Hello world, stop here please"
    ids = encode(tok, text)
    stop_str = "op he"
    assert not any(stop_str in tok.decode([i]) for i in ids)  # it really spans tokens
    detok, deltas, stop, steps = stream(tok, ids, stop=[stop_str])
    assert stop == stop_str
    assert steps == 5  # matched on " here", the token that completes it
    assert detok.output_text == "Hello world, st"
    assert "".join(deltas) == "Hello world, st"
    # a trailing "o" or "op" might begin "op he", so each is held back until ruled out
    assert deltas == ["Hell", "o world", ",", " st", ""]


def test_stop_string_included_and_rest_of_token_dropped(tok):
    ids = encode(tok, "foo bar baz")  # 'foo', ' bar', ' b', 'az'
    detok, deltas, stop, steps = stream(tok, ids, stop=["ba"], include_stop_str_in_output=True)
    assert (stop, steps) == ("ba", 2)
    assert detok.output_text == "".join(deltas) == "foo ba"  # the 'r' of ' bar' is dropped
    detok, deltas, stop, _ = stream(tok, ids, stop=["ba"])
    assert detok.output_text == "".join(deltas) == "foo "


def test_first_completed_stop_string_wins(tok):
    ids = encode(tok, "The answer is: 42\n\nUser: next")
    stops = ["User:", "\n\n", "answer is: 42\n\nUser"]
    # token by token, "\n\n" is complete before the longer string that starts earlier
    detok, deltas, stop, _ = stream(tok, ids, stop=stops)
    assert stop == "\n\n"
    assert detok.output_text == "".join(deltas) == "The answer is: 42"
    # all at once (e.g. speculative tokens), the match that starts first wins
    detok, deltas, stop, _ = stream(tok, ids, chunk=len(ids), stop=stops)
    assert stop == "answer is: 42\n\nUser"
    assert detok.output_text == "".join(deltas) == "The "


def test_partial_stop_held_back_then_released(tok):
    ids = encode(tok, "value <E and more")  # 'value', ' <', 'E', ' and', ' more'
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["<END>"]))
    seen = []
    for i, token in enumerate(ids):
        assert detok.update([token], finished=i == len(ids) - 1) is None
        seen.append(detok.get_delta())
    assert seen == ["value", " ", "", "<E and", " more"]


def test_partial_stop_then_match(tok):
    ids = encode(tok, "value <E and more <END> tail")
    detok, deltas, stop, _ = stream(tok, ids, stop=["<END>"])
    assert stop == "<END>"
    assert detok.output_text == "".join(deltas) == "value <E and more "


def test_flush_at_finish_releases_partial_character_and_partial_stop(tok):
    ids = encode(tok, "x 🎉")
    cut = ids[:-1]  # the emoji's last byte never arrives
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["🎉!"]))
    for token in cut:
        detok.update([token], finished=False)
    assert detok.get_delta() == "x"
    detok.update([], finished=True)
    rest = detok.get_delta()
    assert "x" + rest == detok.output_text == tok.decode(cut)
    assert rest.endswith("\ufffd")

    ids = encode(tok, "value <E")
    detok, deltas, stop, _ = stream(tok, ids, stop=["<END>"])
    assert stop is None and "".join(deltas) == detok.output_text == "value <E"


def test_update_after_stop_is_ignored(tok):
    ids = encode(tok, "foo bar baz")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["bar"]))
    assert detok.update(ids[:2], finished=False) == "bar"
    assert detok.finished
    assert detok.update(ids[2:], finished=True) is None
    assert detok.output_text == detok.get_delta() == "foo "
    assert detok.get_delta() == ""


def test_prompt_ending_mid_character_does_not_leak_into_output(tok):
    emoji_ids = encode(tok, " 🎉")
    prompt = encode(tok, "Say") + emoji_ids[:-1]  # a token-id prompt cut inside the emoji
    ids = encode(tok, " fine")
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
    detok.update(ids, finished=True)
    assert detok.output_text == tok.decode(ids) == " fine"


def test_decodes_only_a_small_window(tok):
    class CountingTokenizer:
        decoded = 0

        def decode(self, ids, skip_special_tokens=True):
            CountingTokenizer.decoded += len(ids)
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = encode(tok, MULTIBYTE * 10)
    detok = IncrementalDetokenizer(CountingTokenizer(), encode(tok, CHAT_PROMPT), SamplingParams())
    for token in ids:
        detok.update([token], finished=False)
    assert detok.output_text == tok.decode(ids)
    # re-decoding everything each step would be ~len(ids)**2 / 2 token decodes
    assert CountingTokenizer.decoded < 12 * len(ids)
