"""Command-line flags generated from a dataclass of `option` fields: the engine's (EngineConfig, vLLM's flag
names) for every CLI command, the server's (entrypoints/openai/cli_args.ServerConfig) for `tokenmill serve`.

A field `max_num_seqs` becomes `--max-num-seqs` with the field's help, default and choices; a bool
becomes `--flag/--no-flag`; a repeatable field collects every use; values pass through the same
conversion and bound the dataclass applies, so a bad value is an argparse error (one line) rather than a
failure after the parse. Each flag and its default is written once, in its field.
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Callable, Optional, Sequence, TypeVar

from tokenmill.config import BOUNDS, EngineConfig, option_types
from tokenmill.errors import InvalidRequestError

_BASE_TYPES = {int: "an integer", float: "a number"}


def _base_type(annotation: Any) -> Any:
    """Optional[int] -> int; Any stays Any."""
    if typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else Any
    return annotation


def _flag_reader(f: dataclasses.Field, base: Any) -> Optional[Callable[[str], Any]]:
    """argparse `type=` for a field: the field's own parser, else its base type plus its conversion and
    bound, with each failure reported as an ArgumentTypeError (argparse's one-line error)."""
    parse, convert, bound = f.metadata.get("parse"), f.metadata.get("convert"), f.metadata.get("bound")
    if parse is not None:
        return parse
    if convert is None and bound is None and base is str:
        return None

    def expected(text: str) -> argparse.ArgumentTypeError:
        wanted = _BASE_TYPES[base]
        if bound is not None:
            noun, must_be = wanted.split()[-1], BOUNDS[bound][1]
            wanted = f"{noun} {must_be}" if must_be.startswith(("in ", "between ")) else f"{must_be} {noun}"
            wanted = ("an " if wanted[0] in "aeiou" else "a ") + wanted
        return argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")

    def read(text: str) -> Any:
        value: Any = text
        if convert is None and base in (int, float):
            try:
                value = base(text)
            except ValueError:
                raise expected(text) from None
        if convert is not None:
            try:
                value = convert(value)
            except InvalidRequestError as exc:
                raise argparse.ArgumentTypeError(exc.message) from None
        if bound is not None and not BOUNDS[bound][0](value):
            raise expected(text)
        return value

    read.__name__ = f.name  # argparse names the type in some of its messages
    return read


def add_engine_args(parser: argparse.ArgumentParser, names: Optional[Sequence[str]] = None,
                    repeatable: Sequence[str] = ()) -> None:
    """Every engine option as a flag (`names`: only those, e.g. for a benchmark tool's command line;
    `repeatable`: options whose every use is kept, as a list, e.g. `tokenmill serve`'s --model)."""
    add_option_args(parser, EngineConfig, "engine", names, repeatable)


def add_option_args(parser: argparse.ArgumentParser, options_class: type, title: str,
                    names: Optional[Sequence[str]] = None, repeatable: Sequence[str] = ()) -> None:
    """Every `option` field of options_class as a flag in an argument group `title` (`names`: only those;
    `repeatable`: string options collected into a list)."""
    group = parser.add_argument_group(title)
    types = option_types(options_class)
    for f in dataclasses.fields(options_class):
        if names is not None and f.name not in names:
            continue
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": f.metadata["help"]}
        base = _base_type(types[f.name])
        if f.name in repeatable:
            kwargs.update(action="append", help=kwargs["help"] + " (repeatable)")
        elif f.metadata.get("repeat"):
            kwargs["action"] = "append"
            if f.metadata["repeat"] == "many":
                kwargs.update(action="extend", nargs="+")
            if f.metadata.get("metavar") is not None:
                kwargs["metavar"] = f.metadata["metavar"]
        elif base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            reader = _flag_reader(f, base)
            if reader is not None:
                kwargs["type"] = reader
            if f.metadata.get("choices") is not None:
                kwargs["choices"] = f.metadata["choices"]
            if f.metadata.get("metavar") is not None:
                kwargs["metavar"] = f.metadata["metavar"]
        group.add_argument(*flags, **kwargs)


Options = TypeVar("Options")


def options_from_args(options_class: type[Options], args: argparse.Namespace) -> Options:
    """An options_class of parsed flags: every field read from `args` by name (a parser without some
    flag leaves that field at its default)."""
    values = vars(args)
    return options_class(**{f.name: values[f.name] for f in dataclasses.fields(options_class) if f.name in values})


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of parsed flags (of one model: `tokenmill serve`'s repeated --model reads through
    entrypoints/openai/model_specs.py)."""
    model = getattr(args, "model", None)
    if isinstance(model, list):
        if len(model) > 1:
            raise InvalidRequestError("several --model flags describe several engines, not one", "model")
        args = argparse.Namespace(**{**vars(args), "model": model[0]})
    return options_from_args(EngineConfig, args)
