"""The tokenizer the engine core hands the API process (tokenizer_handover) behaves as the one the core
loaded: same ids, same text back, same chat prompts, same special tokens; and rebuilding it imports no
torch."""
from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap

import pytest

from tokenmill.engine.tokenizer_handover import tokenizer_files, tokenizer_from_files
from tokenmill.model.loader import load_model_source

TEXTS = [
    "Hello, world!",
    "  leading spaces, trailing spaces   ",
    "tabs\tand\nnew\n\nlines\r\n",
    "naïve café, Größe, Ærø, São Paulo",
    "中文文本，日本語のテキスト，한국어 텍스트",
    "emoji 🙂🚀👩‍👩‍👧 and symbols ∑∫√ ≤ ≥ ≠",
    "مرحبا بالعالم — שלום עולם",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "{\"json\": [1, 2.5, null, true], \"nested\": {\"k\": \"v\"}}",
    "1234567890 3.14159 -42 1e-9",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Hi 🙂"},
     {"role": "assistant", "content": "Hello."},
     {"role": "user", "content": "Translate 'naïve' to German."}],
]


def _strings(tokenizer) -> list[str]:
    """TEXTS, plus text around each special token written out (which a tokenizer parses as the token)."""
    specials = list(tokenizer.all_special_tokens)
    return TEXTS + [f"before {token} after" for token in specials] + ["".join(specials) + " tail"]


def assert_equivalent(original, rebuilt) -> None:
    for text in _strings(original):
        for special in (True, False):
            ids = original.encode(text, add_special_tokens=special)
            assert rebuilt.encode(text, add_special_tokens=special) == ids, (text, special)
            for skip in (True, False):
                assert rebuilt.decode(ids, skip_special_tokens=skip) == original.decode(ids, skip_special_tokens=skip)
            assert rebuilt.convert_ids_to_tokens(ids) == original.convert_ids_to_tokens(ids)
    every_id = list(range(len(original)))
    assert rebuilt.convert_ids_to_tokens(every_id) == original.convert_ids_to_tokens(every_id)
    assert rebuilt.decode(every_id[:2000]) == original.decode(every_id[:2000])
    assert len(rebuilt) == len(original)
    for name in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id", "eos_token", "bos_token",
                 "pad_token", "all_special_ids", "all_special_tokens", "chat_template"):
        assert getattr(rebuilt, name) == getattr(original, name), name
    assert original.chat_template
    for messages in CONVERSATIONS:
        for generation_prompt in (True, False):
            rendered = original.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
            assert rebuilt.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=generation_prompt) == rendered
            assert rebuilt.encode(rendered, add_special_tokens=False) == \
                original.encode(rendered, add_special_tokens=False)


def _handed_over(tokenizer):
    # The files cross a process boundary as msgpack bytes; pickling stands in for that here.
    return tokenizer_from_files(pickle.loads(pickle.dumps(tokenizer_files(tokenizer))))


def test_the_default_gguf_models_tokenizer_survives_the_handover():
    original = load_model_source(None).tokenizer  # the embedded SmolLM2 GGUF, converted by transformers
    assert_equivalent(original, _handed_over(original))


def test_a_safetensors_models_tokenizer_survives_the_handover(tiny_llama_dir):
    original = load_model_source(str(tiny_llama_dir)).tokenizer
    assert_equivalent(original, _handed_over(original))


def test_a_tokenizer_of_its_own_class_survives_the_handover(gemma3_270m_gguf):
    # Gemma's is a GemmaTokenizer (SentencePiece-style, 262k tokens); the API process rebuilds the base class.
    original = load_model_source(str(gemma3_270m_gguf)).tokenizer
    rebuilt = _handed_over(original)
    assert type(rebuilt) is not type(original)
    assert_equivalent(original, rebuilt)


def test_the_differences_the_check_looks_for_are_caught():
    # The equivalence check itself can fail: a changed chat template, a lost special token.
    original = load_model_source(None).tokenizer
    files = tokenizer_files(original)
    files["chat_template.jinja"] = files["chat_template.jinja"].replace(b"<|im_start|>", b"<|im_begin|>")
    with pytest.raises(AssertionError):
        assert_equivalent(original, tokenizer_from_files(files))


def test_rebuilding_the_tokenizer_imports_no_torch(tmp_path):
    path = tmp_path / "files.pkl"
    path.write_bytes(pickle.dumps(tokenizer_files(load_model_source(None).tokenizer)))
    script = textwrap.dedent(f"""
        import pickle, sys
        from tokenmill.engine.tokenizer_handover import tokenizer_from_files
        tokenizer = tokenizer_from_files(pickle.loads(open({str(path)!r}, "rb").read()))
        assert tokenizer.encode("Hello") and tokenizer.chat_template
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
