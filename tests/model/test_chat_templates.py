"""The chat templates tokenmill ships render what the families' own templates render in transformers,
and the loader uses one only when the model's files carry none."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from model_factory import build_tiny_family
from tokenmill.model.chat_templates import GEMMA3_CHAT_TEMPLATE, ensure_chat_template, known_chat_template

# Conversations and what Gemma 3's template (gemma-3-*-it tokenizer_config.json) renders for them
# through transformers' apply_chat_template(tokenize=False).
GEMMA3_CASES = [
    ([{"role": "user", "content": "What is the capital of France?"}], True,
     "<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"),
    # the system message becomes the first user turn's opening paragraph
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}], True,
     "<bos><start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>\n<start_of_turn>model\n"),
    # assistant turns are "model" turns; contents are trimmed
    ([{"role": "user", "content": "  Hello \n"}, {"role": "assistant", "content": "Hi there! "},
      {"role": "user", "content": "Name a river."}], True,
     "<bos><start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\nHi there!<end_of_turn>\n"
     "<start_of_turn>user\nName a river.<end_of_turn>\n<start_of_turn>model\n"),
    # content parts, a system message given as parts, no generation prompt
    ([{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
      {"role": "user", "content": [{"type": "text", "text": "Two"}, {"type": "text", "text": " words"}]},
      {"role": "assistant", "content": "Fine."}], False,
     "<bos><start_of_turn>user\nBe brief.\n\nTwowords<end_of_turn>\n<start_of_turn>model\nFine.<end_of_turn>\n"),
]


def _bare_tokenizer():
    """A tokenizer with Gemma's BOS string and no chat template of its own."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", pad_token="<pad>")


@pytest.mark.parametrize("messages, add_generation_prompt, expected", GEMMA3_CASES)
def test_gemma3_template_renders_like_transformers(messages, add_generation_prompt, expected):
    tokenizer = _bare_tokenizer()
    assert ensure_chat_template(tokenizer, "Gemma3ForCausalLM")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert text == expected


def test_gemma3_template_requires_alternating_roles():
    tokenizer = _bare_tokenizer()
    ensure_chat_template(tokenizer, "Gemma3ForCausalLM")
    with pytest.raises(Exception, match="must alternate"):
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                                      tokenize=False)


def test_a_template_the_model_carries_wins():
    tokenizer = _bare_tokenizer()
    tokenizer.chat_template = "{{ messages[0]['content'] }}"
    assert not ensure_chat_template(tokenizer, "Gemma3ForCausalLM")
    assert tokenizer.chat_template == "{{ messages[0]['content'] }}"
    assert known_chat_template("LlamaForCausalLM") is None
    bare = _bare_tokenizer()
    assert not ensure_chat_template(bare, "LlamaForCausalLM") and not bare.chat_template


def _strip_chat_template(directory: Path) -> None:
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))


def test_loader_gives_a_gemma3_model_without_a_template_gemmas(tmp_path, smollm2_tokenizer):
    from tokenmill.model.loader import load_model_source

    directory = build_tiny_family(tmp_path / "gemma3", smollm2_tokenizer, "gemma3")
    kept = load_model_source(str(directory)).tokenizer.chat_template
    assert kept and kept != GEMMA3_CHAT_TEMPLATE  # the checkpoint's own (SmolLM2's) template

    bare = tmp_path / "gemma3-bare"
    shutil.copytree(directory, bare)
    _strip_chat_template(bare)
    assert load_model_source(str(bare)).tokenizer.chat_template == GEMMA3_CHAT_TEMPLATE
