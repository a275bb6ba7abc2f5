"""Find a model on disk and expose its config, tokenizer and weights in one shape.

`load_model_source` accepts the embedded default GGUF (model=None), an HF directory
(config.json + safetensors + tokenizer files), a .gguf file, or a directory holding one .gguf.
Everything is read with local_files_only=True: loading a model never touches the network.
Weights are not read here; `ModelSource.iter_weights` streams them one tensor at a time so the
model builder can copy each into place without two copies of the model in memory.
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.errors import ModelLoadError
from tokenmill.model import gguf_loader
from tokenmill.model.chat_templates import ensure_chat_template
from tokenmill.model.default_model import DEFAULT_MODEL_NAME, default_model_path
from tokenmill.model.layers.linear import Int8Blocks
from tokenmill.model.mapped_pages import file_mappings, release_mapped_pages
from tokenmill.model.registry import CHECKPOINT_RENAMES, MODEL_REGISTRY

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger("tokenmill")

# HF architectures with a tokenmill implementation: the registry's.
SUPPORTED_ARCHITECTURES: frozenset[str] = frozenset(MODEL_REGISTRY)

_SAFETENSORS_INDEX = "model.safetensors.index.json"
# Buffers older checkpoints saved next to the parameters; they are recomputed, never loaded.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True, slots=True)
class WeightsSource:
    """A ModelSource for the weights only, as plain data (the HF config as its dict) for another process."""

    hf_config: dict[str, Any]
    architecture: str
    served_model_name: str
    path: str
    is_gguf: bool

    def model_source(self) -> "ModelSource":
        """The ModelSource it stands for, without a tokenizer (the config rebuilt from its dict)."""
        from transformers import CONFIG_MAPPING

        values = dict(self.hf_config)
        hf_config = CONFIG_MAPPING[values["model_type"]].from_dict(values)
        return ModelSource(hf_config, self.architecture, None, self.served_model_name, Path(self.path), self.is_gguf)


@dataclass(slots=True)
class ModelSource:
    hf_config: PretrainedConfig
    architecture: str
    tokenizer: PreTrainedTokenizerBase | None  # None where only the weights are loaded (WeightsSource)
    served_model_name: str
    path: Path
    is_gguf: bool
    # The GGUFReader that read the config, handed to the first iter_weights and then dropped so a
    # long-lived ModelSource does not pin its per-field numpy views.
    _gguf_reader: Any = field(default=None, repr=False, compare=False)

    def for_weights(self) -> "WeightsSource":
        """What a process that only loads the weights needs (a tensor-parallel worker), as plain data: it
        never reads the config or tokenizer again."""
        return WeightsSource(self.hf_config.to_dict(), self.architecture, self.served_model_name, str(self.path),
                             self.is_gguf)

    def has_int8_block_matrices(self) -> bool:
        """Whether the file holds matrices in a type the block kernels run as stored (a GGUF's Q8_0, Q4_0/1,
        Q5_0/1, Q4_K, Q5_K): those stay block-quantized unless --quantization none."""
        if not self.is_gguf:
            return False
        reader = self._gguf_reader if self._gguf_reader is not None else gguf_loader.open_gguf(self.path)
        return gguf_loader.has_int8_block_matrices(reader)

    def iter_weights(self, dtype: torch.dtype, int8_blocks: dict[str, Int8Blocks] | None = None,
                     dense_kept: bool = False, rounding: gguf_loader.Q8_0Rounding | None = None,
                     kernels: ModuleType | None = None, stored_dtype: bool = False,
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields (HF parameter name, tensor in dtype), one tensor alive at a time.

        lm_head.weight is absent when the embeddings are tied and the file stores no head. With
        `int8_blocks`, a GGUF's block-quantized matrices are kept there as stored and yielded as
        shape-only tensors unless `dense_kept` (see gguf_loader.iter_gguf_weights), and so are the
        matrices `rounding` names in other types, rounded to Q8_0; other formats leave it empty.
        `kernels`: tokenmill's C++ module, which decodes a GGUF's common types faster (same values).
        `stored_dtype`: safetensors' tensors come as the file stores them (a view of the mapped file, valid
        until the next one is asked for), for a consumer that converts as it copies or rounds: no float32
        copy of a whole matrix (an 8B model's embedding is 2 GB in float32).
        """
        if self.is_gguf:
            reader, self._gguf_reader = self._gguf_reader, None
            yield from gguf_loader.iter_gguf_weights(self.path, self.hf_config, dtype, reader, int8_blocks,
                                                     dense_kept, rounding, kernels)
        else:
            yield from _iter_safetensors(self.path, None if stored_dtype else dtype,
                                         CHECKPOINT_RENAMES.get(self.architecture, ()))


def load_model_source(model: str | None, tokenizer: str | None = None) -> ModelSource:
    """Resolve `model` (None = the embedded default) into a ModelSource; ModelLoadError if unusable."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path} (models are loaded from local files only)")
    is_default = model is None or _same_file(path, default_model_path_or_none())
    if path.is_dir():
        gguf_file = _single_gguf_in(path)
        if gguf_file is None:
            return _load_hf_dir(path, tokenizer)
        path = gguf_file
    if path.suffix.lower() != ".gguf":
        raise ModelLoadError(f"not a model directory or .gguf file: {path}")
    source = _load_gguf(path, tokenizer)
    if is_default:
        source.served_model_name = DEFAULT_MODEL_NAME
    return source


def default_model_path_or_none() -> Path | None:
    try:
        return default_model_path()
    except ModelLoadError:
        return None


def _same_file(a: Path, b: Path | None) -> bool:
    try:
        return b is not None and a.is_file() and b.is_file() and a.samefile(b)
    except OSError:
        return False


def _single_gguf_in(directory: Path) -> Path | None:
    """The GGUF a directory stands for, or None when it is an HF directory."""
    if (directory / "config.json").is_file():
        return None
    ggufs = sorted(p for p in directory.glob("*.gguf") if p.is_file())
    if len(ggufs) == 1:
        return ggufs[0]
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise ModelLoadError(f"{directory} holds several .gguf files ({names}); pass one of them")
    raise ModelLoadError(f"{directory} has neither config.json nor a .gguf file")


def _load_gguf(path: Path, tokenizer: str | None) -> ModelSource:
    reader = gguf_loader.open_gguf(path)
    config, architecture = gguf_loader.read_gguf_config(reader, path)
    tok = _load_tokenizer(Path(tokenizer).expanduser()) if tokenizer else gguf_loader.load_gguf_tokenizer(path)
    _add_known_chat_template(tok, architecture, path)
    return ModelSource(
        hf_config=config,
        architecture=architecture,
        tokenizer=tok,
        served_model_name=path.stem,
        path=path,
        is_gguf=True,
        _gguf_reader=reader,
    )


def _load_hf_dir(directory: Path, tokenizer: str | None) -> ModelSource:
    from transformers import AutoConfig

    directory = directory.resolve()
    architecture = _hf_architecture(directory)
    if not _safetensors_files(directory):
        raise ModelLoadError(f"no *.safetensors weights in {directory} (pytorch .bin files are not supported)")
    try:
        config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # transformers raises ValueError/KeyError/OSError for bad configs
        raise ModelLoadError(f"cannot read {directory / 'config.json'}: {exc}".splitlines()[0]) from None
    tok = _load_tokenizer(Path(tokenizer).expanduser() if tokenizer else directory)
    _add_known_chat_template(tok, architecture, directory)
    return ModelSource(
        hf_config=config,
        architecture=architecture,
        tokenizer=tok,
        served_model_name=directory.name,
        path=directory,
        is_gguf=False,
    )


def _add_known_chat_template(tokenizer: PreTrainedTokenizerBase, architecture: str, path: Path) -> None:
    if ensure_chat_template(tokenizer, architecture):
        logger.info("%s carries no chat template; using tokenmill's %s template", path.name, architecture)


def _hf_architecture(directory: Path) -> str:
    """Checked from the raw JSON first so an unsupported model fails with a clear message."""
    try:
        raw = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {directory / 'config.json'}: {exc}") from None
    architectures = raw.get("architectures") or []
    if not architectures and raw.get("model_type") == "llama":
        architectures = ["LlamaForCausalLM"]  # configs saved from a bare LlamaConfig omit the list
    supported = [a for a in architectures if a in SUPPORTED_ARCHITECTURES]
    if not supported:
        found = ", ".join(architectures) or f"model_type={raw.get('model_type')!r}"
        raise ModelLoadError(
            f"unsupported architecture {found} in {directory.name} "
            f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
        )
    return supported[0]


def _load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    if path.is_file() and path.suffix.lower() == ".gguf":
        return gguf_loader.load_gguf_tokenizer(path)
    if not path.is_dir():
        raise ModelLoadError(f"tokenizer path does not exist: {path}")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # missing files show up as OSError or ValueError depending on the class
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {exc}".splitlines()[0]) from None


def _safetensors_files(directory: Path) -> list[Path]:
    """Shards named by the index when there is one (it may list a subset), else every file."""
    index = directory / _SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"bad {index}: {exc}") from None
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{directory.name} is missing shards: {', '.join(missing)}")
        return files
    return sorted(directory.glob("*.safetensors"))


def _iter_safetensors(directory: Path, dtype: torch.dtype | None,
                      renames: tuple[tuple[str, str], ...] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor in dtype; dtype None: as stored, a view of the mapped file valid until the next is asked
    for). Each tensor's pages of the mapping are released once it has been used (see mapped_pages)."""
    from safetensors import safe_open

    for file in _safetensors_files(directory):
        with safe_open(str(file), framework="pt") as handle:
            mapped: list[tuple[int, int]] | None = None  # where the file is mapped: the only pages released
            for name in handle.keys():
                if name.endswith(_SKIPPED_SUFFIXES):
                    continue
                stored = handle.get_tensor(name)
                if mapped is None:
                    mapped = file_mappings(str(file))
                tensor = stored if dtype is None else stored.to(dtype)
                for pattern, replacement in renames:
                    name = re.sub(pattern, replacement, name)
                start, nbytes = stored.data_ptr(), stored.numel() * stored.element_size()
                from_file = any(low <= start and start + nbytes <= high for low, high in mapped)
                if from_file and tensor.data_ptr() != start:  # a converted copy: the file's bytes are read
                    release_mapped_pages(start, nbytes)
                yield name, tensor
                if from_file and tensor.data_ptr() == start:
                    release_mapped_pages(start, nbytes)
