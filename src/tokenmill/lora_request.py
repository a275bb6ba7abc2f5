"""A request's LoRA adapter, as vLLM spells it: `LLM.generate(..., lora_request=LoRARequest(name, id, path))`.

The adapter travels with its request to the engine core, whose runner reads it from `lora_path` on first
use (a PEFT directory: adapter_config.json + adapter_model.safetensors) and keeps it in one of its
`--max-loras` slots. Its `cache_salt` keeps its KV blocks apart from the base model's and other adapters'
in the prefix cache (and the offload tier): the same tokens under another adapter have other keys and values.
"""
from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import msgspec

from tokenmill.errors import InvalidRequestError


class LoRARequest(msgspec.Struct, frozen=True):
    lora_name: str
    lora_int_id: int
    lora_path: str

    @property
    def cache_salt(self) -> bytes:
        """What the prefix cache mixes into a request's first block key: the adapter's name and files' path."""
        return hashlib.sha256(f"lora\0{self.lora_name}\0{self.lora_path}".encode()).digest()


# The projections an adapter may target (HF module names) and where its tensors' names say so.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                  "qkv_proj", "gate_up_proj")  # the last two: checkpoints that fuse them (Phi-3)
_TENSOR = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass(frozen=True)
class AdapterLayout:
    """A checked PEFT adapter: its config, and per (layer, module) the ranks of its A/B pair."""

    directory: Path
    config: dict
    ranks: dict[tuple[int, str], int]
    names: dict[tuple[int, str, str], str]  # (layer, module, "A" | "B") -> tensor name in the file


def _bad(path: str, problem: str) -> InvalidRequestError:
    return InvalidRequestError(f"the LoRA adapter at {path} {problem}", "lora_path")


def check_adapter(path: str, num_layers: int, max_rank: int,
                  model_shapes: Optional[dict[str, list[int]]] = None) -> AdapterLayout:
    """Reads a PEFT LoRA directory's adapter_config.json and its safetensors header (no tensors, no torch), and
    refuses, naming the problem, anything tokenmill cannot apply exactly: DoRA, trained biases, saved
    modules, targets other than the decoder's projections, layers the model lacks, ranks above `max_rank`,
    and (with `model_shapes`, module -> [in, out] of the model's projections) an adapter of another model."""
    directory = Path(path).expanduser()
    try:
        config = json.loads((directory / "adapter_config.json").read_text())
        with open(directory / "adapter_model.safetensors", "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    except (OSError, ValueError, struct.error) as exc:
        raise _bad(path, f"cannot be read ({exc})") from None
    problems = []
    if config.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type {config.get('peft_type')} (only LORA)")
    if config.get("use_dora"):
        problems.append("DoRA")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        problems.append("trained biases")
    if config.get("modules_to_save"):
        problems.append(f"modules_to_save {config['modules_to_save']}")
    if config.get("fan_in_fan_out"):
        problems.append("fan_in_fan_out weights")
    if problems:
        raise _bad(path, f"uses {', '.join(problems)}, which tokenmill does not apply")
    shapes: dict[tuple[int, str, str], list[int]] = {}
    names: dict[tuple[int, str, str], str] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        match = _TENSOR.search(name)
        if match is None or match.group(2) not in TARGET_MODULES:
            raise _bad(path, f"holds {name}: tokenmill applies LoRA to q/k/v/o and gate/up/down projections only")
        key = (int(match.group(1)), match.group(2), match.group(3))
        if key[0] >= num_layers:
            raise _bad(path, f"has layer {key[0]}; the model has {num_layers}")
        shapes[key], names[key] = entry["shape"], name
    ranks = {}
    for layer, module in {(layer, module) for layer, module, _ in shapes}:
        a, b = shapes.get((layer, module, "A")), shapes.get((layer, module, "B"))
        if a is None or b is None or len(a) != 2 or len(b) != 2 or a[0] != b[1]:
            raise _bad(path, f"has no matching lora_A / lora_B pair for layer {layer}'s {module}")
        if a[0] > max_rank:
            raise _bad(path, f"has rank {a[0]}, above --max-lora-rank {max_rank}")
        if model_shapes is not None:
            if module not in model_shapes:
                raise _bad(path, f"targets {module}, which this model does not have as a separate projection")
            if not model_shapes[module]:  # [] marks a mixture-of-experts MLP's projections (target_shapes)
                raise _bad(path, f"targets {module}, inside this model's mixture-of-experts layers: adapters may "
                                 "target its attention projections only")
            if [a[1], b[0]] != list(model_shapes[module]):
                raise _bad(path, f"has layer {layer}'s {module} for {a[1]} inputs and {b[0]} outputs; this model's has "
                                 f"{model_shapes[module][0]} and {model_shapes[module][1]} (an adapter of another "
                                 "model?)")
        ranks[(layer, module)] = a[0]
    if not ranks:
        raise _bad(path, "holds no LoRA weights")
    return AdapterLayout(directory, config, ranks, names)
