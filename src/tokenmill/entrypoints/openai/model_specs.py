"""Which models a server serves: `tokenmill serve --model A --model B`, a models file (`--models-config`,
YAML or JSON) with per-model engine options, and the body of an admin load request, each read into
`ModelSpec`s: a served name, its aliases and the EngineConfig its engine core starts with.

A models file is a list of entries (or `{"models": [...]}`), each a mapping of EngineConfig options under
their field or flag names (`model`, `kv_cache_memory_bytes` or `kv-cache-memory-bytes`, `dtype`,
`data_parallel_size`, ...) plus:
- `served_model_name`: a name, or vLLM's list of names (the first is the name responses carry, the others
  aliases);
- `aliases`: more names requests may use;
- `load`: false keeps the model known but not loaded at start (an admin load, or a request with
  --load-on-demand, loads it);
- `lora_modules`: adapters of this model, as --lora-modules takes them.
Options an entry leaves out are the command line's engine flags, so `--kv-cache-memory-bytes 1GiB` on the
command line applies to every model that does not set its own.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from tokenmill.config import EngineConfig
from tokenmill.engine.frontend import DEFAULT_MODEL_NAME
from tokenmill.entrypoints.engine_args import add_engine_args, engine_config_from_args
from tokenmill.entrypoints.openai.cli_args import parse_lora_module
from tokenmill.errors import InvalidRequestError, TokenmillError

# Keys of a models-file entry that are not engine options.
SPEC_KEYS = ("served_model_name", "aliases", "load", "lora_modules")


@dataclass(frozen=True)
class ModelSpec:
    """One model the server knows: the name requests use (and its aliases), the engine options it starts with
    (served_model_name set to `name`), whether it loads at start, and its LoRA adapters (name=path)."""

    name: str
    config: EngineConfig
    aliases: tuple[str, ...] = ()
    load_at_start: bool = True
    lora_modules: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


class _RaisingParser(argparse.ArgumentParser):
    """argparse whose errors are exceptions (an admin request's bad option is a 400, not an exit)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise InvalidRequestError(message, "options")


def _option_argv(options: dict[str, Any]) -> list[str]:
    """Engine options as the flags that set them:
    {"kv_cache_memory_bytes": "1GiB"} -> [--kv-cache-memory-bytes, 1GiB]."""
    argv: list[str] = []
    for key, value in options.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (list, tuple)):
            for item in value:
                argv += [flag, _text(item)]
        elif value is not None:
            argv += [flag, _text(value)]
    return argv


def _text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, dict) else str(value)


def default_served_name(config: EngineConfig) -> str:
    """The name the loader gives a model: the embedded default's, a GGUF file's stem, an HF directory's name."""
    if config.served_model_name:
        return config.served_model_name
    if config.model is None:
        return DEFAULT_MODEL_NAME
    path = Path(config.model)
    return path.stem if path.suffix == ".gguf" else path.name


class SpecReader:
    """Reads model entries against the command line's engine flags (the defaults of every entry)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self._parser = _RaisingParser(add_help=False)
        add_engine_args(self._parser)
        engine_names = {action.dest for action in self._parser._actions}
        self._parser.set_defaults(**{k: v for k, v in vars(args).items() if k in engine_names and k != "model"})

    def spec(self, entry: dict[str, Any]) -> ModelSpec:
        """One entry (a models-file item, or an admin load request's fields) as a ModelSpec."""
        if not isinstance(entry, dict):
            raise InvalidRequestError(f"a model entry must be a mapping of options, got {entry!r}", "models")
        options = {k.replace("-", "_"): v for k, v in entry.items()}
        unknown = sorted(set(options) - set(SPEC_KEYS) - {f.name for f in dataclasses.fields(EngineConfig)})
        if unknown:
            raise InvalidRequestError(f"unknown engine option{'s' if len(unknown) > 1 else ''} "
                                      f"{', '.join(unknown)} (see `tokenmill serve --help`)", unknown[0])
        names = options.pop("served_model_name", None)
        aliases = options.pop("aliases", None) or []
        load = options.pop("load", True)
        lora_modules = options.pop("lora_modules", None) or []
        if isinstance(names, (list, tuple)):
            names, aliases = (names[0] if names else None), [*names[1:], *aliases]
        if isinstance(aliases, str) or isinstance(lora_modules, str):
            raise InvalidRequestError("aliases and lora_modules are lists", "aliases")
        if not isinstance(load, bool):
            raise InvalidRequestError(f"load must be true or false, got {load!r}", "load")
        try:
            config = engine_config_from_args(self._parser.parse_args(_option_argv(options)))
        except TokenmillError as exc:
            raise InvalidRequestError(f"model {entry.get('model')!r}: {exc.message}", exc.param or "options") from None
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"model {entry.get('model')!r}: {exc}", "options") from None
        name = str(names) if names else default_served_name(config)
        config = dataclasses.replace(config, served_model_name=name)
        return ModelSpec(name, config, tuple(str(a) for a in aliases), load, tuple(str(m) for m in lora_modules))


def read_models_file(path: str) -> list[dict[str, Any]]:
    """The entries of a models file (YAML or JSON: a list, or a mapping with a `models` list)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InvalidRequestError(f"cannot read the models file {path}: {exc.strerror}", "models_config") from None
    if path.endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"the models file {path} is not valid JSON: {exc}", "models_config") from None
    else:
        import yaml  # YAML is a superset of JSON, so this reads either

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise InvalidRequestError(f"the models file {path} is not valid YAML: {problem}{where}",
                                      "models_config") from None
    if isinstance(data, dict):
        data = data.get("models")
    if not isinstance(data, list) or not data:
        raise InvalidRequestError(f"the models file {path} must list models (a list, or a 'models' list)",
                                  "models_config")
    return data


def model_specs(args: argparse.Namespace, models_file: Optional[str],
                reader: Optional[SpecReader] = None) -> list[ModelSpec]:
    """Every model of `tokenmill serve`: each --model (in order), then the models file's; none given: the
    command line's one model (the embedded default without --model). Names and aliases must not repeat."""
    reader = reader if reader is not None else SpecReader(args)
    cli_models = args.model if isinstance(args.model, list) else ([args.model] if args.model else [])
    entries: list[dict[str, Any]] = []
    if len(cli_models) > 1 and args.served_model_name:
        raise InvalidRequestError("--served-model-name names one model; give several models their names in "
                                  "--models-config", "served_model_name")
    for model in cli_models:
        entries.append({"model": model, "served_model_name": args.served_model_name})
    if models_file:
        entries += read_models_file(models_file)
    if not entries:
        entries.append({"served_model_name": args.served_model_name})
    specs = [reader.spec(entry) for entry in entries]
    check_unique(specs)
    if not any(spec.load_at_start for spec in specs):
        raise InvalidRequestError("at least one model must load at start (load: true)", "models_config")
    return specs


def with_lora_modules(specs: list[ModelSpec], entries: Optional[tuple[str, ...]]) -> list[ModelSpec]:
    """--lora-modules added to the models they adapt: the one a JSON entry's `base_model_name` names (vLLM's
    key), else the first model."""
    specs = list(specs)
    for entry in entries or ():
        base = parse_lora_module(entry)[2]
        index = next((i for i, spec in enumerate(specs) if base in (None, *spec.names)), None)
        if index is None:
            raise InvalidRequestError(f"--lora-modules {entry!r}: no model is named {base!r}", "lora_modules")
        spec = specs[index]
        specs[index] = dataclasses.replace(spec, lora_modules=(*spec.lora_modules, entry))
    return specs


def check_unique(specs: list[ModelSpec], taken: tuple[str, ...] = ()) -> None:
    seen = set(taken)
    for spec in specs:
        for name in spec.names:
            if name in seen:
                raise InvalidRequestError(f"the model name {name!r} is used twice; give each model its own "
                                          "served_model_name", "served_model_name")
            seen.add(name)
