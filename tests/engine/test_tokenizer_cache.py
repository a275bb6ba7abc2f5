"""A GGUF's converted tokenizer is kept (tokenizer_cache) and read back on the next load of the same file:
it behaves as the freshly converted one; a changed file, a damaged entry, a disabled or unwritable cache
all fall back to converting, never to an error."""
from __future__ import annotations

import os
import shutil

import pytest
from test_tokenizer_handover import assert_equivalent

from tokenmill.model import gguf_loader, tokenizer_cache


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("TOKENMILL_CACHE_ROOT", str(root))
    monkeypatch.delenv("TOKENMILL_DISABLE_TOKENIZER_CACHE", raising=False)
    return root


def _forbid_conversion(monkeypatch):
    import transformers

    original = transformers.AutoTokenizer.from_pretrained

    def from_pretrained(*args, **kwargs):
        assert "gguf_file" not in kwargs, "converted the GGUF's tokenizer again"
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)


def test_the_second_load_reads_the_converted_tokenizer_back(cache_root, smollm2_path, monkeypatch):
    converted = gguf_loader.load_gguf_tokenizer(smollm2_path)
    entry = tokenizer_cache.entry_dir(smollm2_path)
    assert entry.parent.parent == cache_root and (entry / "tokenizer.json").is_file()
    assert not [p for p in entry.parent.iterdir() if p.name.startswith(".staging-")]
    _forbid_conversion(monkeypatch)
    cached = gguf_loader.load_gguf_tokenizer(smollm2_path)
    assert_equivalent(converted, cached)


def test_a_changed_file_gets_a_new_entry(cache_root, smollm2_path, tmp_path):
    copy = tmp_path / smollm2_path.name
    shutil.copyfile(smollm2_path, copy)
    before = tokenizer_cache.entry_dir(copy)
    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert tokenizer_cache.entry_dir(copy) != before
    assert tokenizer_cache.entry_dir(smollm2_path) != before  # the path is part of the key too


def test_damaged_disabled_and_unwritable_caches_fall_back(cache_root, smollm2_path, tiny_llama_dir, monkeypatch):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    assert tokenizer.is_fast
    # A damaged entry reads as no entry (the engine converts again).
    entry = tokenizer_cache.entry_dir(smollm2_path)
    entry.mkdir(parents=True)
    (entry / "tokenizer.json").write_text("{not json")
    assert tokenizer_cache.load(smollm2_path) is None
    shutil.rmtree(cache_root)
    # Disabled: nothing is written or read.
    monkeypatch.setenv("TOKENMILL_DISABLE_TOKENIZER_CACHE", "1")
    tokenizer_cache.store(smollm2_path, tokenizer)
    assert not entry.exists() and tokenizer_cache.load(smollm2_path) is None
    monkeypatch.delenv("TOKENMILL_DISABLE_TOKENIZER_CACHE")
    # Unwritable (the root is a file): storing is skipped without an error.
    cache_root.write_text("not a directory")
    tokenizer_cache.store(smollm2_path, tokenizer)
    assert tokenizer_cache.load(smollm2_path) is None
    # Writable again: stored once, read back.
    cache_root.unlink()
    tokenizer_cache.store(smollm2_path, tokenizer)
    assert tokenizer_cache.load(smollm2_path).encode("Hello there") == tokenizer.encode("Hello there")
